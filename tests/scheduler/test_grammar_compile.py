"""Structured output's grammar compiles off the scheduler's loop (pushkv/scheduler/grammar.py).

The core holds a request whose grammar is not compiled here (``State.GRAMMAR``) and asks its shell to compile
it, once per spec (``CompileGrammar``). The first tests play the shell's part by hand and answer each compile
when they choose (``compile_ends``), so every state between is seen: held and then queued and stepped, the
others stepping meanwhile, a failed compile, an abort or a reissue meanwhile, one compile shared. The last ones
run the shell's ``CompileThreads`` (real threads, its eventfd) and the shell over real sockets with a compile
the test lets end: the loop steps other requests while it runs, wakes as it ends, and never waits for it at
teardown.
"""
from __future__ import annotations

import json
import queue
import select
import threading
import time

import pytest

from pushkv import messages as m
from pushkv.config import preset
from pushkv.scheduler.grammar import CompileThreads, XgrammarCompile, allowed_ids, compiled_of
from pushkv.scheduler.requests import State, blocks_needed
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, all_free, deliver, make, tick
from tests.scheduler.test_scheduler_shell import Rig
from tests.scheduler.test_scheduler_validate import gen, run_step, serve

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(120)

WAIT_S = 10.0  # for what must come
EOS = 257
CHOICES = ["yes", "no"]
CHOICE = m.Structured("choice", json.dumps(CHOICES))
DIGITS = m.Structured("regex", "[0-9]{3}")
BAD = m.Structured("regex", "(")


def text(tokens: list) -> str:
    return bytes(t for t in tokens if t < 256).decode()


def local(num_blocks: int = 64):
    return make("local", mode="local", tp=1, num_blocks=num_blocks)


def compile_ends(s, wire, spec: m.Structured) -> None:
    """The shell's answer to the core's ``CompileGrammar(spec)``: compiled now, handed to the core."""
    wire.sent  # noqa: B018  # reads the outbox: the compiles asked for so far
    wire.compiles.remove(spec)
    s.compiled(compiled_of(XgrammarCompile(s.cfg.model), spec), s.now, s.wall)


def step_seqs(wire) -> list[int]:
    """The seq ids of the step the core sent its workers now (the step stays for ``run_step``)."""
    return [w.seq_id for _, x in wire.sent if isinstance(x, m.ExecuteStep) for w in x.seqs]


def test_a_request_whose_grammar_is_not_compiled_waits_out_of_the_queue_and_runs_once_it_is():
    s, wire = local()
    deliver(s, ROUTER, gen("g", None, max_tokens=8, structured=CHOICE))
    assert wire.take() == [] and wire.compiles == [CHOICE]  # nothing stepped, nothing answered: one compile asked
    r = s.reqs[("g", 0)]
    assert r.state == State.GRAMMAR and r not in s.waiting and not r.blocks
    assert s.alloc.num_free == s.alloc.num_blocks  # held, it holds no block
    tick(s, 30.0)
    assert wire.take() == []  # time alone moves nothing
    compile_ends(s, wire, CHOICE)
    (step,) = [x for _, x in wire.sent if isinstance(x, m.ExecuteStep)]
    assert allowed_ids(step.seqs[0].token_mask, s.vocab) == sorted(b"yn")  # its prefill draws under the grammar
    assert r.state == State.PREFILL and "grammar_compiled" in r.timeline
    got = serve(s, wire, [])
    out = got["g"]
    assert out[-1] == EOS and text(out) in CHOICES
    assert all_free(s)


def test_other_requests_step_to_their_end_while_one_waits_for_its_compile():
    s, wire = local()
    deliver(s, ROUTER, gen("g", None, max_tokens=8, structured=CHOICE))
    deliver(s, ROUTER, gen("free", None, max_tokens=5))
    free = s.reqs[("free", 0)].seq_id
    steps = 0
    while step_seqs(wire):
        assert step_seqs(wire) == [free]
        run_step(s, wire)
        steps += 1
    assert steps == 5  # its prefill and four decodes, all while g's grammar compiles
    tokens = [x for x in wire.take("router") if isinstance(x, m.TokensGenerated)]
    assert len(tokens) == 5 and tokens[-1].finished and {x.transfer_id for x in tokens} == {"free"}
    assert s.reqs[("g", 0)].state == State.GRAMMAR
    compile_ends(s, wire, CHOICE)
    got = serve(s, wire, [])
    assert text(got["g"]) in CHOICES and all_free(s)


