"""The writer's roles as pure sides: the protocol machines' actions in, effects out.

pushkv's writers (``prefill.py``, ``decode.py``) and the vLLM writer (``vllm/writer.py``)
are shells around the same machines (``PushRendezvous`` on P, ``KVArrivals`` on D). What
they decide alike lives here once, holding no socket, NIXL agent or clock (``now`` is an
argument), like the scheduler's core and its outbox:

- :class:`PrefillSide` turns the rendezvous' actions into effects (post this WRITE, tell
  these D ranks it failed, report the freed blocks with their outcome, count, drop the
  failed transfer's queued WRITEs); the shell performs them in order.
- :class:`Quarantine` keeps D's failed transfers whose producer ranks may still write into
  their blocks, and says which to hand back (every rank answered, its producer died, or the
  deadline passed).
- :class:`Producers` (the vLLM writer's D) tracks which producer ranks still write each
  transfer: a completion counts only from its producer rank, and a failed transfer is held
  while a rank may still write.
- :func:`due` and :func:`pending` are the deadline checks of ``tick`` and ``has_pending``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, Union

from pushkv import messages as m
from pushkv.protocol import actions as A

Key = tuple[str, int]  # (transfer id, generation)
Outcome = Union[A.Completed, A.Failed]
Verdict = Literal["counts", "wrong_peer", "quarantined"]  # of a completion at D
MAX_TRACKED = 4096  # bounded bookkeeping for transfers that never free their blocks


# -- effects -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Post:
    """P: post this WRITE (its share to each registered D rank)."""

    write: A.PostWrite
    swap_dest: bool = False  # fault tests of --kv-verify only (``kv_damage.py``): two destination blocks swapped


@dataclass(frozen=True)
class Tell:
    """Send ``msg`` to the writer of D rank ``peer`` (engine id, rank), if connected."""

    peer: tuple[str, int]
    msg: m.Msg


@dataclass
class PrefillTransfer:
    """What P's writer keeps per transfer until its blocks are freed."""

    d_engine_id: str = ""  # the D instance that registered (for peer death)
    outcome: Optional[Outcome] = None  # until FreeBlocks reports it
    nbytes: int = 0  # of the WRITE, once posted
    num_descs: int = 0
    write_s: float = 0.0  # post to completion (the last WRITE)
    parts: int = 0  # streamed part WRITEs posted
    stages: dict[str, float] = field(default_factory=dict)  # writer-side timeline (wall time)
    first_queued: float = 0.0  # monotonic: its first WRITE's turn in a link queue (order "deadline")


@dataclass(frozen=True)
class Report:
    """P: the blocks may be freed; report the transfer (its outcome, what moved) to whoever owns them."""

    free: A.FreeBlocks
    transfer: PrefillTransfer

    @property
    def outcome(self) -> Optional[Outcome]:
        return self.transfer.outcome

    @property
    def ok(self) -> bool:
        return isinstance(self.outcome, A.Completed)

    @property
    def reason(self) -> str:
        """Why it failed: the failure's own reason, else the free's ("" when it completed)."""
        if self.ok:
            return ""
        return self.outcome.reason if isinstance(self.outcome, A.Failed) else self.free.reason


@dataclass(frozen=True)
class Drop:
    """P: the transfer failed; WRITEs of it still queued (link queue, staging room) never go."""

    key: Key
    reason: str


Effect = Union[Post, Tell, Report, Drop, A.Count]


# -- P -------------------------------------------------------------------------------------
class PrefillSide:
    """The rendezvous' actions of one P rank as effects. It keeps each transfer's record (its
    outcome, what moved) until its blocks are freed: a failure may come batches before its
    drained WRITE frees them."""

    def __init__(self, rank: int, max_tracked: int = MAX_TRACKED):
        self.rank = rank
        self.max_tracked = max_tracked
        self.transfers: dict[Key, PrefillTransfer] = {}

    def record(self, key: Key) -> PrefillTransfer:
        """The transfer's record, made on first use."""
        t = self.transfers.get(key)
        if t is None:
            t = self.transfers[key] = PrefillTransfer()
            while len(self.transfers) > self.max_tracked:  # halves that never paired (expired, cancelled)
                self.transfers.pop(next(iter(self.transfers)))
        return t

    def effects(self, actions: list) -> list[Effect]:
        out: list[Effect] = []
        for a in actions:  # outcomes first: a FreeBlocks in the same batch reports them
            if isinstance(a, (A.Completed, A.Failed)):
                self.record((a.transfer_id, a.generation)).outcome = a
                out.append(A.Count(f"rendezvous_{a.order}" if isinstance(a, A.Completed) else "transfers_failed"))
        for a in actions:
            if isinstance(a, A.PostWrite):
                out.append(Post(a))
            elif isinstance(a, A.NotifyFailure):
                out += [Tell((r.d_engine_id, r.d_rank), m.WriteFailed(a.transfer_id, a.generation, self.rank,
                                                                       a.reason)) for r in a.registrations]
            elif isinstance(a, A.FreeBlocks):
                out.append(Report(a, self.transfers.pop((a.transfer_id, a.generation), PrefillTransfer())))
            elif isinstance(a, A.Count):
                out.append(a)
        out += [Drop((a.transfer_id, a.generation), a.reason) for a in actions if isinstance(a, A.Failed)]
        return out


