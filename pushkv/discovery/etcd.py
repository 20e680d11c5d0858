"""etcd as the registry: supervisors announce instances under a lease, routers watch.

Client choice: etcd's v3 JSON gateway (``/v3/...``, served by every etcd since 3.3 on the client
port; Debian's etcd 3.4.23 here), over ``http.client`` for the announcer (sync: it lives in the
supervisor's loop) and over aiohttp for the watcher (asyncio: it lives in the router), both
already in the project. No new dependency. The alternatives weighed:

- ``etcd3`` (python-etcd3, gRPC): last release 2020, generated protobuf code that breaks with
  protobuf >= 4 unless pinned back; unmaintained;
- ``aetcd`` (asyncio, gRPC): maintained, but async only (the supervisor is sync) and brings
  grpcio + protobuf (tens of MB of wheels) for the half-dozen calls we make;
- ``etcd3gw`` (OpenStack, the same JSON gateway): maintained, but sync only, over ``requests``
  + ``futurist``, watching from a thread.

What we use of the API is small: auth/authenticate, lease grant/keepalive/revoke/timetolive,
kv put/range/txn and one watch stream; the calls, authentication and errors are
``etcd_gateway.py``. Credentials are the operator's, from the registry URL (``etcd_keys.py``).

Key layout, the withdrawal marker that tells "withdrawn" from "lease expired", and the watcher's
view are pure and live in ``etcd_keys.py``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Union

from pushkv.discovery.etcd_gateway import (  # noqa: F401
    CALL_TIMEOUT_S,
    AsyncGateway,
    EtcdAuthError,
    EtcdError,
    EtcdUnavailable,
    SyncGateway,
    target_of,
)
from pushkv.discovery.etcd_keys import (
    EtcdTarget,
    RegistryView,
    b64,
    instance_key,
    instances_prefix,
    marker_key,
    marker_value,
    range_end,
)
from pushkv.discovery.records import DiscoveryEvent, InstanceRecord, encode_record

log = logging.getLogger(__name__)

LEASE_TTL_S = 5  # a host that stops refreshing is gone from the registry after at most this
RETRY_S = 0.5  # while etcd is unreachable, the announcer first tries again after this (then backs off)
WATCH_IDLE_S = 10.0  # a watch stream silent this long is re-opened (a dead TCP path stays silent)
WATCH_BACKOFF_S = (0.2, 2.0)  # reconnect backoff: first, most


class EtcdAnnouncer:
    """Supervisor side (sync): one lease per announcer, every record under it.

    ``tick(now)`` refreshes the lease every TTL/3. When etcd cannot be reached, calls fail
    within ``CALL_TIMEOUT_S`` (the owner's loop blocks that long) and are retried after
    ``retry_delay_s`` (from ``RETRY_S`` doubling to TTL/3); when a refresh finds the lease
    gone (the host was cut off longer than the TTL, or etcd lost it), a new lease is granted and
    every record put again: the host rejoins on its first successful contact. Withdrawals that
    could not reach etcd are retried the same way (else the key would live on the kept lease)."""

    def __init__(self, url: Union[str, EtcdTarget], ttl_s: int = LEASE_TTL_S,
                 timeout_s: float = CALL_TIMEOUT_S, retry_s: float = RETRY_S, rejoin: bool = True):
        """``rejoin=False``: a lost lease forgets the records instead of putting them again
        (``leases_lost`` counts it): the owner (a supervisor) restarts those instances and
        announces them afresh, since the router has failed their work meanwhile."""
        self.target = target_of(url)
        self.rejoin = rejoin
        self.leases_lost = 0
        self.last_ok = 0.0  # monotonic time of the last answer that kept the lease alive
        self.ttl_s, self.retry_s = int(ttl_s), retry_s
        self.gw = SyncGateway(self.target, timeout_s)
        self.records: dict[tuple[str, str], InstanceRecord] = {}
        self.unput: set[tuple[str, str]] = set()  # announced, not yet in etcd under this lease
        self.unwithdrawn: set[tuple[str, str]] = set()  # withdrawn here, maybe still in etcd
        self.lease_id = 0
        self.next_contact = 0.0
        self.leases_granted = 0
        self.failures = 0

    # -- the interface ------------------------------------------------------------------
    def connect(self) -> None:
        """Authenticate, take a lease and try what the host will do with it now: raises EtcdAuthError for bad
        credentials, no user where etcd asks for one, or a user not granted the prefix (a probe key under it is
        written and deleted, the instances read), and EtcdUnavailable when etcd cannot be reached, so a
        misconfigured host fails at start, before any process does."""
        self.gw.authenticate()
        self._grant(time.monotonic())
        probe = b64(f"{self.target.prefix}/probe/{self.lease_id:x}")
        self.gw.call("kv/put", {"key": probe, "value": b64("ok"), "lease": str(self.lease_id)})
        self.gw.call("kv/deleterange", {"key": probe})
        check_readable(self.gw, self.target)

    def announce(self, record: InstanceRecord) -> None:
        name = (record.role, record.engine_id)
        self.records[name] = record
        self.unwithdrawn.discard(name)
        self.unput.add(name)
        self._sync(time.monotonic())

    def withdraw(self, engine_id: str, role: str) -> None:
        name = (role, engine_id)
        self.records.pop(name, None)
        self.unput.discard(name)
        self.unwithdrawn.add(name)
        self._sync(time.monotonic())

    def tick(self, now: float) -> None:
        if now >= self.next_contact:
            self._refresh(now)

    def close(self) -> None:
        """Withdraw every record (one transaction, with the marker) and revoke the lease;
        best effort: an unreachable etcd lets the lease lapse instead."""
        self.unwithdrawn |= set(self.records)
        self.records.clear()
        self.unput.clear()
        try:
            if self.lease_id:
                self._flush_withdrawals()
                self.gw.call("lease/revoke", {"ID": str(self.lease_id)})
        except EtcdError as e:
            log.warning("etcd close: %s (the lease lapses within %ss)", e, self.ttl_s)
        self.lease_id = 0
        self.gw.drop()

    # -- inside -----------------------------------------------------------------------
    def _grant(self, now: float) -> None:
        got = self.gw.call("lease/grant", {"TTL": self.ttl_s})
        self.lease_id = int(got["ID"])
        self.leases_granted += 1
        self.last_ok = now
        self.unput |= set(self.records)
        self.next_contact = now + self.ttl_s / 3
        log.info("etcd %s: lease %x (TTL %ss)", self.target.redacted(), self.lease_id, self.ttl_s)

    def _refresh(self, now: float) -> None:
        try:
            if self.lease_id:
                got = self.gw.call("lease/keepalive", {"ID": str(self.lease_id)}).get("result", {})
                if int(got.get("TTL", 0) or 0) <= 0:
                    log.warning("etcd lease %x was lost (cut off longer than %ss?): rejoining",
                                self.lease_id, self.ttl_s)
                    self.lose()
                else:
                    self.next_contact = now + self.ttl_s / 3
                    self.last_ok = now
            if not self.lease_id:
                self._grant(now)
            self._flush(now)
        except EtcdAuthError:
            raise
        except EtcdError as e:
            self._failed(now, e)

    def lapsed(self, now: float) -> bool:
        """True once our lease has surely expired in etcd: no refresh answered for a TTL (we
        are cut off from etcd, or it is down). Known here without reaching etcd, so a host
        cut off drops its work at about the time the router sees it leave."""
        return bool(self.lease_id) and now - self.last_ok > self.ttl_s

    def lose(self) -> None:
        """The lease is gone (lapsed, or etcd said so): the next contact takes a new one; with
        ``rejoin`` every record is put again under it, else the records are forgotten."""
        self.lease_id = 0
        self.leases_lost += 1
        if not self.rejoin:
            self.records.clear()
            self.unput.clear()
            self.unwithdrawn.clear()  # their keys went with the lease

    def _sync(self, now: float) -> None:
        """Push pending puts/withdrawals now if we hold a lease and etcd answered last time
        (else the next contact the backoff allows does)."""
        if not self.lease_id or self.failures:
            self.tick(now)
            return
        try:
            self._flush(now)
        except EtcdAuthError:
            raise
        except EtcdError as e:
            self._failed(now, e)

    def _flush(self, now: float) -> None:
        self._flush_withdrawals()
        for name in sorted(self.unput):
            role, eid = name
            self.gw.call("kv/put", {"key": b64(instance_key(self.target.prefix, role, eid)),
                                    "value": b64(encode_record(self.records[name])),
                                    "lease": str(self.lease_id)})
            self.unput.discard(name)
        self.failures = 0

    def _flush_withdrawals(self) -> None:
        if not self.unwithdrawn:
            return
        names = sorted(self.unwithdrawn)
        ops = [{"request_delete_range": {"key": b64(instance_key(self.target.prefix, r, e))}}
               for r, e in names]
        ops.append({"request_put": {"key": b64(marker_key(self.target.prefix, self.lease_id)),
                                    "value": b64(marker_value(names)),
                                    "lease": str(self.lease_id)}})
        self.gw.call("kv/txn", {"success": ops})
        self.unwithdrawn.clear()

    def _failed(self, now: float, e: EtcdError) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning("etcd %s unreachable: %s (retrying from %ss, backing off to %.2fs)",
                        self.target.redacted(), e, self.retry_s, retry_delay_s(99, self.retry_s, self.ttl_s))
        self.next_contact = now + retry_delay_s(self.failures, self.retry_s, self.ttl_s)


def check_readable(gw: SyncGateway, target: EtcdTarget) -> None:
    """Read the registry's instances as a router will (``kv/range``, one key): raises as ``EtcdAnnouncer.connect``
    does where the credentials or the grants do not allow it (the gateway authenticates first, where it has not)."""
    head = instances_prefix(target.prefix)
    gw.call("kv/range", {"key": b64(head), "range_end": range_end(head), "limit": 1})


def retry_delay_s(failures: int, retry_s: float, ttl_s: float) -> float:
    """How long the announcer waits after its ``failures``-th failed contact in a row: doubling
    from ``retry_s`` up to the refresh period TTL/3, so that an unreachable etcd costs the
    owner's loop at most one call timeout per TTL/3 while a short blip is retried at once."""
    return min(retry_s * 2 ** max(failures - 1, 0), max(retry_s, ttl_s / 3))


class EtcdWatcher:
    """Router side (asyncio): a range over the instances, then one watch from that revision.

    ``await start()`` (or the first ``events()``) authenticates and takes the snapshot; an
    EtcdAuthError there means bad credentials. The watch is re-opened after a break or
    ``WATCH_IDLE_S`` of silence from the last revision seen, so nothing is missed; when etcd has
    compacted past it, a new range is diffed against the view (Downs "gone while the watch was
    down")."""

    def __init__(self, url: Union[str, EtcdTarget], idle_s: float = WATCH_IDLE_S):
        self.target = target_of(url)
        self.idle_s = idle_s
        self.view = RegistryView(self.target.prefix)
        self.gw = AsyncGateway(self.target)
        self._started = False
        self._closed = False
        self.reconnects = 0

    async def start(self) -> None:
        if not self._started:
            await self.gw.authenticate()
            self._initial = await self._load()
            self._started = True

    def snapshot(self) -> list[InstanceRecord]:
        return list(self.view.records.values())

    async def _load(self) -> list[DiscoveryEvent]:
        head = instances_prefix(self.target.prefix)
        got = await self.gw.call("kv/range", {"key": b64(head), "range_end": range_end(head)})
        rev = int(got["header"]["revision"])
        return self.view.load(got.get("kvs", []), rev)

    async def events(self) -> AsyncIterator[DiscoveryEvent]:
        await self.start()
        for ev in self._initial:  # everything present at the snapshot (Up each)
            yield ev
        self._initial = []
        backoff = WATCH_BACKOFF_S[0]
        while not self._closed:
            try:
                async for ev in self._watch_once():
                    backoff = WATCH_BACKOFF_S[0]
                    yield ev
            except EtcdAuthError:
                raise
            except EtcdError as e:
                if self._closed:
                    return
                self.reconnects += 1
                log.warning("etcd watch broke (%s); reconnecting in %.1fs", e, backoff)
                await asyncio.sleep(backoff)  # retry pacing while etcd is unreachable
                backoff = min(backoff * 2, WATCH_BACKOFF_S[1])
                try:
                    await self.gw.authenticate()  # the token may have expired meanwhile
                except EtcdAuthError:
                    raise
                except EtcdError:
                    continue

    async def _watch_once(self) -> AsyncIterator[DiscoveryEvent]:
        """One watch stream from the view's revision; returns when it goes idle."""
        prefix = self.target.prefix + "/"
        body = {"create_request": {"key": b64(prefix), "range_end": range_end(prefix),
                                   "start_revision": str(self.view.revision + 1), "prev_kv": True}}
        async for msg in self.gw.watch(body, self.idle_s):
            if "error" in msg:
                raise EtcdUnavailable(f"etcd watch: {msg['error']}")
            res = msg.get("result", {})
            if int(res.get("compact_revision", 0) or 0) or res.get("canceled"):
                log.warning("etcd watch from %s cancelled (%s); resyncing by range",
                            self.view.revision + 1, res.get("cancel_reason") or "compacted")
                for ev in await self._load():
                    yield ev
                return
            events = res.get("events") or []
            if not events:
                continue
            rev = max(int(e["kv"].get("mod_revision", 0) or 0) for e in events)
            live = frozenset([d.lease_id for d in self.view.unexplained_deletes(events)
                              if await self._lease_alive(d.lease_id)])
            for ev in self.view.apply(events, rev, live):
                yield ev

    async def _lease_alive(self, lease_id: int) -> bool:
        got = await self.gw.call("lease/timetolive", {"ID": str(lease_id)})
        return int(got.get("TTL", -1) or -1) > 0

    async def close(self) -> None:
        self._closed = True
        await self.gw.close()