def test_a_failed_compile_fails_each_request_held_for_it_with_the_400_a_synchronous_compile_gave():
    s, wire = local()
    deliver(s, ROUTER, gen("a", None, structured=BAD))
    deliver(s, ROUTER, gen("b", None, structured=BAD))
    deliver(s, ROUTER, gen("free", None, max_tokens=2))
    wire.sent  # noqa: B018
    assert wire.compiles == [BAD]
    with pytest.raises(Exception) as raised:  # what the scheduler's thread used to meet, and answer with
        XgrammarCompile(s.cfg.model)(BAD)
    e = raised.value
    before = f"structured output: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    compile_ends(s, wire, BAD)
    got = serve(s, wire, [])
    for tid in ("a", "b"):
        (failed,) = got[tid]
        assert isinstance(failed, m.RequestFailed) and (failed.status, failed.reason) == (400, before)
    assert len(got["free"]) == 2
    assert s.counters["grammar_failed"] == 2 and all_free(s)


def test_an_abort_of_the_last_request_waiting_cancels_its_compile_and_a_later_request_asks_again():
    s, wire = local()
    deliver(s, ROUTER, gen("g", None, structured=CHOICE))
    deliver(s, ROUTER, gen("h", None, structured=CHOICE))
    deliver(s, ROUTER, m.Abort("g", 0, "client gone"))
    assert wire.take() == [] and wire.cancelled == [] and s.compiling[CHOICE] == [s.reqs[("h", 0)]]  # h waits
    deliver(s, ROUTER, m.Abort("h", 0, "client gone"))
    assert wire.take() == [] and all_free(s)  # an Abort is not answered; nothing of it is left
    assert s.compiling == {} and wire.cancelled == [CHOICE] and wire.compiles == []  # nobody waits: dropped
    assert s.counters["grammar_compiles_cancelled"] == 1
    deliver(s, ROUTER, gen("again", None, max_tokens=4, structured=CHOICE))  # asks for it again
    assert wire.take() == [] and wire.compiles == [CHOICE] and s.counters["grammar_compiles"] == 2
    compile_ends(s, wire, CHOICE)
    got = serve(s, wire, [])
    assert text(got["again"]) in CHOICES and all_free(s)


def test_a_compile_under_way_when_cancelled_ends_into_the_cache_and_attaches_to_nothing():
    s, wire = local()
    deliver(s, ROUTER, gen("g", None, structured=CHOICE))
    wire.sent  # noqa: B018  # the shell takes the compile: under way, it cannot be dropped
    deliver(s, ROUTER, m.Abort("g", 0, "client gone"))
    assert wire.take() == [] and s.compiling == {} and wire.cancelled == [CHOICE]
    s.compiled(compiled_of(XgrammarCompile(s.cfg.model), CHOICE), s.now, s.wall)  # it ends anyway
    assert wire.take() == [] and all_free(s)
    deliver(s, ROUTER, gen("again", None, max_tokens=4, structured=CHOICE))  # compiled here now: no wait
    assert step_seqs(wire) == [s.reqs[("again", 0)].seq_id] and wire.compiles == []
    got = serve(s, wire, [])
    assert text(got["again"]) in CHOICES and all_free(s)


def test_shutdown_refuses_a_request_held_for_its_compile():
    s, wire = local()
    deliver(s, ROUTER, gen("g", None, structured=CHOICE))
    s.shutdown("upgrade")
    (failed,) = wire.take("router")
    assert (failed.transfer_id, failed.status) == ("g", 503)


def test_requests_of_one_spec_share_its_compile_and_a_reissue_meanwhile_replaces_its_generation():
    s, wire = local()
    deliver(s, ROUTER, gen("a", None, max_tokens=6, structured=CHOICE))
    deliver(s, ROUTER, gen("b", None, max_tokens=6, structured=CHOICE))
    deliver(s, ROUTER, gen("c", None, max_tokens=6, structured=DIGITS))
    deliver(s, ROUTER, m.Generate("a", 1, "local", (5, 6, 7), 6, structured=CHOICE))  # a's reissue
    (superseded,) = wire.take("router")
    assert (superseded.transfer_id, superseded.generation, superseded.status) == ("a", 0, 499)
    assert wire.compiles == [CHOICE, DIGITS] and s.counters["grammar_compiles"] == 2  # one per spec
    assert [(r.transfer_id, r.generation) for r in s.compiling[CHOICE]] == [("b", 0), ("a", 1)]
    compile_ends(s, wire, CHOICE)
    assert sorted(step_seqs(wire)) == sorted(s.reqs[k].seq_id for k in (("a", 1), ("b", 0)))
    assert s.reqs[("c", 0)].state == State.GRAMMAR
    compile_ends(s, wire, DIGITS)
    got = serve(s, wire, [])
    assert text(got["a"]) in CHOICES and text(got["b"]) in CHOICES and text(got["c"]).isdigit()
    assert len(text(got["c"])) == 3 and all_free(s)


