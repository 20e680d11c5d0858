"""The scheduler core's outbox, read as it is (no sockets): each message is addressed to the
peer it is for (the router by the identity of the one that asked, each worker or writer rank),
every refusal goes to its sender alone, and the time a call passes in is the time it uses."""
from __future__ import annotations

import ast
import pathlib

import msgspec
import pytest

import pushkv.scheduler
from pushkv import messages as m
from pushkv.scheduler.outbox import Peer, Send, Trace
from tests.scheduler.test_scheduler_roles import P_SRC, make

A, B = Peer.router(b"client-a"), Peer.router(b"client-b")
W0, W1 = Peer("worker", 0), Peer("worker", 1)
X0, X1 = Peer("writer", 0), Peer("writer", 1)


def sends(s) -> list[tuple[Peer, m.Msg]]:
    return [(e.to, e.msg) for e in s.take_outbox() if isinstance(e, Send)]


def gen(tid="t1", generation=0, leg="prefill", prompt=(1, 2, 3), max_tokens=1, **kw) -> m.Generate:
    return m.Generate(tid, generation, leg, prompt, max_tokens, **kw)


# (case, Generate, HTTP status, what the reason says); the pool has 2 blocks of 16 tokens
REFUSALS = [
    ("empty prompt", gen(prompt=()), 400, "empty prompt"),
    ("another role's leg", gen(leg="decode", source=P_SRC), 400, "cannot serve a 'decode' leg"),
    ("token outside the vocabulary", gen(prompt=(1, 10**6)), 400, "outside the vocabulary"),
    ("no max_tokens", gen(max_tokens=0), 400, "max_tokens must be >= 1"),
    ("larger than the pool", gen(prompt=tuple(range(1, 41))), 413, "needs 3 KV blocks"),
]


