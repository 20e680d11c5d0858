"""This host's instances in the registry, for a supervisor of one host among several
(``pushkv up --role prefill|decode``): put once ready, out while restarting, and news of a lost
lease, which the supervisor answers by stopping its instances until etcd answers again."""
from __future__ import annotations

import logging
import os

from pushkv.config import DeploymentConfig
from pushkv.discovery.local import record_of

log = logging.getLogger(__name__)


class HostRegistry:
    """Over an ``EtcdAnnouncer(rejoin=False)`` (anything with its interface)."""

    def __init__(self, cfg: DeploymentConfig, announcer):
        self.cfg = cfg
        self.announcer = announcer
        self._leases_lost = announcer.leases_lost

    def _inst(self, name: str):
        return next(i for i in self.cfg.instances() if i.name == name)

    def announce(self, name: str) -> None:
        """Instance ``name`` (``prefill``, ``decode1``, ...) is ready: put its record."""
        self.announcer.announce(record_of(self.cfg, self._inst(name), os.getpid()))

    def withdraw(self, name: str) -> None:
        inst = self._inst(name)
        if (inst.role, inst.engine_id) in self.announcer.records:
            self.announcer.withdraw(inst.engine_id, inst.role)

    @property
    def in_contact(self) -> bool:
        """We hold a lease: etcd answered since the last loss."""
        return bool(self.announcer.lease_id)

    def tick(self, now: float) -> bool:
        """Keep the lease; True when it was lost while our instances were in the registry (no
        refresh answered for a TTL: the lease expired in etcd and the router failed their work;
        or etcd said so). Known without reaching etcd, so a cut-off host learns it by itself."""
        ann = self.announcer
        announced = bool(ann.records)
        ann.tick(now)
        if announced and ann.lapsed(now):
            log.error("registry lease lapsed (no refresh answered for %ss): this host is out of the registry",
                      ann.ttl_s)
            ann.lose()
        lost, self._leases_lost = ann.leases_lost != self._leases_lost, ann.leases_lost
        return lost and announced

    def close(self) -> None:
        self.announcer.close()
