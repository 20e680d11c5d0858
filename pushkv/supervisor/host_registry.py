"""This host's instances in the registry, for a supervisor of one host among several
(``pushkv up --role prefill|decode``): put once ready, out while restarting, and news of a lost
lease, which the supervisor answers by restarting its instances.

No answer from etcd for a TTL is not a lost lease: etcd may be down for every host (then no lease
expires, and etcd extends every lease when it comes back) or this host may be cut off from it
(then the router saw our lease expire and failed our work). From here the two look alike, so the
instances keep serving meanwhile, and the lease is judged when etcd answers again: still alive,
nothing happened; expired, the lease is lost (restart, then announce afresh)."""
from __future__ import annotations

import logging
import os

import msgspec

from pushkv.config import DeploymentConfig
from pushkv.discovery.local import record_of

log = logging.getLogger(__name__)


class HostRegistry:
    """Over an ``EtcdAnnouncer(rejoin=False)`` (anything with its interface)."""

    def __init__(self, cfg: DeploymentConfig, announcer):
        self.cfg = cfg
        self.announcer = announcer
        self._leases_lost = announcer.leases_lost
        self.out_of_contact = False  # no refresh answered for a TTL; cleared when etcd answers

    def _inst(self, name: str):
        return next(i for i in self.cfg.instances() if i.name == name)

    def announce(self, name: str) -> None:
        """Instance ``name`` (``prefill``, ``decode1``, ...) is ready: put its record."""
        self.announcer.announce(record_of(self.cfg, self._inst(name), os.getpid()))

    def withdraw(self, name: str) -> None:
        inst = self._inst(name)
        if (inst.role, inst.engine_id) in self.announcer.records:
            self.announcer.withdraw(inst.engine_id, inst.role)

    def mark_draining(self) -> list[str]:
        """The host stops with --shutdown-timeout: put every record it holds in the registry again, marked
        ``draining`` (routers choose those instances for no new request, and leave their requests in flight alone);
        the engine ids marked. An instance restarting (out of the registry) is not put back."""
        ann = self.announcer
        marked = []
        for rec in [r for r in ann.records.values() if not r.draining]:
            ann.announce(msgspec.structs.replace(rec, draining=True))
            marked.append(rec.engine_id)
        return marked

    @property
    def marks_landed(self) -> bool:
        """Every record this host holds is in etcd as last announced (its draining mark too): none waits for a put
        that etcd did not take yet (out of reach, the put is retried as the backoff allows)."""
        ann = self.announcer
        return not set(ann.records) & ann.unput

    @property
    def in_contact(self) -> bool:
        """We hold a lease: etcd answered since the last loss."""
        return bool(self.announcer.lease_id)

    def tick(self, now: float) -> bool:
        """Keep the lease; True when etcd said it was lost while our instances were in the
        registry (it expired: the router saw them leave and failed their work)."""
        ann = self.announcer
        announced = bool(ann.records)
        ann.tick(now)
        if announced and ann.lapsed(now) and not self.out_of_contact:
            self.out_of_contact = True
            log.error("registry: no refresh answered for %ss (etcd down, or this host cut off from it): the "
                      "instances keep serving; the lease is checked when etcd answers", ann.ttl_s)
        lost, self._leases_lost = ann.leases_lost != self._leases_lost, ann.leases_lost
        if self.out_of_contact and not ann.lapsed(now):
            self.out_of_contact = False
            log.warning("registry: etcd answers again; the lease %s", "was lost" if lost else "held")
        return lost and announced

    def close(self) -> None:
        self.announcer.close()
