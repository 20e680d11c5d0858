"""Each role's scheduler core driven by plain calls: no sockets, no processes.

The core is sans-I/O: each message goes in with ``handle`` and what it sends comes out of its
outbox, each message with the peer it is for. Checks what each role sends when, and that
every block is back at the end of every path.
"""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.scheduler import scheduler_for
from pushkv.scheduler.decode import DecodeScheduler
from pushkv.scheduler.outbox import CancelCompile, CompileGrammar, Peer, Send

P_SRC = m.PrefillSource("p-engine", 2, ("ipc://p0", "ipc://p1"))
ROUTER_ID = b"router"
ROUTER = Peer.router(ROUTER_ID)


class Wire:
    """Reads the core's outbox: (peer, message) in send order, the peer as ``str(Peer)``
    (``router``, ``worker-1``, ``writer-0``)."""

    def __init__(self, core):
        self.core = core
        self._sent: list[tuple[str, m.Msg]] = []
        self.compiles: list[m.Structured] = []  # the grammars the core asked its shell to compile (CompileGrammar)
        self.cancelled: list[m.Structured] = []  # and those it no longer asks for (CancelCompile)

    @property
    def sent(self) -> list[tuple[str, m.Msg]]:
        for effect in self.core.take_outbox():
            if isinstance(effect, Send):
                self._sent.append((str(effect.to), effect.msg))
            elif isinstance(effect, CompileGrammar):
                self.compiles.append(effect.spec)
            elif isinstance(effect, CancelCompile):  # a queued compile dropped, as the shell's threads drop it
                self.cancelled.append(effect.spec)
                self.compiles.reverse()
                self.compiles.remove(effect.spec)
                self.compiles.reverse()
        return self._sent

    def compile_asked(self) -> int:
        """Compile each grammar the core asked for, here in turn (the shell's threads do it off its loop), and
        hand each end to the core; how many."""
        from pushkv.scheduler.grammar import XgrammarCompile, compiled_of

        compile, n = XgrammarCompile(self.core.cfg.model), 0
        while self.sent is not None and self.compiles:
            self.core.compiled(compiled_of(compile, self.compiles.pop(0)), self.core.now, self.core.wall)
            n += 1
        return n

    def take(self, peer_prefix: str = "") -> list[m.Msg]:
        got = [msg for peer, msg in self.sent if peer.startswith(peer_prefix)]
        self._sent = [(p, msg) for p, msg in self._sent if not p.startswith(peer_prefix)]
        return got