# -- D -------------------------------------------------------------------------------------
@dataclass
class Held:
    """A failed transfer whose producers may still be writing into its blocks: the blocks go
    back once every outstanding rank answered, its producer died, or at the deadline."""

    outstanding: set[int]
    deadline: float
    reason: str
    engine_id: str
    slots: Optional[list[int]] = None  # --staging pushkv: given back with the blocks


class Quarantine:
    """D's held transfers, by key. Each method returns the ``(key, Held)`` pairs released,
    whose blocks the shell now hands back (reporting each transfer failed with its reason)."""

    def __init__(self) -> None:
        self.held: dict[Any, Held] = {}

    def __contains__(self, key: Any) -> bool:
        return key in self.held

    def __len__(self) -> int:
        return len(self.held)

    def get(self, key: Any) -> Optional[Held]:
        return self.held.get(key)

    def hold(self, key: Any, engine_id: str, outstanding: set[int], deadline: float, reason: str,
             slots: Optional[list[int]] = None) -> None:
        self.held[key] = Held(set(outstanding), deadline, reason, engine_id, slots)

    def answered(self, key: Any, rank: int) -> list[tuple[Any, Held]]:
        """Producer rank ``rank`` of ``key`` reported (done or failed): it writes no more."""
        q = self.held.get(key)
        if q is None:
            return []
        q.outstanding.discard(rank)
        return [] if q.outstanding else [(key, self.held.pop(key))]

    def rank_gone(self, engine_id: str, rank: int) -> list[tuple[Any, Held]]:
        """Producer rank ``rank`` of ``engine_id`` died: it writes no more into any transfer."""
        out = []
        for key, q in list(self.held.items()):
            if q.engine_id == engine_id and rank in q.outstanding:
                out += self.answered(key, rank)
        return out

    def engine_gone(self, engine_id: str) -> list[tuple[Any, Held]]:
        """Every rank of ``engine_id`` died."""
        return [(k, self.held.pop(k)) for k in [k for k, q in self.held.items() if q.engine_id == engine_id]]

    def expired(self, now: float) -> list[tuple[Any, Held]]:
        return [(k, self.held.pop(k)) for k in [k for k, q in self.held.items() if q.deadline <= now]]


class Producers:
    """D: the P engine and the ranks still writing each registered transfer, and the failed
    ones held in :class:`Quarantine` until none can still write (the vLLM writer's table)."""

    def __init__(self) -> None:
        self.writing: dict[Any, tuple[str, set[int]]] = {}
        self.quarantine = Quarantine()

    def expect(self, key: Any, engine_id: str, ranks) -> None:
        self.writing[key] = (engine_id, set(ranks))

    def received(self, key: Any) -> None:
        self.writing.pop(key, None)

    def completion(self, key: Any, peer: Optional[tuple[str, int]], p_rank: int) -> tuple[Verdict, list]:
        """A WriteDone / WriteFailed of ``key`` claiming ``p_rank``, from ``peer`` (engine id,
        rank; None: not a known peer). Returns whether it goes to the arrivals machine
        ("counts"; "wrong_peer": not from the producer rank; "quarantined": the transfer failed
        already) and the quarantined transfers it releases. The producer rank writes no more."""
        src, held = self.writing.get(key), self.quarantine.get(key)
        engine = src[0] if src is not None else held.engine_id if held is not None else None
        if engine is not None and peer != (engine, p_rank):
            return "wrong_peer", []
        if src is not None:
            src[1].discard(p_rank)
        if held is not None:
            return "quarantined", self.quarantine.answered(key, p_rank)
        return "counts", []

    def fail(self, key: Any, reason: str, deadline: float, connected) -> tuple[list[tuple[str, int]], bool]:
        """``key`` failed: the producer ranks to tell to stop (``connected(engine, rank)``), and
        whether it is held (some can still write) rather than failed now."""
        engine, ranks = self.writing.pop(key, ("", set()))
        tell = [(engine, r) for r in ranks if connected(engine, r)]
        if tell:
            self.quarantine.hold(key, engine, ranks, deadline, reason)
        return tell, bool(tell)

    def rank_gone(self, engine_id: str, rank: int) -> tuple[list, list]:
        """Producer rank ``rank`` of ``engine_id`` died: (the quarantined transfers released,
        the registered ones it was writing, which fail now)."""
        failing = []
        for key, (engine, ranks) in self.writing.items():
            if engine == engine_id and rank in ranks:
                ranks.discard(rank)
                failing.append(key)
        return self.quarantine.rank_gone(engine_id, rank), failing


# -- deadlines -------------------------------------------------------------------------------
class Machine(Protocol):
    def next_deadline(self) -> Optional[float]: ...

    def expire(self, now: float) -> list: ...


def due(machine: Machine, now: float) -> list:
    """The machine's expiry actions if a deadline of it passed, else none."""
    nd = machine.next_deadline()
    return machine.expire(now) if nd is not None and nd <= now else []


def pending(*machines: Machine) -> bool:
    """Whether any machine waits for a deadline (the loop must wake for it)."""
    return any(mc.next_deadline() is not None for mc in machines)