def test_once_compiled_a_held_request_queues_in_its_place_by_arrival():
    """The pool holds one request at a time: g arrived before late, and is admitted before it."""
    s0, _ = local()
    need = blocks_needed("local", 3, 6, s0.inst.block_size)
    s, wire = local(num_blocks=need)
    deliver(s, ROUTER, gen("big", None, max_tokens=6))
    deliver(s, ROUTER, gen("g", None, max_tokens=6, structured=CHOICE))
    deliver(s, ROUTER, gen("late", None, max_tokens=6))
    assert [r.transfer_id for r in s.waiting] == ["late"]
    compile_ends(s, wire, CHOICE)
    assert [r.transfer_id for r in s.waiting] == ["g", "late"]
    got = serve(s, wire, [])
    assert text(got["g"]) in CHOICES and len(got["late"]) == 6 and all_free(s)


def test_d_registers_a_structured_leg_with_p_once_its_grammar_compiled_and_renews_ps_wait_meanwhile():
    s, wire = make("decode")
    deliver(s, ROUTER, m.Generate("d", 0, "decode", (1, 2, 3), 4, source=P_SRC, structured=CHOICE))
    assert not [x for x in wire.take("writer") if isinstance(x, m.ExpectKV)]
    tick(s, 1.0)
    renewals = wire.take("writer")
    assert len(renewals) == 2 and all(isinstance(x, m.RenewKV) and x.transfer_id == "d" for x in renewals)
    compile_ends(s, wire, CHOICE)
    expects = wire.take("writer")
    assert len(expects) == 2 and all(isinstance(x, m.ExpectKV) for x in expects)


# -- off the loop: the compile threads and the shell --------------------------------------------------------------
class HeldCompile:
    """The real compile, which waits until the test lets it end (``gate(spec).set()``); ``started`` gets each spec
    as its compile starts."""

    def __init__(self) -> None:
        self.compile = XgrammarCompile(preset("small"))
        self.started: queue.Queue[m.Structured] = queue.Queue()
        self._gates: dict[m.Structured, threading.Event] = {}
        self._lock = threading.Lock()

    def gate(self, spec: m.Structured) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(spec, threading.Event())

    def __call__(self, spec: m.Structured):
        self.started.put(spec)
        if not self.gate(spec).wait(WAIT_S):
            raise TimeoutError("the test never let the compile end")
        return self.compile(spec)


def readable(fd: int, timeout_s: float) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


def test_compile_threads_hand_over_each_compile_as_it_ends_through_their_eventfd():
    held = HeldCompile()
    pool = CompileThreads(held)
    try:
        pool.submit(CHOICE)
        pool.submit(BAD)
        assert {held.started.get(timeout=WAIT_S) for _ in range(2)} == {CHOICE, BAD}  # both at once: two threads
        assert not readable(pool.fd, 0) and pool.take() == []
        held.gate(BAD).set()
        assert readable(pool.fd, WAIT_S)
        (bad,) = pool.take()
        assert bad.spec == BAD and bad.grammar is None and bad.error.startswith("structured output: ")
        assert not readable(pool.fd, 0)  # taken: quiet until the next ends
        held.gate(CHOICE).set()
        assert readable(pool.fd, WAIT_S)
        (ok,) = pool.take()
        assert ok.spec == CHOICE and ok.grammar is not None and ok.error == ""
    finally:
        pool.close()


def test_a_cancelled_compile_that_has_not_started_never_runs_and_one_under_way_ends():
    held = HeldCompile()
    pool = CompileThreads(held, threads=1)
    try:
        pool.submit(CHOICE)
        assert held.started.get(timeout=WAIT_S) == CHOICE  # under way on the one thread
        pool.submit(DIGITS)
        pool.submit(BAD)
        assert pool.cancel(DIGITS)  # queued behind it: dropped
        assert not pool.cancel(CHOICE)  # under way: it ends as ever
        assert not pool.cancel(DIGITS)  # nothing of it left
        held.gate(CHOICE).set()
        held.gate(BAD).set()
        assert held.started.get(timeout=WAIT_S) == BAD  # the next to start is BAD: DIGITS never ran
        ended = []
        while len(ended) < 2:
            assert readable(pool.fd, WAIT_S)
            ended += pool.take()
        assert [e.spec for e in ended] == [CHOICE, BAD] and held.started.empty()
        pool.submit(DIGITS)  # asked again later: compiled
        held.gate(DIGITS).set()
        assert held.started.get(timeout=WAIT_S) == DIGITS
        assert readable(pool.fd, WAIT_S) and [e.spec for e in pool.take()] == [DIGITS]
    finally:
        pool.close()


