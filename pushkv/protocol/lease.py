"""Pull mode, P side: finished blocks pinned under a lease until D has READ them.

``hold`` pins until ``now + lease_s``; every D rank that reads reports
``ReadDone``; when ``readers_expected`` distinct ranks have, the blocks are
freed and the transfer completes (order "pull"). A lease that runs out frees
the blocks and fails the transfer (counted ``lease_expired``). Each held lease
ends with exactly one :class:`FreeBlocks`.

``renew``: D still means to read (the request waits in D's queue, or its READ
is in flight), so the deadline moves to ``now + lease_s`` -- but never past
``held_at + lease_max_s``, the hard cap, so a D that renews forever cannot pin
P's blocks forever. A lease that runs out after a renewal was clipped by the
cap fails with its own reason (counted ``lease_cap_reached`` too). A renewal
is peer input: one for a lease that is unknown, finished, of another
generation or already past its deadline is counted, never raised.

D's ``ReadDone`` and ``CancelTransfer`` may come before the ``hold``: they travel from D's writer
(a NIXL notification, the handshake link) while the hold comes from P's scheduler on its own
socket, and D READs as soon as the router relays P's block ids, which P's scheduler sends beside
the hold. Such an answer for a transfer never held is kept (the last ``REMEMBER_FINISHED``) and
taken by its hold, which then ends at once; dropped, it left the blocks pinned until the lease
ran out and the transfer counted failed.

Caution: an expired lease frees blocks a slow D READ may still be reading;
``lease_s`` must exceed D's own READ deadline so D gives up first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pushkv.protocol._deadlines import Deadlines
from pushkv.protocol.actions import Action, Completed, Count, Failed, FreeBlocks, ProtocolError

__all__ = ["Leases", "FreeBlocks", "Completed", "Failed", "Count", "ProtocolError"]

REMEMBER_FINISHED = 4096


@dataclass
class _Lease:
    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    deadline: float
    held_at: float = 0.0
    readers: set[int] = field(default_factory=set)
    renewals: int = 0
    capped: bool = False  # a renewal was clipped at held_at + lease_max_s: the deadline is final


@dataclass
class _Early:
    """D's answers for a transfer not held yet."""
    readers: set[int] = field(default_factory=set)
    expected: int = 0
    cancel: Optional[str] = None  # D cancelled: the reason


