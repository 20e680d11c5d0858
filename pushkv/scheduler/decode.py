"""D's scheduler: reserve blocks, get the KV from P, then decode.

Push: at admission (while P computes) ``ExpectKV`` tells the writers to register
the blocks with P's writers. Pull: at admission (after the router relayed P's
block ids) ``ReadKV`` tells them to READ; with ``pull_read == "inline"`` the
engine stalls until that READ is done, as the default connector's step does.
Either way, when every writer rank reports the KV received, the first token
(sampled by P) is emitted and the request joins the decode batch. A leg with
``prefill_here`` (conditional disaggregation) names no source: D prefills it in
its own steps, as a local instance does, and nothing moves.

Pull keeps P's lease alive while D still means to read: every ``lease_s / 3``
each pull request queued here or waiting for its READ gets a ``RenewKV`` to
every writer rank that has not answered it yet, which tells the P ranks it
reads from (``RenewLease``); P never extends a lease past ``lease_max_s``.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.kv import checksum
from pushkv.kv.layout import transfer_of
from pushkv.scheduler.core import SchedulerCore, WriterAnswer
from pushkv.scheduler.outbox import Peer
from pushkv.scheduler.requests import Request, State

log = logging.getLogger(__name__)

# renew P's leases this many times per lease_s: two renewals in a row may be lost or late
# (a busy loop, a handshake under way) before a lease lapses
RENEWALS_PER_LEASE = 3


class DecodeScheduler(SchedulerCore):
    role = "decode"
    writer_answers = (m.KVReceived, m.KVFailed)  # a KVSent (P's) would end the wait with no first token

    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig):
        super().__init__(cfg, inst)
        # the only KV sources a decode leg may name: this deployment's P instances; across hosts
        # (a registry) any P the router found there (the router is our only client, and with a
        # secret it is authenticated by CURVE)
        self.sources = {p.source() for p in cfg.role_instances("prefill")}
        self.any_source = bool(cfg.registry)
        self.blocked_on: Optional[tuple[str, int]] = None  # pull inline: the READ the engine waits on
        self.transfer = transfer_of(cfg)  # decided by the planner
        # pull with a READ renews P's lease while it queues or reads; every leg that registers
        # with P (push, push's late allocation, pull's write variant) renews while it queues here,
        # so P's wait for our registration runs from our admission (PushRendezvous.renew)
        self.reads = self.transfer.direction == "read"
        self.renews = cfg.mode != "local"
        t = cfg.timeouts
        self.renew_every_s = min(t.lease_s, t.registration_wait_s) / RENEWALS_PER_LEASE
        self.next_renewal = 0.0
        self.stalled_until = 0.0  # tests: an injected stall (stall_admission) ends then
        self.kv_groups = self.transfer.groups  # rows of P's checksums, per head

    def _check_leg(self, msg: m.Generate) -> Optional[tuple[str, int]]:
        if msg.prefill_here:
            if msg.source is not None or msg.pull is not None:
                return "decode leg that prefills here names a KV source", 400
            return None
        if msg.source is None and msg.pull is None:
            return "decode leg without a KV source", 400
        for src in (msg.source, msg.pull.source if msg.pull is not None else None):
            if src is not None and src not in self.sources and not self.any_source:
                return f"unknown prefill source {src.engine_id!r} at {list(src.handshake)}", 400
        return None

    def stall_admission(self, until: float) -> None:
        """Tests only (a ``delay`` fault the shell took): admit nothing and run no step until ``until``
        (monotonic), as a long READ ahead in the queue would."""
        self.stalled_until = until

    def _engine_blocked(self) -> bool:
        if self.blocked_on is not None:
            return True
        return bool(self.stalled_until) and self.now < self.stalled_until

    def _forget(self, r: Request) -> None:
        if self.blocked_on == r.key:
            self.blocked_on = None

    def _reuses_prefix(self, r: Request) -> bool:
        """The prompt's cached prefix stays here and only the rest moves (``cached_tokens`` in
        ExpectKV / ReadKV), unless window layers move only the window (their earlier rows were
        never sent, so a cached block lacks them)."""
        return not self.cfg.model.sliding_window

    def _hit_unit(self) -> int:
        """A transfer starts on a whole block of both sides: hits are whole multiples of both
        block sizes. The last prompt token always moves (core: it is never a hit), so the WRITE
        that carries D's notification is never empty."""
        return math.lcm(self.inst.block_size, self.cfg.prefill.block_size)

    def _chunkwise(self, r: Request) -> bool:
        """Only a prompt computed here takes its blocks chunk by chunk: a leg that prefills here, or one readmitted
        after a preemption. A leg whose KV moves takes its prompt's at admission: push registers them with P then
        (that early registration is push: P WRITEs each block as it is computed), pull READs into them."""
        return r.prefill_here or r.preemptions > 0

    def _indexes(self, r: Request) -> bool:
        """The arrived prompt is cached for a later turn, unless window layers moved only the
        window's blocks (the rest of those layers' rows never came)."""
        return not self.cfg.model.sliding_window

    def _admitted(self, r: Request) -> None:
        if r.prefill_here:  # conditional disaggregation: prefill and decode here, as a local instance
            self.counters["local_prefills"] += 1
            r.state = State.PREFILL
            return
        r.state = State.AWAIT_KV
        r.reserved_at = self.now
        if r.pull is None:  # push: register now, while P computes
            assert r.source is not None  # _check_leg: a leg that moves KV names where from
            self._to_writers(m.ExpectKV(r.transfer_id, r.generation, tuple(r.blocks), len(r.prompt),
                                        r.source, self.cfg.timeouts.write_wait_s, r.cached))
            self._stamp(r, "registration_sent")
        else:
            # a push deployment's late allocation keeps push's transfer: register now, P WRITEs
            late = self.cfg.mode == "push"
            if late:
                self.counters["late_allocations"] += 1
            wait = self.cfg.timeouts.write_wait_s if late else self.cfg.timeouts.transfer_s
            self._to_writers(m.ReadKV(r.transfer_id, r.generation, tuple(r.blocks), r.pull, wait,
                                      write=self.transfer.direction == "write", cached_tokens=r.cached))
            self._stamp(r, "read_posted")
            if self.cfg.pull_read == "inline":
                self.blocked_on = r.key  # the engine step blocks on the READ, like the default connector

    def _prefilled(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        if not r.prefill_here:
            raise AssertionError(f"decode instance ran a prefill step transfer_id={r.transfer_id}")
        self._emit(r, tok, lp)

    def _kv_done(self, r: Request, answers: dict[int, WriterAnswer]) -> None:
        """The KV has arrived on every rank: emit P's first token and start decoding."""
        self._stamp(r, "kv_received")
        # push's cost: D blocks held from their reservation until the KV is here
        r.reserved_blocks = len(r.blocks)
        r.reserved_block_s = r.reserved_blocks * (self.now - r.reserved_at)
        self.counters["reserved_block_ms"] += int(r.reserved_block_s * 1000)
        self.counters["kv_waits"] += 1
        self._count_kv(r)
        self._forget(r)
        first = next(a.first_token for a in answers.values() if isinstance(a, m.KVReceived))
        if not 0 <= first < self.vocab:  # from a peer: it would be the next step's input
            self._fail(r, f"KV transfer failed: first token {first} outside the vocabulary [0, {self.vocab})", 502)
            return
        # it runs from now, after those already decoding: where --max-num-seqs of them do, it waits for one to end
        # (counted waiting), as vLLM's D keeps a request whose KV came in its queue until its running has room
        self._begins_running(r)
        if self.cfg.kv_verify != "off" and self._verify(r, answers):
            r.output = [first]
            if r.state == State.VERIFY and r.finished() is None:
                self._early_first(r)
            return  # else: a token that ends the request goes out once its KV is checked (it is indexed)
        self._emit(r, first)

    def _early_first(self, r: Request) -> None:
        """P's first token does not depend on the KV that moved: it goes out while the workers check
        the KV; the first decode step and the prefix index wait for their verdict."""
        r.first_out = True
        self._first_sent(r)
        self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (r.output[0],)))

    # -- --kv-verify: the workers check the KV against P's checksums before the first step --
    def _verify(self, r: Request, answers: dict[int, WriterAnswer]) -> bool:
        """Ask every worker rank to check the landed KV; False: nothing to check (counted)."""
        exp = r.pull.checksums if r.pull is not None and r.pull.checksums is not None else next(
            (a.checksums for a in answers.values() if isinstance(a, m.KVReceived) and a.checksums), None)
        if exp is None:  # P does not verify (another configuration, or its sums failed to merge)
            self.counters["kv_verify_skipped"] += 1
            log.warning("%s: KV not verified: P sent no checksums transfer_id=%s", self.name, r.transfer_id)
            return False
        why = checksum.check_expected(exp, len(r.prompt), self.cfg.prefill.block_size, self.kv_groups)
        if why is None and r.cached:  # our prefix-cache hits did not cross: check what did
            exp = checksum.moved_units(exp, r.cached)
            if exp is None:
                self.counters["kv_verify_nothing_moved"] += 1
                return False
        r.state = State.VERIFY
        r.verify_at = self.now
        r.checksums = exp if why is None else None
        r.verified = {}
        self._stamp(r, "kv_verify_start")
        if why is not None:
            self._verify_failed(r, why)
            return True
        self._to_workers(m.VerifyKV(r.transfer_id, r.generation, tuple(r.blocks), exp))
        return True

    def on_KVVerified(self, msg: m.KVVerified, frm: Peer) -> None:
        r = self.reqs.get((msg.transfer_id, msg.generation))
        if r is None or r.state != State.VERIFY:  # its instance restarted meanwhile (the request is not ours)
            self.counters["stale_verify_answer"] += 1
            return
        r.verified[frm.rank] = msg
        if len(r.verified) < len(self.workers):
            return
        if r.aborted:  # aborted, or past its deadline, while the workers read its blocks: they are done with them
            self.counters["verify_answer_after_abort"] += 1
            self._release(r)
            self.schedule()
            return
        bad = [a.reason for a in r.verified.values() if a.reason]
        self.counters["kv_verify_sums"] += sum(a.checked for a in r.verified.values())
        self.counters["kv_verify_us"] += int(max(a.compute_s for a in r.verified.values()) * 1e6)
        if bad:
            self._verify_failed(r, bad[0])
        else:
            self.counters["kv_verified"] += 1
            self._stamp(r, "kv_verified")
            if r.first_out:  # the client has it: the KV joins the prefix index and the request decodes
                self._index_blocks(r, r.num_tokens)
                r.state = State.RUNNING
            else:
                self._emit(r, r.output.pop())
        self.schedule()

    def _verify_deadlines(self, now: float) -> None:
        """A KV check the workers have not answered within a step's deadline fails its request (503), as a step
        that never ends does; its blocks stay until the workers answer (``on_KVVerified``)."""
        step_s = self.cfg.timeouts.step_s
        for r in [r for r in self.reqs.values() if r.state == State.VERIFY and not r.aborted]:
            if now - r.verify_at > step_s:
                why = f"KV verification exceeded {step_s:.0f}s (worker dead or hung)"
                self.counters["kv_verify_timeout"] += 1
                r.aborted = why
                self._failed(r, why, 503)

    def _verify_failed(self, r: Request, reason: str) -> None:
        self.counters["kv_verify_failed"] += 1
        self._fail(r, f"KV verification failed: {reason}", 502)

    # -- pull: P's lease lives while we still mean to read -----------------------------
    def tick(self, now: float, wall: float) -> None:
        super().tick(now, wall)
        self._verify_deadlines(now)
        if self.stalled_until and now >= self.stalled_until:
            self.stalled_until = 0.0
            self.schedule()
        if self.renews and now >= self.next_renewal:
            self.next_renewal = now + self.renew_every_s
            self._renew_leases()

    def _renew_leases(self) -> None:
        """Every pull request queued or waiting for its READ: each writer rank that has not
        answered it renews P's lease (a rank done reading has told P so already). Every leg
        that will register with P and is still queued here (or held for its grammar's compile):
        P's wait for that registration starts anew (it runs from our admission)."""
        for r in self.reqs.values():
            source = r.pull.source if r.pull is not None else r.source
            if source is None or r.aborted or r.preemptions:  # (preempted: its KV came; it computes it again here)
                continue
            reading = self.reads and r.pull is not None and r.state == State.AWAIT_KV
            if r.state not in (State.GRAMMAR, State.WAITING) and not reading:
                continue
            renew = m.RenewKV(r.transfer_id, r.generation, source)
            for w in self.writers:
                if w.rank not in r.answers:
                    self._send(w, renew)
            self.counters["lease_renewals_sent"] += 1
