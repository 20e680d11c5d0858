"""The writer's roles as pure sides: the protocol machines' actions in, effects out.

pushkv's writers (``prefill.py``, ``decode.py``) and the vLLM writer (``vllm/writer.py``)
are shells around the same machines (``PushRendezvous`` on P, ``KVArrivals`` on D). What
they decide alike lives here once, holding no socket, NIXL agent or clock (``now`` is an
argument), like the scheduler's core and its outbox:

- :class:`PrefillSide` owns P's rendezvous (``PushRendezvous``): the prefill's halves, D's
  registrations and cancels, the WRITEs' ends and the deadlines go in, effects come out (post
  this WRITE, tell these D ranks it failed, report the freed blocks with their outcome, count,
  drop the failed transfer's queued WRITEs, a half refused); the shell maps its ids and events
  to these calls and performs the effects in order.
- :class:`Quarantine` keeps D's failed transfers whose producer ranks may still write into
  their blocks, and says which to hand back (every rank answered, its producer died, or the
  deadline passed).
- :class:`Producers` (the vLLM writer's D) tracks which producer ranks still write each
  transfer: a completion counts only from its producer rank, and a failed transfer is held
  while a rank may still write.
- :func:`due` and :func:`pending` are the deadline checks of ``tick`` and ``has_pending``.
- :func:`peer_gone` says whether a transfer's failure is its peer's endpoint gone (``KVFailed.lost``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, Sequence, Union

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import rendezvous as rv

Key = tuple[str, int]  # (transfer id, generation)
Outcome = Union[A.Completed, A.Failed]
Verdict = Literal["counts", "wrong_peer", "quarantined"]  # of a completion at D
MAX_TRACKED = 4096  # bounded bookkeeping for transfers that never free their blocks
WAITING = (rv.State.WAIT_PREFILL.value, rv.State.WAIT_REGISTRATION.value)  # a WRITE is coming


def peer_gone(failure: str, peer_role: str) -> str:
    """``KVFailed.lost`` for a transfer that NIXL failed because the peer's endpoint went away (its
    process died, as a rule before the supervisor's news of it reached us), so that the request is
    answered as that death is (503, retry) whichever came first; "" for any other failure."""
    return f"{peer_role} instance unreachable ({failure})" if "REMOTE_DISCONNECT" in failure else ""


# -- effects -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Post:
    """P: post this WRITE (its share to each registered D rank)."""

    write: A.PostWrite
    swap_dest: bool = False  # fault tests of --kv-verify only (``kv_damage.py``): two destination blocks swapped

    @property
    def key(self) -> Key:
        return self.write.transfer_id, self.write.generation


@dataclass(frozen=True)
class Tell:
    """Send ``msg`` to the writer of D rank ``peer`` (engine id, rank), if connected."""

    peer: tuple[str, int]
    msg: Union[m.WriteFailed, m.CancelTransfer]  # P: stop waiting; D: stop writing

    @property
    def key(self) -> Key:
        return self.msg.transfer_id, self.msg.generation


@dataclass
class PrefillTransfer:
    """What P's writer keeps per transfer until its blocks are freed."""

    d_engine_id: str = ""  # the D instance that registered (for peer death)
    outcome: Optional[Outcome] = None  # until FreeBlocks reports it
    nbytes: int = 0  # of the WRITE, once posted
    num_descs: int = 0
    write_s: float = 0.0  # post to completion (the last WRITE)
    parts: int = 0  # streamed part WRITEs posted
    # streamed: per D rank, the bytes and descriptors of its part WRITEs (the last WRITE's WriteDone gives D the sum)
    part_sizes: dict[int, tuple[int, int]] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # writer-side timeline (wall time)
    first_queued: float = 0.0  # monotonic: its first WRITE's turn in a link queue (orders "arrival", "deadline")


@dataclass(frozen=True)
class Report:
    """P: the blocks may be freed; report the transfer (its outcome, what moved) to whoever owns them."""

    free: A.FreeBlocks
    transfer: PrefillTransfer

    @property
    def key(self) -> Key:
        return self.free.transfer_id, self.free.generation

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


@dataclass(frozen=True)
class Refused:
    """P: the rendezvous refused a half of ``key`` (``event`` illegal in ``state``: its transfer
    finished already, say) and changed nothing. Its blocks were never handed over; when the
    transfer is ``live`` still, the rendezvous answers for it itself."""

    key: Key
    event: str
    state: str
    error: str
    live: bool


Effect = Union[Post, Tell, Report, Drop, Refused, A.Count]


def keys_of(effects: list) -> set[Key]:
    """The transfers the effects move (a refusal moves none)."""
    return {e.key for e in effects if isinstance(e, (Post, Tell, Report, Drop))}


