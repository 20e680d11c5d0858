"""Chunked prefill takes its blocks chunk by chunk, as vLLM's ``allocate_slots`` for the tokens it schedules, and the
step's token budget counts every token, the decodes' first (vLLM's --max-num-batched-tokens), driven by plain calls
(the harness of tests/scheduler/test_scheduler_roles.py).

A prompt computed chunk by chunk (local; D's prefill-here and recomputed legs; P's pull, --push-stream off and late
legs) is admitted into a step being built: its whole prefill must fit the free blocks and the watermark (vLLM's
``scheduler_reserve_full_isl``), it takes its first chunk's blocks, and before each step the blocks its next chunk
needs, preempting the last running where none is free. D's legs whose KV moves and P's streamed push take their
blocks whole at admission (the registration, the writers' reads), as before."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.kv.layout import blocks_for
from pushkv.scheduler.requests import Request, State
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, deliver, wired

BS = 16


def make(role="local", mode="local", num_blocks=16, chunk=16, budget=8192, push_stream="layer", tp=1, cache=False,
         max_num_seqs=32):
    inst = InstanceConfig(role=role, engine_id=f"{role}-engine", tp=tp, num_blocks=num_blocks, prefix_cache=cache,
                          prefill_chunk=chunk, max_batch_tokens=budget, max_num_seqs=max_num_seqs,
                          worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                          writer_endpoints=tuple(f"x{r}" for r in range(tp)))
    prefill = inst if role == "prefill" else InstanceConfig(
        role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
    cfg = DeploymentConfig(mode=mode, push_stream=push_stream, model=preset("small"),
                           **({"prefill": prefill} if role == "prefill" else {"prefill": prefill, role: inst}))
    return wired(cfg, inst)


def prompt(n, first=1):
    return tuple((first + i) % 300 for i in range(n))


LEGS = {  # role -> the Generate fields of a leg that computes its prompt there
    "local": dict(leg="local"),
    "prefill": dict(leg="prefill"),
    "decode": dict(leg="decode", prefill_here=True),
    "decode_kv": dict(leg="decode", source=P_SRC),
}


def gen(s, tid, n, kind, max_tokens=4, first=1, **kw):
    fields = dict(LEGS[kind]) | kw
    leg = fields.pop("leg")
    deliver(s, ROUTER, m.Generate(tid, 0, leg, prompt(n, first), 1 if leg == "prefill" else max_tokens,
                                  **fields))


def step(s, wire, token=42):
    """Answer the one step in flight (every sampled seq draws ``token``); its SeqWorks."""
    steps = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)]
    assert len({x.step_id for x in steps}) == 1 and len(steps) == len(s.workers), steps
    sampled = tuple(token for w in steps[0].seqs if w.sample)
    for ch in s.workers:
        deliver(s, ch, m.StepDone(steps[0].step_id, sampled))
    return steps[0].seqs


def writers_done(s, wire):
    """P: every writer rank says each transfer handed to it is done (push's WRITE, pull's READ)."""
    for x in wire.take("writer"):
        if isinstance(x, (m.SendKV, m.HoldKV)):
            for w in s.writers:
                deliver(s, w, m.KVSent(x.transfer_id, x.generation, 1, 1, 0.001))


def idle(s):
    s.alloc.check()
    return s.alloc.num_free == s.alloc.num_blocks and not s.reqs and not s.waiting


# name, role, mode, push stream, kind of leg, expected after the second step is built: the blocks each of the four
# 96-token prompts holds (a: admitted alone, with its first step; b, c, d: came during it) and the ids still waiting.
# A 16-block pool; 96 tokens are 6 blocks, chunks of 16 tokens one. Before, every leg took its whole prompt's
# blocks at admission (local and D: and the first output's slot, 7): two of them ran at once.
ADMISSION = [
    ("local_takes_a_chunk_a_step", "local", "local", "layer", "local", [2, 1, 1, 1], []),
    ("local_tp2", "local", "local", "layer", "local", [2, 1, 1, 1], []),
    ("p_pull_chunk_by_chunk", "prefill", "pull", "layer", "prefill", [2, 1, 1, 1], []),
    ("p_push_unstreamed_chunk_by_chunk", "prefill", "push", "off", "prefill", [2, 1, 1, 1], []),
    # streamed push: the writers read the blocks from the first chunk or layer group, they could not be given back
    ("p_push_layer_streamed_keeps_the_whole_prompt", "prefill", "push", "layer", "prefill", [6, 6], ["c", "d"]),
    ("p_push_chunk_streamed_keeps_the_whole_prompt", "prefill", "push", "chunk", "prefill", [6, 6], ["c", "d"]),
    ("d_prefill_here_chunk_by_chunk", "decode", "push", "layer", "decode", [2, 1, 1, 1], []),
    # push: D registers the whole prompt's blocks with P at admission (P WRITEs each as it is computed)
    ("d_push_registers_the_whole_prompt", "decode", "push", "layer", "decode_kv", [7, 7], ["c", "d"]),
    ("d_pull_reads_the_whole_prompt", "decode", "pull", "layer", "decode_kv", [7, 7], ["c", "d"]),
]


@pytest.mark.parametrize("name,role,mode,stream,kind,blocks,waiting", ADMISSION, ids=[c[0] for c in ADMISSION])
def test_admission_takes_the_first_chunks_blocks_where_the_prompt_is_computed_chunk_by_chunk(
        name, role, mode, stream, kind, blocks, waiting):
    s, wire = make(role=role, mode=mode, push_stream=stream, tp=2 if name.endswith("tp2") else 1)
    kw = {}
    if kind == "decode_kv" and mode == "pull":
        kw = {"source": None, "pull": m.PullParams(P_SRC, tuple(range(6)), 96, 42, 1e9)}
    for i, tid in enumerate("abcd"):
        gen(s, tid, 96, kind, first=1 + 50 * i, **kw)
    if kind != "decode_kv":
        step(s, wire)  # a's first chunk: b, c and d came meanwhile, admitted as the next step is built
    held = [len(s.by_tid[t].blocks) for t in "abcd" if s.by_tid[t].state != State.WAITING]
    assert held == blocks
    assert [r.transfer_id for r in s.waiting] == waiting
    if kind == "decode_kv":
        registered = [x for x in wire.take("writer") if isinstance(x, (m.ExpectKV, m.ReadKV))]
        assert [len(x.block_ids) for x in registered] == [7, 7][:len(blocks)]


def run_to_end(s, wire, limit=500):
    """Every step and transfer until nothing is left; the SeqWorks of every step, in order."""
    steps = []
    for _ in range(limit):
        if not s.reqs:
            return steps
        if s.step is not None:
            steps.append(step(s, wire))
        writers_done(s, wire)
    raise AssertionError("did not finish")


# name, prompt length, chunk, prefix-cached prompt first (its blocks hit), the block table of each of the prompt's
# steps: the blocks of the tokens computed so far (before: the whole prompt's from the first, and the first output's)
GROWTH = [
    ("a_block_a_chunk", 40, 16, False, [1, 2, 3]),
    ("two_blocks_a_chunk", 70, 32, False, [2, 4, 5]),
    ("block_unaligned_chunks", 40, 10, False, [1, 2, 2, 3]),
    ("unchunked_takes_the_prompts_at_once", 40, 0, False, [3]),
    ("prefix_hits_then_the_chunks_past_them", 70, 16, True, [4, 5]),  # 48 tokens hit: 3 blocks, then 16 a step
]


@pytest.mark.parametrize("name,n,chunk,cached,tables", GROWTH, ids=[c[0] for c in GROWTH])
@pytest.mark.parametrize("role", ["local", "prefill"])
def test_each_chunk_takes_the_blocks_of_its_tokens(name, n, chunk, cached, tables, role):
    s, wire = make(role=role, mode="local" if role == "local" else "pull", chunk=chunk, cache=cached)
    if cached:  # the same prompt's first 48 tokens, computed and indexed before
        gen(s, "warm", 48, role)
        run_to_end(s, wire)
    gen(s, "a", n, role)
    a = s.by_tid["a"]
    got = []
    while a.state == State.PREFILL:
        (w,) = step(s, wire)
        got.append(len(w.block_table))
        assert len(w.block_table) == blocks_for(w.start_pos + len(w.token_ids), BS)
    assert got == tables
    run_to_end(s, wire)
    assert idle(s)


@pytest.mark.parametrize("role", ["local", "prefill", "decode"])
def test_a_prompt_short_of_blocks_mid_prefill_preempts_the_last_running_and_both_finish(role):
    """Two 96-token prompts (6 blocks each) on 9 blocks, chunks of 16: both are admitted (each's whole prompt and the
    watermark fit what is free), and as their chunks grow the pool runs out: the last admitted, mid-prefill, is
    preempted (its blocks back, to the queue's front), the first finishes, then it does. Every block is free after."""
    s, wire = make(role=role, mode="local" if role == "local" else "pull", num_blocks=9)
    kind = role
    gen(s, "a", 96, kind)
    gen(s, "b", 96, kind, first=120)
    step(s, wire)
    a, b = s.by_tid["a"], s.by_tid["b"]
    assert a.state == b.state == State.PREFILL and (len(a.blocks), len(b.blocks)) == (2, 1)
    seen = []
    for _ in range(100):
        if s.counters["preemptions"]:
            break
        step(s, wire)
        seen.append((b.state, b.prefilled))
    assert s.counters["preemptions"] == 1 and b.state == State.WAITING and s.waiting == [b] and not b.blocks
    assert 0 < seen[-2][1] < 96  # it was preempted mid-prefill
    assert a.state == State.PREFILL
    steps = run_to_end(s, wire)
    ends = [w.seq_id for ws in steps for w in ws if w.sample]
    if role == "prefill":
        assert ends == [a.seq_id, b.seq_id]  # each prompt's one sampled token
    assert s.counters["requests_completed" if role != "prefill" else "kv_transfers"] == 2
    assert idle(s)


def test_the_token_budget_counts_the_decodes():
    """--max-batch-tokens 2 on D with three decoding (their KV came): a step takes two of them, as vLLM's token budget
    (the oldest running first, as vLLM's running list); before, every decode ran each step whatever
    the budget."""
    s, wire = make(role="decode", mode="push", budget=2, num_blocks=32)
    for i, tid in enumerate("abc"):
        gen(s, tid, 3, "decode_kv", max_tokens=5, first=1 + 10 * i)
        for w in s.writers:
            deliver(s, w, m.KVReceived(tid, 0, 42))
    seq = {s.by_tid[t].seq_id: t for t in "abc"}
    taken = []
    while s.reqs:
        ws = step(s, wire)
        taken.append("".join(seq[w.seq_id] for w in ws))
    assert taken[:3] == ["a", "ab", "ab"] and all(len(t) <= 2 for t in taken)  # (a alone: b and c came during it)
    assert "".join(taken).count("c") == 4 and idle(s)  # (its first token came with the KV)


# waiting queue as (seq id, preempted), the seq id of a request whose grammar compiled now: the queue's order after
QUEUE = [
    ("behind_a_preempted_one_that_came_later", [(5, True)], 3, [5, 3]),
    ("behind_every_preempted_then_by_arrival", [(7, True), (1, True), (2, False), (9, False)], 3, [7, 1, 2, 3, 9]),
    ("by_arrival_among_the_fresh", [(2, False), (6, False)], 4, [2, 4, 6]),
    ("first_in_an_empty_queue", [], 3, [3]),
    ("last_after_all", [(1, True), (2, False)], 8, [1, 2, 8]),
]


@pytest.mark.parametrize("name,waiting,new,order", QUEUE, ids=[c[0] for c in QUEUE])
def test_a_grammar_compiled_late_queues_behind_the_preempted(name, waiting, new, order):
    from pushkv.scheduler.grammar_wait import enqueue

    def req(seq, preempted=False):
        return Request(f"t{seq}", 0, "local", (1,), 1, b"", seq_id=seq, preemptions=int(preempted))

    queue = [req(seq, p) for seq, p in waiting]
    enqueue(queue, req(new))
    assert [r.seq_id for r in queue] == order