@pytest.mark.parametrize("case, msg, status, needle", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_generate_is_answered_to_its_sender_alone(case, msg, status, needle):
    s, _ = make("prefill", num_blocks=2)
    msg = msgspec.structs.replace(msg, generation=3)
    s.handle(msg, B, 0.0, 0.0)
    ((to, failed),) = sends(s)
    assert to == B and isinstance(failed, m.RequestFailed)
    assert (failed.transfer_id, failed.generation, failed.status) == ("t1", 3, status) and needle in failed.reason
    assert s.counters["rejected"] == 1 and not s.reqs and s.alloc.num_free == 2


def test_a_duplicate_is_refused_to_whoever_sent_it_and_the_first_goes_on():
    s, _ = make("prefill")
    s.handle(gen(), A, 0.0, 0.0)
    sends(s)
    s.handle(gen(), B, 0.0, 0.0)
    ((to, failed),) = sends(s)
    assert to == B and failed.status == 409 and "duplicate transfer id t1" in failed.reason
    assert s.reqs[("t1", 0)].identity == A.identity


@pytest.mark.parametrize("payload, tid, generation", [
    (msgspec.msgpack.encode(["Generate", "t9", 4, "not a prompt"]), "t9", 4),  # its head is readable
    (msgspec.msgpack.encode(["Generate", "t9", "four"]), "t9", 0),
    (b"\xc1\xc1", "", 0),  # not msgpack at all
])
def test_an_undecodable_frame_is_refused_to_its_sender_naming_what_it_can(payload, tid, generation):
    s, _ = make("prefill")
    s.refuse_undecodable(B, "expected a prompt", payload)
    assert sends(s) == [(B, m.RequestFailed(tid, generation, "undecodable message: expected a prompt", 400))]


def test_a_prefill_step_goes_to_every_worker_rank_and_its_kv_to_every_writer_rank():
    s, _ = make("prefill")
    s.handle(gen(), A, 0.0, 0.0)
    out = sends(s)
    assert [to for to, _ in out] == [W0, W1] and out[0][1] == out[1][1]
    step = out[0][1]
    assert isinstance(step, m.ExecuteStep) and step.seqs[0].token_ids == (1, 2, 3)
    s.handle(m.StepDone(step.step_id, (42,)), W1, 0.0, 0.0)
    assert sends(s) == []  # one rank of two
    s.handle(m.StepDone(step.step_id, (42,)), W0, 0.0, 0.0)
    out = sends(s)
    assert [(to, type(x)) for to, x in out] == [(X0, m.SendKV), (X1, m.SendKV)]
    s.handle(m.KVSent("t1", 0), X0, 0.0, 0.0)
    s.handle(m.KVSent("t1", 0), X1, 0.0, 0.0)
    ((to, done),) = sends(s)
    assert to == A and isinstance(done, m.PrefillFinished) and done.first_token == 42


def test_each_request_is_answered_to_the_identity_that_sent_it():
    s, _ = make("local", mode="local", tp=1)
    s.handle(gen("ta", leg="local", max_tokens=2), A, 0.0, 0.0)
    s.handle(gen("tb", leg="local"), B, 0.0, 0.0)  # queued behind ta's prefill step
    ((to, step),) = sends(s)
    assert to == W0 and [w.token_ids for w in step.seqs] == [(1, 2, 3)]
    s.handle(m.StepDone(step.step_id, (5,)), W0, 0.0, 0.0)
    (reply, (to, step)) = sends(s)
    assert reply[0] == A and (reply[1].transfer_id, reply[1].token_ids) == ("ta", (5,))
    assert to == W0 and [w.token_ids for w in step.seqs] == [(5,), (1, 2, 3)]  # ta decodes, tb prefills
    s.handle(m.StepDone(step.step_id, (6, 7)), W0, 0.0, 0.0)
    assert [(to, x.transfer_id, x.token_ids, x.finished) for to, x in sends(s)] == [
        (A, "ta", (6,), True), (B, "tb", (7,), True)]


def test_a_failing_writer_rank_has_the_other_ranks_cancelled_not_itself():
    s, _ = make("decode")
    s.handle(gen(leg="decode", source=P_SRC), A, 0.0, 0.0)
    assert [(to, type(x)) for to, x in sends(s)] == [(X0, m.ExpectKV), (X1, m.ExpectKV)]
    s.handle(m.KVFailed("t1", 0, "peer died"), X1, 0.0, 0.0)
    assert sends(s) == [(X0, m.CancelKV("t1", 0, "peer died"))]
    s.handle(m.KVFailed("t1", 0, "cancelled"), X0, 0.0, 0.0)
    (cancel, (to, failed)) = sends(s)
    assert cancel == (X1, m.CancelKV("t1", 0, "cancelled"))
    assert to == A and failed.status == 502 and failed.reason == "KV transfer failed: peer died"


def test_stats_go_to_every_router_that_asked_once_every_writer_answered():
    s, _ = make("prefill")
    s.handle(m.GetStats(), A, 5.0, 5.0)
    s.handle(m.GetStats(), B, 5.0, 5.0)
    assert sends(s) == [(X0, m.GetStats()), (X1, m.GetStats())]  # asked once for both
    s.handle(m.WriterStats({"kv_bytes": 7}), X1, 5.0, 5.0)
    assert sends(s) == []
    s.handle(m.WriterStats({"kv_bytes": 9}), X0, 5.0, 5.0)
    out = sends(s)
    assert [to for to, _ in out] == [A, B]
    assert out[0][1].counters["writer.0.kv_bytes"] == 9 and out[0][1].counters["writer.1.kv_bytes"] == 7


def test_reset_prefix_cache_forgets_the_cache_and_answers_with_stats():
    s, _ = make("prefill")
    blocks = s.alloc.acquire([], 2)
    for b, h in zip(blocks, (5, 6)):
        s.alloc.insert(b, h)
    s.alloc.release(blocks)
    assert s.alloc.num_cached == 2
    s.handle(m.ResetPrefixCache(), A, 5.0, 5.0)
    assert s.alloc.num_cached == 0 and s.alloc.match([5]) == []
    assert sends(s) == [(X0, m.GetStats()), (X1, m.GetStats())]  # the writers' counters asked, as GetStats asks
    s.handle(m.WriterStats({}), X0, 5.0, 5.0)
    s.handle(m.WriterStats({}), X1, 5.0, 5.0)
    (to, st), = sends(s)
    assert to == A and st.cached_blocks == 0
    assert st.counters["prefix_resets"] == 1 and st.counters["prefix_reset_blocks"] == 2


def test_stats_are_answered_without_a_silent_writer_once_its_wait_is_over():
    s, _ = make("prefill")
    s.handle(m.GetStats(), A, 5.0, 5.0)
    sends(s)
    s.tick(5.2, 5.2)
    assert sends(s) == []  # within WRITER_STATS_WAIT_S
    s.tick(5.3, 5.3)
    assert [(to, type(x)) for to, x in sends(s)] == [(A, m.Stats)]


def test_the_time_passed_in_is_the_time_used():
    """A step's deadline runs from the ``now`` of the call that launched it; a timeline stage is
    the ``wall`` of the call that reached it."""
    s, _ = make("local", mode="local", tp=1)
    step_s = s.cfg.timeouts.step_s
    s.handle(gen(leg="local", max_tokens=1), A, 100.0, 1e9)
    out = s.take_outbox()
    assert [e for e in out if isinstance(e, Trace)] == [Trace("local_queued", "t1"), Trace("local_alloc", "t1"),
                                                          Trace("prefill_start", "t1")]
    s.tick(100.0 + step_s, 1e9 + step_s)
    assert sends(s) == []
    s.tick(100.0 + step_s + 0.01, 1e9 + step_s)
    ((to, failed),) = sends(s)
    assert to == A and failed.status == 503 and "forward step exceeded" in failed.reason

    s, _ = make("local", mode="local", tp=1)
    s.handle(gen(leg="local", max_tokens=1), A, 100.0, 1e9)
    (step,) = [x for _, x in sends(s)]
    s.handle(m.StepDone(step.step_id, (5,)), W0, 100.5, 1e9 + 0.5)
    ((_, done),) = sends(s)
    assert dict(done.timeline) == {"local_queued": 1e9, "local_alloc": 1e9, "prefill_start": 1e9,
                                   "prefill_end": 1e9 + 0.5, "first_token": 1e9 + 0.5, "finished": 1e9 + 0.5}


def test_shutdown_refuses_every_request_still_here_to_its_sender():
    s, _ = make("prefill")
    s.handle(gen("ta"), A, 0.0, 0.0)
    s.handle(gen("tb"), B, 0.0, 0.0)
    sends(s)
    s.shutdown("upgrade")
    out = sends(s)
    assert [(to, x.transfer_id, x.status) for to, x in out] == [(A, "ta", 503), (B, "tb", 503)]
    assert out[0][1].reason == "scheduler shutting down (upgrade)"


PURE = ["core", "prefill", "decode", "local", "outbox", "prefix", "requests", "validate"]


@pytest.mark.parametrize("module", PURE)
def test_the_core_imports_no_socket_actor_or_clock(module):
    """Only the shell (``scheduler/shell.py``) may: the rest is driven by plain calls."""
    path = pathlib.Path(pushkv.scheduler.__file__).parent / f"{module}.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(f"{node.module}.{a.name}" for a in node.names)
    assert not names & {"zmq", "time", "pushkv.actor", "pushkv.scheduler.shell", "pushkv.transport"}, names