def make(role: str, mode: str = "push", tp: int = 2, pull_read: str = "background", num_blocks: int = 8):
    inst = InstanceConfig(role=role, engine_id=f"{role}-engine", tp=tp, num_blocks=num_blocks,
                          worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                          writer_endpoints=tuple(f"x{r}" for r in range(tp)))
    prefill = InstanceConfig(role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
    instances = {"prefill": prefill, role: inst}
    return wired(DeploymentConfig(mode=mode, pull_read=pull_read, **instances), inst)


def wired(cfg: DeploymentConfig, inst: InstanceConfig):
    """The scheduler core for ``inst`` and a Wire on its outbox: (core, wire)."""
    s = scheduler_for(cfg, inst)
    return s, Wire(s)


def deliver(s, frm: Peer, msg, now: float | None = None):
    """``msg`` from ``frm`` (the clock stays where the last call left it unless ``now`` moves it)."""
    t = s.now if now is None else now
    s.handle(msg, frm, t, t)


def tick(s, now: float):
    s.tick(now, now)


def generate(s, tid, leg, prompt=(1, 2, 3), max_tokens=2, **kw):
    deliver(s, ROUTER, m.Generate(tid, 0, leg, prompt, max_tokens, **kw))


def step_done(s, wire, sampled):
    steps = wire.take("worker")
    assert steps and all(isinstance(x, m.ExecuteStep) for x in steps), steps
    for w in s.workers:
        deliver(s, w, m.StepDone(steps[0].step_id, sampled))
    return steps[0]


def all_free(s):
    return s.alloc.num_free == s.alloc.num_blocks and not s.reqs and not s.waiting


def test_decode_push_registers_at_admission_and_decodes_when_every_rank_has_the_kv():
    s, wire = make("decode")
    generate(s, "t1", "decode", source=P_SRC)
    expect = wire.take("writer")
    assert [type(x) for x in expect] == [m.ExpectKV, m.ExpectKV] and expect[0].block_ids
    deliver(s, s.writers[0], m.KVReceived("t1", 0, 42, nbytes=100, num_descs=1))
    assert wire.take("router") == []  # one rank of two: not yet
    deliver(s, s.writers[1], m.KVReceived("t1", 0, 42, nbytes=100, num_descs=1))
    first = wire.take("router")
    assert [(type(x), x.token_ids) for x in first] == [(m.TokensGenerated, (42,))]
    step = step_done(s, wire, (7,))
    assert step.seqs[0].token_ids == (42,) and step.seqs[0].start_pos == 3
    last = wire.take("router")[-1]
    assert last.finished and last.token_ids == (7,) and last.kv.nbytes == 200
    assert all_free(s)


def test_decode_pull_inline_stalls_admission_until_the_read_is_done():
    pull = m.PullParams(P_SRC, (0, 1), 3, 42, 0.0)
    s, wire = make("decode", mode="pull", pull_read="inline")
    generate(s, "t1", "decode", pull=pull)
    generate(s, "t2", "decode", pull=pull)
    assert [type(x) for x in wire.take("writer")] == [m.ReadKV, m.ReadKV]  # t2 not admitted
    assert len(s.waiting) == 1
    for ch in s.writers:
        deliver(s, ch, m.KVReceived("t1", 0, 42))
    assert [type(x) for x in wire.take("writer")] == [m.ReadKV, m.ReadKV]  # now t2
    for ch in s.writers:
        deliver(s, ch, m.KVReceived("t2", 0, 43))
    while s.reqs:
        step_done(s, wire, (9,) * len(s.step))
    assert all_free(s)


def test_prefill_push_sends_kv_after_prefill_and_answers_when_written():
    s, wire = make("prefill")
    generate(s, "t1", "prefill")
    step = step_done(s, wire, (42,))
    assert step.seqs[0].start_pos == 0
    send = wire.take("writer")
    assert [type(x) for x in send] == [m.SendKV, m.SendKV] and send[0].first_token == 42
    for ch in s.writers:
        deliver(s, ch, m.KVSent("t1", 0, nbytes=10, num_descs=1, rendezvous="registration_first"))
    done = wire.take("router")
    assert [type(x) for x in done] == [m.PrefillFinished] and done[0].kv.nbytes == 20
    assert s.counters["rendezvous_registration_first"] == 1
    assert all_free(s)


def test_prefill_pull_holds_kv_and_answers_at_once():
    s, wire = make("prefill", mode="pull")
    generate(s, "t1", "prefill")
    step_done(s, wire, (42,))
    assert [type(x) for x in wire.take("writer")] == [m.HoldKV, m.HoldKV]
    done = wire.take("router")
    assert done[0].pull.block_ids and done[0].pull.first_token == 42
    assert s.alloc.num_free < s.alloc.num_blocks  # held under the lease
    for ch in s.writers:
        deliver(s, ch, m.KVSent("t1", 0, rendezvous="pull"))
    assert wire.take("router") == [] and all_free(s)  # pull: the router already has its answer


def test_local_prefills_and_decodes_without_writers():
    s, wire = make("local", mode="local", tp=1)
    generate(s, "t1", "local", max_tokens=2)
    step_done(s, wire, (5,))
    step_done(s, wire, (6,))
    toks = [t for x in wire.take("router") for t in x.token_ids]
    assert toks == [5, 6] and wire.take("writer") == [] and all_free(s)


def test_one_rank_failing_cancels_the_others_and_fails_the_request():
    s, wire = make("decode")
    generate(s, "t1", "decode", source=P_SRC)
    wire.take("writer")
    deliver(s, s.writers[1], m.KVFailed("t1", 0, "peer died"))
    assert [(type(x), x.reason) for x in wire.take("writer")] == [(m.CancelKV, "peer died")]
    deliver(s, s.writers[0], m.KVReceived("t1", 0, 42))  # a late success does not hide the failure
    failed = wire.take("router")
    assert [(type(x), x.status) for x in failed] == [(m.RequestFailed, 502)] and "peer died" in failed[0].reason
    assert all_free(s)


@pytest.mark.parametrize("kw, needle", [
    ({}, "without a KV source"),
    ({"source": m.PrefillSource("elsewhere", 1, ("ipc://x",))}, "unknown prefill source"),
])
def test_decode_refuses_a_leg_without_a_known_source(kw, needle):
    s, wire = make("decode")
    generate(s, "t1", "decode", **kw)
    (failed,) = wire.take("router")
    assert failed.status == 400 and needle in failed.reason and all_free(s)


def test_each_class_serves_its_own_role_only():
    s, _ = make("decode")
    with pytest.raises(ValueError, match="serves 'decode' instances, not 'prefill'"):
        DecodeScheduler(s.cfg, s.cfg.prefill)
    with pytest.raises(ValueError, match="InstanceConfig.role: 'router' is not one of"):  # no such instance
        scheduler_for(s.cfg, InstanceConfig(role="router"))


def test_a_transfer_failed_by_a_dead_peer_instance_is_answered_as_that_death():
    """A writer that ended the transfer because the other role's instance died says so (lost):
    the request gets the router's own answer for that death (503, retry), whoever heard first."""
    s, wire = make("decode")
    generate(s, "t1", "decode", source=P_SRC)
    wire.take("writer")
    lost = "prefill instance failed: prefill-scheduler died (killed by SIGKILL)"
    deliver(s, s.writers[0], m.KVFailed("t1", 0, "prefill instance lost: prefill-scheduler died", lost=lost))
    deliver(s, s.writers[1], m.KVFailed("t1", 0, "cancelled"))
    failed = wire.take("router")
    assert [(type(x), x.status, x.reason) for x in failed] == [(m.RequestFailed, 503, lost + "; retry")]
    assert all_free(s)


def renewals(wire, rank: int) -> list[str]:
    return [x.transfer_id for x in wire.take(f"writer-{rank}") if isinstance(x, m.RenewKV)]


def test_decode_pull_renews_p_leases_while_it_still_means_to_read():
    """Every lease_s / 3, each pull request queued or waiting for its READ is renewed through
    every writer rank that has not answered it; nothing once it reads no more."""
    pull = m.PullParams(P_SRC, (0, 1), 3, 42, 0.0)
    s, wire = make("decode", mode="pull", pull_read="inline")
    every = s.cfg.timeouts.lease_s / 3
    generate(s, "t1", "decode", pull=pull)
    generate(s, "t2", "decode", pull=pull)  # queued behind t1's READ (inline)
    wire.take("writer")
    t0 = 1000.0
    tick(s, t0)
    assert renewals(wire, 0) == ["t1", "t2"] and renewals(wire, 1) == ["t1", "t2"]
    assert wire.take("writer") == []
    deliver(s, s.writers[0], m.KVReceived("t1", 0, 42))  # rank 0 has read t1; rank 1 still reads
    tick(s, t0 + every * 0.5)
    assert wire.take("writer") == []  # not due yet
    tick(s, t0 + every)
    assert renewals(wire, 0) == ["t2"] and renewals(wire, 1) == ["t1", "t2"]
    deliver(s, s.writers[1], m.KVReceived("t1", 0, 42))  # t1 decodes; t2 is admitted and reads
    assert [type(x) for x in wire.take("writer")] == [m.ReadKV, m.ReadKV]
    tick(s, t0 + every * 2)
    assert renewals(wire, 0) == renewals(wire, 1) == ["t2"]
    deliver(s, ROUTER, m.Abort("t2", 0))  # aborted: its READ is being cancelled
    assert [type(x) for x in wire.take("writer")] == [m.CancelKV, m.CancelKV]
    tick(s, t0 + every * 3)
    assert wire.take("writer") == []
    assert s.counters["lease_renewals_sent"] == 2 + 2 + 1  # one per request per round


@pytest.mark.parametrize("mode, pull_read", [("pull", "write"), ("push", "background")])
def test_decode_renews_nothing_that_holds_no_lease(mode, pull_read):
    """The write variant and push's late allocation are a rendezvous on P, not a lease: once
    admitted (registered), nothing is renewed."""
    pull = m.PullParams(P_SRC, (0, 1), 3, 42, 0.0)
    s, wire = make("decode", mode=mode, pull_read=pull_read)
    generate(s, "t1", "decode", pull=pull)
    assert [type(x) for x in wire.take("writer")] == [m.ReadKV, m.ReadKV]
    for k in range(4):
        tick(s, 1000.0 + k * s.cfg.timeouts.lease_s)
    assert wire.take("writer") == [] and s.counters["lease_renewals_sent"] == 0


@pytest.mark.parametrize("late", [False, True], ids=["push", "late"])
def test_decode_renews_a_leg_that_registers_while_it_queues(late):
    """A leg that will register with P (push, or push's late allocation) and queues here for
    blocks is renewed every third of P's registration wait, so P's clock for our registration
    runs from our admission; once admitted (its registration sent) it is renewed no more."""
    s, wire = make("decode", num_blocks=2)  # one request of 3 + 2 tokens at 16 a block: 1 block
    every = min(s.cfg.timeouts.lease_s, s.cfg.timeouts.registration_wait_s) / 3

    def leg(n):
        return {"pull": m.PullParams(P_SRC, (0, 1), n, 42, 0.0)} if late else {"source": P_SRC}

    big = tuple(range(20))  # 20 + 2 tokens: both blocks
    generate(s, "t0", "decode", prompt=big, **leg(20))
    generate(s, "t1", "decode", **leg(3))  # queued: the pool is t0's
    first = wire.take("writer")
    assert [x.transfer_id for x in first] == ["t0", "t0"]  # t0 registers (both ranks)
    t0 = 1000.0
    tick(s, t0)
    assert renewals(wire, 0) == renewals(wire, 1) == ["t1"]
    tick(s, t0 + every * 0.5)
    assert wire.take("writer") == []  # not due yet
    tick(s, t0 + every)
    assert renewals(wire, 0) == renewals(wire, 1) == ["t1"]
    deliver(s, ROUTER, m.Abort("t0", 0))
    assert [type(x) for x in wire.take("writer")] == [m.CancelKV, m.CancelKV]
    for w in s.writers:  # t0's blocks are back: t1 is admitted, registers, and is renewed no more
        deliver(s, w, m.KVFailed("t0", 0, "cancelled"))
    admitted = [x for x in wire.take("writer") if x.transfer_id == "t1"]
    assert [type(x) for x in admitted] == [m.ReadKV if late else m.ExpectKV] * 2
    tick(s, t0 + every * 2)
    assert wire.take("writer") == []
    assert s.counters["lease_renewals_sent"] == 2


def test_decode_prefills_a_leg_that_names_no_source_itself():
    s, wire = make("decode")
    generate(s, "t1", "decode", max_tokens=2, prefill_here=True)
    assert wire.take("writer") == []  # nothing to register: no KV comes
    first = step_done(s, wire, (5,))
    assert first.seqs[0].token_ids == (1, 2, 3) and first.seqs[0].start_pos == 0  # the whole prompt, here
    step_done(s, wire, (6,))
    out = wire.take("router")
    assert [t for x in out for t in x.token_ids] == [5, 6] and out[-1].finished
    assert out[-1].decode_steps == 1 and out[-1].decode_seqs == 1  # its one decode step, alone
    assert s.counters["local_prefills"] == 1 and all_free(s)


def test_decode_prefilling_here_is_aborted_mid_step_and_frees_its_blocks_after_it():
    s, wire = make("decode")
    generate(s, "t1", "decode", max_tokens=4, prefill_here=True)
    deliver(s, ROUTER, m.Abort("t1", 0, "client gone"))
    assert not all_free(s)  # the prefill step still writes its blocks
    step_done(s, wire, (5,))
    assert wire.take("router") == [] and all_free(s)


def test_decode_refuses_a_leg_that_prefills_here_and_names_a_source():
    s, wire = make("decode")
    generate(s, "t1", "decode", source=P_SRC, prefill_here=True)
    (failed,) = wire.take("router")
    assert failed.status == 400 and "names a KV source" in failed.reason and all_free(s)
