"""D's receive side as a pure part: registered transfers in, effects out (the vLLM writer's D).

It holds the arrivals machine (``KVArrivals``: every producer rank's completion) and the
producer table (``sides.Producers``: which P ranks still write each transfer, and the failed ones
quarantined until none can). No socket, NIXL agent or clock (``now`` is an argument); the peer
table is a question it asks (``connected(engine id, rank)``). Its effects, performed in order:

- ``A.Received``: every producer's bytes are in the blocks;
- ``sides.Tell``: tell that P rank to stop writing (``CancelTransfer``);
- :class:`Lost`: the blocks failed, and no WRITE can land in them any more;
- ``A.Count``: a counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.writer import sides

Key = sides.Key


@dataclass(frozen=True)
class Lost:
    """D: the transfer's blocks failed to arrive, and nothing lands in them any more."""

    key: Key
    reason: str


class ReceiveSide:
    def __init__(self, transfer_s: float, connected: Callable[[str, int], bool]):
        self.transfer_s = transfer_s  # how long a failed transfer's producers may still write
        self.connected = connected
        self.arrivals = ar.KVArrivals()
        self.producers = sides.Producers()

    def pending(self) -> bool:
        return sides.pending(self.arrivals) or bool(self.producers.quarantine)

    def expect(self, key: Key, engine_id: str, ranks: list[int], block_ids, deadline: float, now: float) -> list:
        """Register ``key``'s blocks for ``ranks`` of ``engine_id`` (raises on a bad registration)."""
        acts = self.arrivals.expect(key[0], key[1], block_ids, ranks, deadline)
        self.producers.expect(key, engine_id, ranks)
        return self._effects(acts, now)

    def completion(self, msg: "m.WriteDone | m.WriteFailed", peer: Optional[tuple[str, int]], now: float) -> list:
        """A producer's WriteDone / WriteFailed, from ``peer`` (engine id, rank; None: unknown):
        it counts only from that transfer's producer rank."""
        key = (msg.transfer_id, msg.generation)
        verdict, released = self.producers.completion(key, peer, msg.p_rank)
        out: list = [A.Count("completion_from_wrong_peer")] if verdict == "wrong_peer" else []
        out += _lost(released)
        if verdict == "counts":
            acts = (self.arrivals.on_write_done(msg, now) if isinstance(msg, m.WriteDone)
                    else self.arrivals.on_write_failed(msg, now))
            out += self._effects(acts, now)
        return out

    def cancel(self, key: Key, reason: str, now: float) -> list:
        return self._effects(self.arrivals.cancel(key[0], key[1], reason, now), now)

    def rank_gone(self, engine_id: str, rank: int, reason: str, now: float) -> list:
        """A producer rank died: nothing of it can still write; its transfers fail now."""
        released, failing = self.producers.rank_gone(engine_id, rank)
        out = _lost(released)
        for key in failing:
            out += self.cancel(key, reason, now)
        return out

    def expire(self, now: float) -> list:
        return self._effects(sides.due(self.arrivals, now), now) + _lost(self.producers.quarantine.expired(now))

    def _effects(self, actions: list, now: float) -> list:
        out: list = []
        for a in actions:
            if isinstance(a, A.Received):
                self.producers.received((a.transfer_id, a.generation))
                out.append(a)
            elif isinstance(a, A.Failed):
                out += self._fail((a.transfer_id, a.generation), a.reason, now)
            elif isinstance(a, A.Count):
                out.append(a)
        return out

    def _fail(self, key: Key, reason: str, now: float) -> list:
        """Tell P to stop; the blocks are lost only once no WRITE can still land."""
        tell, held = self.producers.fail(key, reason, now + self.transfer_s, self.connected)
        out: list = [sides.Tell(peer, m.CancelTransfer(key[0], key[1], reason)) for peer in tell]
        return out if held else out + [Lost(key, reason)]


def _lost(released: list) -> list:
    return [Lost(key, held.reason) for key, held in released]