# -- P -------------------------------------------------------------------------------------
class PrefillSide:
    """One P rank's rendezvous, its inputs in and effects out. It keeps each transfer's record
    (its outcome, what moved) until its blocks are freed: a failure may come batches before
    its drained WRITE frees them. Pull's leases (pushkv's P only) go through :meth:`effects`."""

    def __init__(self, rdv: rv.PushRendezvous, max_tracked: int = MAX_TRACKED):
        self.rdv = rdv
        self.rank = rdv.p_rank
        self.max_tracked = max_tracked
        self.transfers: dict[Key, PrefillTransfer] = {}

    # -- inputs: our prefill's halves ------------------------------------------------------
    def prefill_done(self, key: Key, block_ids: Sequence[int], num_tokens: int, first_token: int, now: float,
                     wait_s: Optional[float] = None) -> list[Effect]:
        """The blocks hold the prompt's KV: WRITE once D's registration is here (or now)."""
        try:
            return self.effects(self.rdv.on_prefill_done(*key, block_ids, num_tokens, first_token, now, wait_s))
        except A.ProtocolError as e:
            return [self._refused(key, e)]

    def progress(self, key: Key, block_ids: Sequence[int], num_tokens: int, now: float,
                 group: int = -1) -> list[Effect]:
        """A prefill chunk ended (``group`` -1) or layer group ``group`` of a step was stored."""
        try:
            return self.effects(self.rdv.on_prefill_progress(*key, block_ids, num_tokens, now, group=group))
        except A.ProtocolError as e:
            return [self._refused(key, e)]

    def restart(self, key: Key, now: float) -> list[Effect]:
        """The engine preempted the streamed prefill and computes it again into new blocks (the
        shell makes sure no WRITE still reads the old ones before the engine reuses them)."""
        try:
            return self.effects(self.rdv.on_prefill_restart(*key, now))
        except A.ProtocolError as e:
            return [self._refused(key, e)]

    # -- inputs: D's messages ------------------------------------------------------------------
    def registration(self, reg: m.Register, now: float) -> list[Effect]:
        """D's registration (from a known peer): its D instance noted (for its death)."""
        self.record((reg.transfer_id, reg.generation)).d_engine_id = reg.d_engine_id
        return self.effects(self.rdv.on_registration(reg, now))

    def cancel(self, key: Key, reason: str, now: float, answer: bool = False) -> list[Effect]:
        """End the transfer (``answer``: the scheduler asked, and waits for one answer)."""
        return self.effects(self.rdv.cancel(*key, reason, now, answer=answer))

    def renew(self, key: Key, now: float) -> list[Effect]:
        return self.effects(self.rdv.renew(*key, now))

    def registered_by(self, engine_id: str) -> list[Key]:
        """The transfers D instance ``engine_id`` registered for (they end if it dies)."""
        return [key for key, t in self.transfers.items() if t.d_engine_id == engine_id]

    # -- inputs: our WRITEs, the clock ---------------------------------------------------------
    def write_ended(self, key: Key, now: float, *, part: bool, failed: str = "", nbytes: int = 0,
                    num_descs: int = 0, posted: float = 0.0) -> list[Effect]:
        """A WRITE of ``key`` (a streamed part, or the last) ended, posted at ``posted`` and
        moving ``nbytes`` in ``num_descs`` descriptors; ``failed``: why it did not."""
        t = self.record(key)
        t.nbytes, t.num_descs = t.nbytes + nbytes, t.num_descs + num_descs
        if not part:
            t.write_s = now - posted  # the last WRITE's: one layer group's, when streamed
        acts = (self.rdv.on_write_failed(*key, failed, now, part=part) if failed
                else self.rdv.on_write_done(*key, now, part=part))
        return self.effects(acts)

    def expire(self, now: float) -> list[Effect]:
        return self.effects(due(self.rdv, now))

    def pending(self) -> bool:
        return pending(self.rdv)

    def waiting(self, key: Key) -> bool:
        """Whether the transfer waits for its other half (its WRITE is coming)."""
        return self.rdv.state_of(*key) in WAITING

    def live(self, key: Key) -> bool:
        return self.rdv.state_of(*key) is not None

    @property
    def produces(self) -> bool:
        """False on a replica rank (a lower rank produces every head it holds): it writes nothing."""
        return self.rdv.produces

    # -- the records and the effects -------------------------------------------------------------
    def record(self, key: Key) -> PrefillTransfer:
        """The transfer's record, made on first use."""
        t = self.transfers.get(key)
        if t is None:
            t = self.transfers[key] = PrefillTransfer()
            while len(self.transfers) > self.max_tracked:  # halves that never paired (expired, cancelled)
                self.transfers.pop(next(iter(self.transfers)))
        return t

    def effects(self, actions: list) -> list[Effect]:
        """The machines' actions as effects (the rendezvous', or pushkv's leases')."""
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
        out += [Drop((a.transfer_id, a.generation), a.reason) for a in actions if isinstance(a, (A.Failed, A.Withdraw))]
        return out

    def _refused(self, key: Key, e: A.ProtocolError) -> Refused:
        return Refused(key, e.event, e.state, str(e), self.live(key))


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
