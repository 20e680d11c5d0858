"""Chunked prefill and streaming push in the scheduler, driven by plain calls (no sockets,
no processes; the harness of tests/scheduler/test_scheduler_roles.py): the batch builder's chunking
table, when P's scheduler sends StreamKV, and what it does with the request's blocks when
the stream is aborted or fails while P still computes."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.scheduler.requests import Request, State, build_batch
from tests.scheduler.test_scheduler_roles import ROUTER, all_free, deliver, tick, wired

CHUNK = 16


# --------------------------------------------------------------------------- build_batch
def prefill(seq_id: int, n: int, done: int = 0) -> Request:
    return Request(f"t{seq_id}", 0, "prefill", tuple(range(100, 100 + n)), 1, b"", seq_id=seq_id,
                   state=State.PREFILL, blocks=[seq_id], prefilled=done)


def decode(seq_id: int) -> Request:
    return Request(f"d{seq_id}", 0, "decode", (1, 2, 3), 8, b"", seq_id=seq_id, state=State.RUNNING,
                   blocks=[50 + seq_id], output=[9])


# name, prompts as (length, already prefilled), running decodes, max_num_seqs, budget, chunk,
# expected [(seq_id, start_pos, n tokens, samples)]
BATCHES = [
    ("unchunked_whole_prompt", [(40, 0)], 0, 8, 8192, 0, [(1, 0, 40, True)]),
    ("unchunked_one_prefill_past_the_budget", [(40, 0), (5, 0)], 0, 8, 10, 0, [(1, 0, 40, True)]),
    ("first_chunk_does_not_sample", [(40, 0)], 0, 8, 8192, 16, [(1, 0, 16, False)]),
    ("middle_chunk", [(40, 16)], 0, 8, 8192, 16, [(1, 16, 16, False)]),
    ("last_chunk_samples", [(40, 32)], 0, 8, 8192, 16, [(1, 32, 8, True)]),
    ("prompt_of_exactly_a_chunk", [(16, 0)], 0, 8, 8192, 16, [(1, 0, 16, True)]),
    ("prompt_shorter_than_a_chunk", [(5, 0)], 0, 8, 8192, 16, [(1, 0, 5, True)]),
    ("one_token_prompt", [(1, 0)], 0, 8, 8192, 16, [(1, 0, 1, True)]),
    ("several_prompts_each_a_chunk", [(40, 0), (20, 0)], 0, 8, 8192, 16, [(1, 0, 16, False), (2, 0, 16, False)]),
    ("budget_cuts_the_second_chunk", [(40, 0), (40, 0)], 0, 8, 20, 16, [(1, 0, 16, False), (2, 0, 4, False)]),
    ("budget_cuts_to_the_last_token", [(40, 0), (21, 16)], 0, 8, 21, 16, [(1, 0, 16, False), (2, 16, 5, True)]),
    ("nothing_left_for_a_third", [(40, 0), (40, 0), (40, 0)], 0, 8, 32, 16,
     [(1, 0, 16, False), (2, 0, 16, False)]),
    ("decodes_first_then_the_budget_left", [(40, 0)], 3, 8, 10, 16,
     [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True), (1, 0, 7, False)]),
    # the token budget counts every token, the decodes' first (vLLM's --max-num-batched-tokens)
    ("decodes_that_fill_the_budget_leave_no_chunk", [(40, 0), (40, 0)], 3, 8, 3, 16,
     [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True)]),
    ("decodes_past_the_budget_wait", [], 5, 8, 3, 16, [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True)]),
    ("decodes_past_the_budget_wait_unchunked", [(4, 0)], 5, 8, 2, 0, [(101, 3, 1, True), (102, 3, 1, True)]),
    ("unchunked_prompt_waits_for_the_budget_the_decodes_left", [(40, 0)], 3, 8, 41, 0,
     [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True)]),
    ("unchunked_prompt_that_fits_beside_the_decodes", [(38, 0)], 3, 8, 41, 0,
     [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True), (1, 0, 38, True)]),
    ("unchunked_prompt_past_the_whole_budget_runs_alone", [(40, 0)], 0, 8, 10, 0, [(1, 0, 40, True)]),
    ("max_num_seqs", [(40, 0), (40, 0)], 2, 3, 8192, 16, [(101, 3, 1, True), (102, 3, 1, True), (1, 0, 16, False)]),
    ("max_num_seqs_full_of_decodes", [(40, 0)], 3, 3, 8192, 16,
     [(101, 3, 1, True), (102, 3, 1, True), (103, 3, 1, True)]),
]


@pytest.mark.parametrize("name,prompts,decodes,max_seqs,budget,chunk,expected", BATCHES, ids=[b[0] for b in BATCHES])
def test_build_batch(name, prompts, decodes, max_seqs, budget, chunk, expected):
    pre = [prefill(i + 1, n, done) for i, (n, done) in enumerate(prompts)]
    run = [decode(101 + i) for i in range(decodes)]
    batch = build_batch(pre, run, max_seqs, budget, chunk)
    got = [(w.seq_id, w.start_pos, len(w.token_ids), w.sample) for _, w in batch]
    assert got == expected
    for r, w in batch:  # a chunk's tokens are the prompt's from where the last chunk ended
        if r.state == State.PREFILL:
            assert w.token_ids == r.prompt[w.start_pos:w.start_pos + len(w.token_ids)]
            assert w.block_table == tuple(r.blocks)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 100])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunks_cover_the_prompt_once_in_order(n, chunk):
    r = prefill(1, n)
    seen = []
    while r.prefilled < n:
        ((_, w),) = build_batch([r], [], 8, 8192, chunk)
        assert w.start_pos == r.prefilled and 1 <= len(w.token_ids) <= chunk
        assert w.sample == (w.start_pos + len(w.token_ids) == n)
        seen += w.token_ids
        r.prefilled += len(w.token_ids)
    assert tuple(seen) == r.prompt


# --------------------------------------------------------------------------- schedulers
def make(role="prefill", mode="push", push_stream="chunk", tp=2, chunk=CHUNK, num_blocks=16, model="small"):
    inst = InstanceConfig(role=role, engine_id=f"{role}-engine", tp=tp, num_blocks=num_blocks, prefill_chunk=chunk,
                          worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                          writer_endpoints=tuple(f"x{r}" for r in range(tp)))
    return wired(DeploymentConfig(mode=mode, push_stream=push_stream, model=preset(model), **{role: inst}), inst)


def generate(s, tid, n, leg="prefill", max_tokens=1, first=1, **kw):
    prompt = tuple(range(first, first + n))
    deliver(s, ROUTER, m.Generate(tid, 0, leg, prompt, max_tokens, **kw))


def step_of(wire):
    steps = wire.take("worker")
    assert steps and all(isinstance(x, m.ExecuteStep) for x in steps), steps
    return steps[0]


def finish_step(s, step, tokens=(42,)):
    """Every worker rank answers the step; a token per sampled sequence."""
    sampled = tuple(tokens[0] for w in step.seqs if w.sample)
    for ch in s.workers:
        deliver(s, ch, m.StepDone(step.step_id, sampled))


def run_chunk(s, wire):
    step = step_of(wire)
    finish_step(s, step)
    return step


def answer(s, rank, msg):
    deliver(s, s.writers[rank], msg)


def types(msgs):
    return [type(x).__name__ for x in msgs]


def test_push_chunk_streams_each_non_final_chunk():
    s, wire = make()
    generate(s, "t1", 40)
    spans = []
    for _ in range(3):
        step = run_chunk(s, wire)
        (w,) = step.seqs
        spans.append((w.start_pos, len(w.token_ids), w.sample))
        sent = wire.take("writer")
        if w.start_pos + len(w.token_ids) < 40:
            assert types(sent) == ["StreamKV", "StreamKV"]  # one per writer rank
            assert sent[0].num_tokens == w.start_pos + len(w.token_ids)
            assert sent[0].block_ids == tuple(s.reqs[("t1", 0)].blocks)
        else:
            assert types(sent) == ["SendKV", "SendKV"] and sent[0].num_tokens == 40 and sent[0].first_token == 42
    assert spans == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert wire.take("worker") == []  # nothing more to compute
    for rank in range(2):
        answer(s, rank, m.KVSent("t1", 0, nbytes=10, num_descs=1, rendezvous="registration_first",
                                 parts=2, stream="chunk"))
    (done,) = wire.take("router")
    assert isinstance(done, m.PrefillFinished) and done.first_token == 42
    assert (done.kv.parts, done.kv.stream) == (4, "chunk")
    assert all_free(s)


def test_a_hybrid_model_streams_no_chunk():
    """Sliding-window layers: the plan falls back to one WRITE at prefill end, and the scheduler
    reads that plan (it sends no StreamKV after a chunk, as the writers would stream nothing)."""
    s, wire = make(model="hybrid")
    generate(s, "t1", 40)
    for _ in range(2):
        run_chunk(s, wire)
        assert wire.take("writer") == []
    run_chunk(s, wire)
    assert types(wire.take("writer")) == ["SendKV", "SendKV"]
    assert not s.reqs[("t1", 0)].streamed
    for rank in range(2):
        answer(s, rank, m.KVSent("t1", 0, nbytes=10, num_descs=1, rendezvous="registration_first", stream="fallback"))
    (done,) = wire.take("router")
    assert done.kv.stream == "fallback: sliding-window layers; one WRITE at prefill end"


def test_a_prompt_within_one_chunk_streams_nothing():
    s, wire = make()
    generate(s, "t1", CHUNK)
    run_chunk(s, wire)
    assert types(wire.take("writer")) == ["SendKV", "SendKV"]


@pytest.mark.parametrize("mode, push_stream, late", [
    ("push", "off", False),  # chunked, not streamed
    ("pull", "chunk", False),  # pull: P holds the KV until D reads it
    ("push", "chunk", True),  # a late push request: P holds, D registers after the relay
])
def test_no_stream_without_push_chunk_or_for_late_requests(mode, push_stream, late):
    s, wire = make(mode=mode, push_stream=push_stream)
    generate(s, "t1", 40, late=late)
    for _ in range(3):
        run_chunk(s, wire)
    sent = wire.take("writer")
    holds = mode == "pull" or late
    assert types(sent) == (["HoldKV", "HoldKV"] if holds else ["SendKV", "SendKV"])
    assert not s.reqs[("t1", 0)].streamed


def test_local_chunked_prefill_samples_once_and_decodes():
    s, wire = make(role="local", mode="local", tp=1)
    generate(s, "t1", 40, leg="local", max_tokens=3)
    steps = [run_chunk(s, wire) for _ in range(5)]  # 3 chunks, then 2 decode steps
    assert [(w.start_pos, len(w.token_ids), w.sample) for st in steps for w in st.seqs] == [
        (0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True), (41, 1, True)]
    toks = [t for x in wire.take("router") for t in x.token_ids]
    assert toks == [42, 42, 42] and wire.take("writer") == [] and all_free(s)


def test_decodes_run_beside_a_chunked_prompt():
    """A long prompt does not hold a running decode back: every step carries it first."""
    s, wire = make(role="local", mode="local", tp=1)
    generate(s, "short", 3, leg="local", max_tokens=4)
    run_chunk(s, wire)  # its prefill
    generate(s, "long", 40, leg="local", max_tokens=1)
    short, long = s.by_tid["short"].seq_id, s.by_tid["long"].seq_id
    steps = [run_chunk(s, wire) for _ in range(4)]  # the first was launched before long arrived
    assert [[(w.seq_id, w.start_pos, len(w.token_ids)) for w in st.seqs] for st in steps] == [
        [(short, 3, 1)], [(short, 4, 1), (long, 0, 16)], [(short, 5, 1), (long, 16, 16)], [(long, 32, 8)]]
    assert all_free(s)


# --------------------------------------------------------------------------- aborts and failures mid-stream
def streaming(tp=2):
    """A P scheduler with request t1 (40 tokens) streamed once, its second chunk computing."""
    s, wire = make(tp=tp)
    generate(s, "t1", 40)
    run_chunk(s, wire)
    assert types(wire.take("writer")) == ["StreamKV"] * tp
    step = step_of(wire)
    r = s.reqs[("t1", 0)]
    assert r.in_step and r.streamed and s.alloc.num_free < s.alloc.num_blocks
    return s, wire, step


def held(s) -> int:
    return s.alloc.num_blocks - s.alloc.num_free


def test_abort_mid_stream_frees_only_when_every_writer_answered_and_the_step_ended():
    s, wire, step = streaming()
    deliver(s, ROUTER, m.Abort("t1", 0, "client gone"))
    cancels = wire.take("writer")
    assert types(cancels) == ["CancelKV", "CancelKV"] and cancels[0].reason == "client gone"
    finish_step(s, step)  # the chunk ends: the writers may still read the blocks
    assert held(s) and wire.take("writer") == []  # no more StreamKV, no SendKV
    assert wire.take("worker") == [], "an aborted prompt must not be computed further"
    answer(s, 0, m.KVFailed("t1", 0, "cancelled"))
    assert held(s)
    wire.take("writer")  # the scheduler passes the failure on to the other rank (a second cancel)
    answer(s, 1, m.KVFailed("t1", 0, "cancelled"))
    assert all_free(s)
    assert wire.take("router") == []  # the router aborted it: nothing to answer
    answer(s, 0, m.KVFailed("t1", 0, "late"))  # a late answer is counted, frees nothing twice
    assert s.counters["stale_writer_answer"] == 1 and all_free(s)


def test_abort_mid_stream_writers_first_then_the_step():
    s, wire, step = streaming()
    deliver(s, ROUTER, m.Abort("t1", 0, "client gone"))
    wire.take("writer")
    for rank in range(2):
        answer(s, rank, m.KVFailed("t1", 0, "cancelled"))
    assert held(s), "the chunk computing now still writes the blocks"
    finish_step(s, step)
    assert all_free(s) and wire.take("worker") == []
    assert not [x for x in wire.take("writer") if isinstance(x, (m.StreamKV, m.SendKV))]


def test_abort_mid_stream_with_a_new_request_waiting_for_its_blocks():
    """The blocks the stream holds go to the next request only once they are free."""
    s, wire, step = streaming()
    generate(s, "t2", 16 * 14, first=2)  # needs 14 of 16 blocks: waits for t1's 3 (no prefix shared)
    assert s.reqs[("t2", 0)].state == State.WAITING
    deliver(s, ROUTER, m.Abort("t1", 0, "client gone"))
    finish_step(s, step)
    for rank in range(2):
        assert s.reqs[("t2", 0)].state == State.WAITING
        answer(s, rank, m.KVFailed("t1", 0, "cancelled"))
    assert s.reqs[("t2", 0)].state == State.PREFILL
    (w,) = step_of(wire).seqs
    assert w.seq_id == s.reqs[("t2", 0)].seq_id


@pytest.mark.parametrize("lost, status, reason", [
    ("", 502, "KV stream failed: no registration within 30.0s"),
    ("decode instance failed: decode-writer-0 died (killed by SIGKILL)", 503,
     "decode instance failed: decode-writer-0 died (killed by SIGKILL); retry"),
])
def test_writer_failure_mid_stream_fails_the_request_and_frees_once(lost, status, reason):
    s, wire, step = streaming()
    answer(s, 0, m.KVFailed("t1", 0, "no registration within 30.0s", lost=lost))
    assert [(type(x), x.reason) for x in wire.take("writer")] == [(m.CancelKV, "no registration within 30.0s")]
    assert wire.take("router") == [] and held(s)  # rank 1 may still read the blocks
    answer(s, 1, m.KVFailed("t1", 0, "cancelled"))
    (failed,) = wire.take("router")
    assert (type(failed), failed.status) == (m.RequestFailed, status) and failed.reason.startswith(reason)
    assert held(s), "the chunk computing now still writes the blocks"
    finish_step(s, step)
    assert all_free(s)
    assert wire.take("worker") == [] and wire.take("router") == []
    assert not [x for x in wire.take("writer") if isinstance(x, (m.StreamKV, m.SendKV))]
    assert s.counters["requests_failed"] == 1


def test_writer_failure_crossing_the_last_chunk():
    """The prefill ended (SendKV out) before the stream's failure arrived: the request fails
    as any failed transfer does, its blocks freed once every rank answered."""
    s, wire = make()
    generate(s, "t1", 40)
    run_chunk(s, wire)
    run_chunk(s, wire)
    run_chunk(s, wire)
    assert types(wire.take("writer")) == ["StreamKV"] * 4 + ["SendKV"] * 2
    answer(s, 0, m.KVFailed("t1", 0, "streamed part: UCX error"))
    wire.take("writer")
    assert held(s)
    answer(s, 1, m.KVFailed("t1", 0, "cancelled"))
    (failed,) = wire.take("router")
    assert failed.status == 502 and "streamed part: UCX error" in failed.reason
    assert all_free(s)
    answer(s, 0, m.KVFailed("t1", 0, "refused: transfer already finished"))  # its late SendKV's answer
    assert all_free(s) and s.counters["stale_writer_answer"] == 1


def test_one_rank_streams_on_after_the_other_failed_until_both_answered():
    """With TP 2, rank 0's failure cancels rank 1; until rank 1 answers, its blocks may
    still be read, so nothing is freed and the request is not answered twice."""
    s, wire, step = streaming()
    answer(s, 0, m.KVFailed("t1", 0, "x"))
    wire.take("writer")
    finish_step(s, step)  # the stream still holds: the next chunk may go on, nothing is freed
    assert held(s) and wire.take("router") == []
    answer(s, 1, m.KVFailed("t1", 0, "cancelled"))
    (failed,) = wire.take("router")
    assert failed.status == 502
    for x in wire.take("worker"):  # a chunk launched meanwhile ends
        finish_step(s, x)
    assert all_free(s) and wire.take("router") == []


def test_tp1_writer_failure_mid_stream():
    s, wire, step = streaming(tp=1)
    answer(s, 0, m.KVFailed("t1", 0, "no registration"))
    (failed,) = wire.take("router")
    assert failed.status == 502
    finish_step(s, step)
    assert all_free(s) and wire.take("worker") == [] and wire.take("writer") == []


def test_step_timeout_mid_stream_ends_the_stream():
    """The worker hangs on a chunk: the request fails (503) and the writers are told to end the
    stream; its blocks wait for the hung step's answers (a worker that wakes still runs it), and the
    writers' late answers free nothing twice."""
    s, wire, step = streaming()
    tick(s, s.now + s.cfg.timeouts.step_s + 1)
    (failed,) = wire.take("router")
    assert failed.status == 503 and "forward step exceeded" in failed.reason
    cancels = wire.take("writer")
    assert types(cancels) == ["CancelKV", "CancelKV"] and cancels[0].reason == "request failed while streaming"
    assert not s.reqs and s.alloc.num_free < s.alloc.num_blocks
    for rank in range(2):
        answer(s, rank, m.KVFailed("t1", 0, "cancelled"))
    assert s.alloc.num_free < s.alloc.num_blocks
    finish_step(s, step)  # the hung worker answers at last
    assert all_free(s) and s.counters["stale_writer_answer"] == 2 and s.counters["stale_step_answer"] == 0
    assert s.counters["late_step_blocks_freed"] == s.counters["late_step_blocks_held"] > 0