class Leases:
    def __init__(self, lease_s: float, lease_max_s: Optional[float] = None, remember: int = REMEMBER_FINISHED):
        """``lease_max_s`` (default ``lease_s``: renewals cannot extend a lease) caps every lease,
        renewed or not, at that many seconds after its hold."""
        lease_max_s = lease_s if lease_max_s is None else lease_max_s
        if lease_max_s < lease_s:
            raise ValueError(f"lease_max_s ({lease_max_s}) must be >= lease_s ({lease_s})")
        self.lease_s = lease_s
        self.lease_max_s = lease_max_s
        self._live: dict[str, _Lease] = {}
        self._finished: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._remember = remember
        self._early: OrderedDict[tuple[str, int], _Early] = OrderedDict()
        self._deadlines: Deadlines[str] = Deadlines(self._current_deadline)

    def hold(self, transfer_id: str, generation: int, block_ids: Sequence[int], now: float) -> list[Action]:
        """Pin blocks until ``now + lease_s``; an older generation's lease is released."""
        old = self._live.get(transfer_id)
        if (transfer_id, generation) in self._finished:
            raise ProtocolError("finished", "hold", transfer_id, generation)
        if old is not None and old.generation >= generation:
            raise ProtocolError("held", "hold", transfer_id, generation)
        out: list[Action] = []
        if old is not None:
            out = self._end(old, f"superseded by generation {generation}", ok=False)
            out.append(Count("stale_lease"))
        e = _Lease(transfer_id, generation, tuple(block_ids), now + self.lease_s, now)
        self._live[transfer_id] = e
        self._deadlines.arm(transfer_id, now + self.lease_s)
        early = self._early.pop((transfer_id, generation), None)
        if early is None:
            return out
        if early.cancel is not None:
            return out + self._end(e, early.cancel, ok=False) + [Count("lease_cancelled_before_hold")]
        e.readers |= early.readers
        if len(e.readers) >= early.expected:
            return out + self._end(e, "read", ok=True) + [Count("lease_read_before_hold")]
        return out

    def renew(self, transfer_id: str, generation: int, now: float) -> list[Action]:
        """D still means to read: the deadline moves to ``now + lease_s``, clipped at the cap."""
        e = self._match(transfer_id, generation)
        if e is None:
            if (transfer_id, generation) in self._finished:
                return [Count("lease_renew_late")]  # raced the last ReadDone, or came after expiry
            old = self._live.get(transfer_id)
            return [Count("lease_renew_stale" if old and generation < old.generation else "lease_renew_unknown")]
        if now >= e.deadline:  # it ran out: the next expire() ends it, a renewal cannot revive it
            return [Count("lease_renew_expired")]
        cap = e.held_at + self.lease_max_s
        if now + self.lease_s >= cap:  # clipped: the deadline is final from now on
            e.capped = True
            self._set_deadline(e, cap)
            return [Count("lease_renew_capped")]
        self._set_deadline(e, now + self.lease_s)
        e.renewals += 1
        return [Count("lease_renewed")]

    def deadline_of(self, transfer_id: str, generation: int) -> Optional[float]:
        e = self._match(transfer_id, generation)
        return None if e is None else e.deadline

    def on_read_done(
        self, transfer_id: str, generation: int, d_rank: int, readers_expected: int
    ) -> list[Action]:
        e = self._match(transfer_id, generation)
        if e is None:
            if (transfer_id, generation) in self._finished:
                return [Count("late_read_done")]
            old = self._live.get(transfer_id)
            if old and generation < old.generation:
                return [Count("stale_read_done")]
            early = self._early_of(transfer_id, generation)
            early.readers.add(d_rank)
            early.expected = readers_expected
            return [Count("read_done_before_hold")]
        if d_rank in e.readers:
            return [Count("duplicate_read_done")]
        e.readers.add(d_rank)
        if len(e.readers) < readers_expected:
            return []
        return self._end(e, "read", ok=True)

    def release(self, transfer_id: str, generation: int, reason: str = "released") -> list[Action]:
        """Free now without an outcome: the caller knows the READ is over."""
        e = self._match(transfer_id, generation)
        if e is None:
            return [Count("release_ignored")]
        return self._end(e, reason, ok=None)

    def cancel(self, transfer_id: str, generation: int, reason: str, now: float) -> list[Action]:
        e = self._match(transfer_id, generation)
        if e is None:
            old = self._live.get(transfer_id)
            if (transfer_id, generation) in self._finished or (old and generation < old.generation):
                return [Count("cancel_ignored")]
            self._early_of(transfer_id, generation).cancel = reason  # its hold may be on its way
            return [Count("cancel_before_hold")]
        return self._end(e, reason, ok=False) + [Count("lease_cancelled")]

    def expire(self, now: float) -> list[Action]:
        out: list[Action] = []
        for tid in self._deadlines.due(now):
            e = self._live[tid]
            if e.capped:
                reason = (f"lease reached its cap of {self.lease_max_s:g}s (lease_max_s) after "
                          f"{e.renewals} renewals: D had not read the KV by then")
                out += self._end(e, reason, ok=False) + [Count("lease_cap_reached")]
            else:
                out += self._end(e, f"lease of {self.lease_s}s expired", ok=False)
            out.append(Count("lease_expired"))
        return out

    def next_deadline(self) -> Optional[float]:
        return self._deadlines.next()

    def held_blocks(self) -> list[int]:
        return [b for e in self._live.values() for b in e.block_ids]

    def __len__(self) -> int:
        return len(self._live)

    def _current_deadline(self, tid: str) -> Optional[float]:
        e = self._live.get(tid)
        return None if e is None else e.deadline

    def _set_deadline(self, e: _Lease, deadline: float) -> None:
        if deadline > e.deadline:
            e.deadline = deadline
            self._deadlines.arm(e.transfer_id, deadline)

    def _early_of(self, tid: str, gen: int) -> _Early:
        early = self._early.get((tid, gen))
        if early is None:
            early = self._early[(tid, gen)] = _Early()
            while len(self._early) > self._remember:
                self._early.popitem(last=False)
        return early

    def _match(self, tid: str, gen: int) -> Optional[_Lease]:
        e = self._live.get(tid)
        return e if e is not None and e.generation == gen else None

    def _end(self, e: _Lease, reason: str, ok: Optional[bool]) -> list[Action]:
        del self._live[e.transfer_id]  # its heap entries die with it (_current_deadline reads _live)
        self._finished[(e.transfer_id, e.generation)] = None
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        out: list[Action] = [FreeBlocks(e.transfer_id, e.generation, e.block_ids, reason)]
        if ok is True:
            out.append(Completed(e.transfer_id, e.generation, "pull"))
        elif ok is False:
            out.append(Failed(e.transfer_id, e.generation, reason))
        return out
