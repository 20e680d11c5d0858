"""The interface the router and the supervisor use (implementations: ``local``, ``etcd``)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from pushkv.discovery.records import DiscoveryEvent, InstanceRecord


class Announcer(Protocol):
    """Supervisor side: keep this host's instances registered while they live."""

    def announce(self, record: InstanceRecord) -> None:
        """Register (or refresh) ``record``; it stays while the announcer keeps it alive."""

    def withdraw(self, engine_id: str, role: str) -> None:
        """Remove one instance at once (it stopped or is restarting)."""

    def tick(self, now: float) -> None:
        """Keep leases alive; called from the owner's loop."""

    def close(self) -> None:
        """Withdraw everything and release the lease."""


class Watcher(Protocol):
    """Router side: the current instances, then every change."""

    def snapshot(self) -> list[InstanceRecord]: ...

    def events(self) -> AsyncIterator[DiscoveryEvent]:
        """InstanceUp for every instance present and each that appears, InstanceDown for
        each that leaves (lease lapsed, withdrawn, or its processes died)."""
        ...

    async def close(self) -> None: ...