def test_closing_the_compile_threads_never_waits_for_a_compile_under_way():
    held = HeldCompile()
    pool = CompileThreads(held)
    pool.submit(CHOICE)
    assert held.started.get(timeout=WAIT_S) == CHOICE
    pool.close()  # returns with the compile still held
    assert not held.gate(CHOICE).is_set() and all(t.daemon for t in pool._threads)
    held.gate(CHOICE).set()
    for t in pool._threads:
        t.join(WAIT_S)
        assert not t.is_alive()  # the busy one ended after its compile, its end dropped
    assert pool.take() == []


@pytest.fixture
def held_rig(tmp_path):
    held = HeldCompile()
    rig = Rig(tmp_path, compile=held)
    try:
        yield rig, held
    finally:
        for spec in (CHOICE, DIGITS, BAD):
            held.gate(spec).set()
        rig.close()


def turn_until(rig, done) -> None:
    end = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < end, "it never happened"
        rig.shell.poll_once(10)


def test_the_shell_steps_other_requests_while_a_grammar_compiles_and_wakes_as_it_ends(held_rig):
    rig, held = held_rig
    a, b = rig.clients[b"a"], rig.clients[b"b"]
    a.send(m.encode(m.Generate("g", 0, "prefill", (1, 2, 3), 1, structured=CHOICE)))
    turn_until(rig, lambda: not held.started.empty())
    b.send(m.encode(m.Generate("free", 0, "prefill", (4, 5, 6), 1)))
    steps = [rig.recv(w, m.DEC_SCHED_TO_WORKER) for w in rig.workers]  # free's prefill, while g compiles
    free = rig.shell.core.reqs[("free", 0)].seq_id
    assert [w.seq_id for w in steps[0].seqs] == [free]
    for w in rig.workers:
        w.send(m.encode(m.StepDone(steps[0].step_id, (42,))))
    sends = [rig.recv(x, m.DEC_SCHED_TO_WRITER) for x in rig.writers]
    assert all(isinstance(x, m.SendKV) and x.transfer_id == "free" for x in sends)
    assert rig.quiet(*rig.workers)
    held.gate(CHOICE).set()
    t0 = time.monotonic()
    rig.shell.poll_once(int(WAIT_S * 1000))  # one turn: the compile's end wakes it, not the timeout
    assert time.monotonic() - t0 < WAIT_S / 2
    assert rig.workers[0].poll(int(WAIT_S * 1000))
    step = m.DEC_SCHED_TO_WORKER.decode(rig.workers[0].recv())
    (seq,) = step.seqs
    assert seq.seq_id == rig.shell.core.reqs[("g", 0)].seq_id
    assert allowed_ids(seq.token_mask, rig.shell.core.vocab) == sorted(b"yn")


def test_the_shell_compiles_with_xgrammar_off_its_loop_by_default(tmp_path):
    rig = Rig(tmp_path)
    try:
        rig.clients[b"a"].send(m.encode(m.Generate("g", 0, "prefill", (1, 2, 3), 1, structured=DIGITS)))
        step = rig.recv(rig.workers[0], m.DEC_SCHED_TO_WORKER)
        assert allowed_ids(step.seqs[0].token_mask, rig.shell.core.vocab) == list(b"0123456789")
        assert rig.shell.core.counters["grammar_compiles"] == 1
    finally:
        rig.close()


def test_teardown_refuses_a_request_held_for_its_compile_and_does_not_wait_for_the_compile(held_rig):
    rig, held = held_rig
    a = rig.clients[b"a"]
    a.send(m.encode(m.Generate("g", 0, "prefill", (1, 2, 3), 1, structured=CHOICE)))
    turn_until(rig, lambda: not held.started.empty())
    rig.shell.stop_reason = "upgrade"
    rig.shell.teardown()  # returns with the compile still held
    assert not held.gate(CHOICE).is_set()
    failed = rig.recv(a, m.DEC_SCHED_TO_ROUTER)
    assert (failed.transfer_id, failed.status) == ("g", 503)