def test_a_stream_failed_mid_step_then_the_step_timing_out_fails_the_request_once():
    """The writers end a stream (a peer gone) while its chunk computes: the request fails then (502) and waits for
    the step; the step then times out. The router is told once, and the failure is counted once (it was told a
    second time, 503, and counted twice)."""
    s, wire, step = streaming()
    for rank in range(2):
        answer(s, rank, m.KVFailed("t1", 0, "peer gone"))
    (failed,) = wire.take("router")
    assert failed.status == 502
    wire.take("writer")  # (each rank's failure cancels the other's part)
    tick(s, s.now + s.cfg.timeouts.step_s + 1)
    assert wire.take("router") == [] and s.counters["requests_failed"] == 1
    assert not s.reqs and wire.take("writer") == []  # the stream is over: nothing to cancel
    finish_step(s, step)  # the hung worker answers at last
    assert all_free(s) and s.counters["late_step_blocks_freed"] == s.counters["late_step_blocks_held"] > 0


@pytest.mark.parametrize("how", ["stream ended", "client gone"])
def test_a_request_failed_or_aborted_mid_step_is_not_failed_again_by_the_step_failing(how):
    """The request's stream ends (the router told 502) or the router aborts it while its chunk computes, and the
    step then fails on the workers: the router is not told again (it was told 500 after its 502, or of a request it
    had aborted itself), the failure is counted once, and the blocks are freed once nothing reads them."""
    s, wire, step = streaming()
    if how == "stream ended":
        for rank in range(2):
            answer(s, rank, m.KVFailed("t1", 0, "peer gone"))
        (failed,) = wire.take("router")
        assert failed.status == 502
    else:
        deliver(s, ROUTER, m.Abort("t1", 0, "client gone"))
    wire.take("writer")
    for ch in s.workers:
        deliver(s, ch, m.StepFailed(step.step_id, "CUDA error"))
    assert wire.take("router") == [] and s.counters["requests_failed"] == (how == "stream ended")
    for rank in range(2) if how == "client gone" else ():  # the writers confirm the cancel: nothing reads them
        answer(s, rank, m.KVFailed("t1", 0, "cancelled"))
    assert all_free(s)
