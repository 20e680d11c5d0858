"""D writer's side of push: count WRITE completions until the KV is all here.

One expectation per (transfer id, generation): the D blocks registered with P
and the P ranks that write into them (``tp.producers_for``). ``Received`` is
emitted once every producer reported :class:`WriteDone` for that generation;
a :class:`WriteFailed`, a cancel or the deadline emits ``Failed`` instead.
Each expectation ends exactly once. Duplicate, unknown and stale completions
are counted and dropped (they come from peers, so they never raise).

Caution for the caller: after ``Failed`` from a deadline or a cancel, a
producer's WRITE may still be in flight into these blocks (P keeps its own
blocks pinned for the same reason). Reusing the D blocks at once risks a late
WRITE landing in another request's KV; ``outstanding(...)`` says which
producers have not reported yet.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pushkv.messages import WriteDone, WriteFailed
from pushkv.protocol._deadlines import Deadlines
from pushkv.protocol.actions import Action, Count, Failed, ProtocolError, Received

__all__ = ["KVArrivals", "Received", "Failed", "Count", "ProtocolError"]

REMEMBER_FINISHED = 4096


@dataclass
class _Expect:
    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    producers: frozenset[int]
    deadline: Optional[float]
    done: dict[int, WriteDone] = field(default_factory=dict)


class KVArrivals:
    def __init__(self, remember: int = REMEMBER_FINISHED):
        self._live: dict[str, _Expect] = {}
        self._finished: OrderedDict[tuple[str, int], bool] = OrderedDict()
        self._remember = remember
        self._deadlines: Deadlines[str] = Deadlines(self._deadline_of)

    def expect(
        self, transfer_id: str, generation: int, block_ids: Sequence[int],
        producers: Sequence[int], deadline: float,
    ) -> list[Action]:
        """Start waiting for (transfer_id, generation); ``deadline`` is absolute."""
        if not producers:
            raise ValueError(f"transfer_id={transfer_id}: expect needs at least one producer")
        old = self._live.get(transfer_id)
        if (transfer_id, generation) in self._finished:
            raise ProtocolError("finished", "expect", transfer_id, generation)
        if old is not None and old.generation >= generation:
            state = "waiting" if old.generation == generation else "newer_generation_waiting"
            raise ProtocolError(state, "expect", transfer_id, generation)
        out: list[Action] = []
        if old is not None:
            out = self._end(old, Failed(transfer_id, old.generation,
                                        f"superseded by generation {generation}"))
            out.append(Count("superseded"))
        e = _Expect(transfer_id, generation, tuple(block_ids), frozenset(producers), deadline)
        self._live[transfer_id] = e
        self._deadlines.arm(transfer_id, deadline)
        return out

    def on_write_done(self, msg: WriteDone, now: float) -> list[Action]:
        e = self._match(msg.transfer_id, msg.generation)
        if e is None:
            return [Count(self._miss_counter(msg.transfer_id, msg.generation, "write_done"))]
        if msg.p_rank not in e.producers:
            return [Count("unexpected_producer")]
        if msg.p_rank in e.done:
            return [Count("duplicate_write_done")]
        e.done[msg.p_rank] = msg
        if e.done.keys() < e.producers:
            return []
        firsts = {d.first_token for d in e.done.values()}
        first = e.done[min(e.done)].first_token
        out = self._end(e, Received(
            e.transfer_id, e.generation, first,
            sum(d.nbytes for d in e.done.values()), sum(d.num_descs for d in e.done.values()),
        ))
        if len(firsts) > 1:
            out.append(Count("first_token_mismatch"))
        return out

    def on_write_failed(self, msg: WriteFailed, now: float) -> list[Action]:
        e = self._match(msg.transfer_id, msg.generation)
        if e is None:
            return [Count(self._miss_counter(msg.transfer_id, msg.generation, "write_failed"))]
        reason = f"P rank {msg.p_rank}: {msg.reason}"
        return self._end(e, Failed(e.transfer_id, e.generation, reason)) + [Count("write_failed")]

    def cancel(self, transfer_id: str, generation: int, reason: str, now: float) -> list[Action]:
        e = self._match(transfer_id, generation)
        if e is None:
            return [Count("cancel_ignored")]
        return self._end(e, Failed(transfer_id, generation, reason)) + [Count("cancelled")]

    def expire(self, now: float) -> list[Action]:
        out: list[Action] = []
        for tid in self._deadlines.due(now):
            e = self._live[tid]
            missing = sorted(e.producers - e.done.keys())
            reason = f"KV not received by the deadline (no WriteDone from P ranks {missing})"
            out += self._end(e, Failed(tid, e.generation, reason)) + [Count("expired_arrival")]
        return out

    def next_deadline(self) -> Optional[float]:
        return self._deadlines.next()

    def outstanding(self, transfer_id: str, generation: int) -> Optional[list[int]]:
        """Producers that have not reported yet, or None when not waiting."""
        e = self._match(transfer_id, generation)
        return None if e is None else sorted(e.producers - e.done.keys())

    def state_of(self, transfer_id: str, generation: int) -> Optional[str]:
        if self._match(transfer_id, generation) is not None:
            return "waiting"
        ok = self._finished.get((transfer_id, generation))
        return None if ok is None else ("received" if ok else "failed")

    def __len__(self) -> int:
        return len(self._live)

    # ---------------------------------------------------------------- helpers
    def _match(self, tid: str, gen: int) -> Optional[_Expect]:
        e = self._live.get(tid)
        return e if e is not None and e.generation == gen else None

    def _miss_counter(self, tid: str, gen: int, what: str) -> str:
        if (tid, gen) in self._finished:
            return f"late_{what}"
        e = self._live.get(tid)
        if e is not None and gen < e.generation:
            return f"stale_{what}"
        return f"unknown_{what}"

    def _end(self, e: _Expect, outcome: Action) -> list[Action]:
        del self._live[e.transfer_id]
        e.deadline = None
        self._finished[(e.transfer_id, e.generation)] = isinstance(outcome, Received)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        return [outcome]

    def _deadline_of(self, tid: str) -> Optional[float]:
        e = self._live.get(tid)
        return None if e is None else e.deadline
