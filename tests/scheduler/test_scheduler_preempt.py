"""Blocks as tokens need them, and preemption by recompute (local instances and D's legs), driven by plain calls
(the harness of tests/scheduler/test_scheduler_prefix.py): a request is admitted with its prefill's blocks (those of
the tokens its first step computes: tests/scheduler/test_scheduler_chunk_alloc.py), gets a block before the step whose
token starts one, and when none is free the last admitted of
the requests computing here gives its blocks back and waits at the front of the queue; readmitted, it prefills its
prompt and output so far, its last chunk sampling the next output token as a decode step would, and nothing it
already sent is sent again. P's streamed push legs hold their prompt's blocks from admission, as before."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.kv.layout import blocks_for
from pushkv.scheduler.requests import State
from tests.scheduler.test_scheduler_prefix import BS, generate, idle, make, prompt
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, deliver


def step(s, wire, token=42):
    """Answer the one step in flight (every sampled seq draws ``token``); its SeqWorks."""
    steps = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)]
    assert len(steps) == 1, steps
    sampled = tuple(token for w in steps[0].seqs if w.sample)
    for ch in s.workers:
        deliver(s, ch, m.StepDone(steps[0].step_id, sampled))
    return steps[0].seqs


def streamed(wire) -> dict[str, list[int]]:
    """Tokens each request sent the router so far, in order."""
    out: dict[str, list[int]] = {}
    for x in wire.take("router"):
        if isinstance(x, m.TokensGenerated):
            out.setdefault(x.transfer_id, []).extend(x.token_ids)
    return out


def finish(s, wire, got, token=42):
    while s.reqs:
        step(s, wire, token)
        for tid, toks in streamed(wire).items():
            got.setdefault(tid, []).extend(toks)


def test_a_block_comes_when_the_next_token_needs_one():
    s, wire = make(num_blocks=16, cache=False)
    generate(s, "a", prompt(15), max_tokens=40)
    r = s.by_tid["a"]
    assert len(r.blocks) == 1  # 15 prompt tokens and the first output's slot: one block, not 55 tokens' four
    tables = []
    while s.reqs:
        (w,) = step(s, wire)
        tables.append((w.start_pos + len(w.token_ids), len(w.block_table)))
        assert s.alloc.num_blocks - s.alloc.num_free == (len(r.blocks) if s.reqs else 0)
    # every step's table holds exactly the tokens it stores, no more
    assert all(n == blocks_for(end, BS) for end, n in tables)
    assert [n for _, n in tables][:4] == [1, 1, 2, 2] and tables[-1] == (15 + 39, 4)
    assert idle(s)


def test_p_holds_its_whole_prompt_from_admission_and_never_grows():
    s, wire = make(role="prefill", mode="push", num_blocks=16)
    generate(s, "p", prompt(40), leg="prefill", max_tokens=1)
    assert len(s.by_tid["p"].blocks) == 3 and s.grows is False


def test_admission_takes_the_prefill_and_one_slot_and_leaves_the_watermark():
    s, wire = make(num_blocks=4, cache=False)
    generate(s, "a", prompt(20), max_tokens=44)  # 21 tokens: 2 blocks (its 64 would be all 4)
    generate(s, "b", prompt(20), max_tokens=10)  # 2 more would leave none for "a" to grow into: it waits
    assert len(s.by_tid["a"].blocks) == 2 and [r.transfer_id for r in s.waiting] == ["b"]
    generate(s, "c", prompt(10), max_tokens=10, leg="local")
    assert [r.transfer_id for r in s.waiting] == ["b", "c"]  # FIFO: nothing passes the head


def test_a_request_larger_than_the_pool_is_still_refused():
    s, wire = make(num_blocks=4, cache=False)
    generate(s, "big", prompt(20), max_tokens=60)  # 80 tokens: 5 blocks of 16, in a pool of 4
    (fail,) = wire.take("router")
    assert isinstance(fail, m.RequestFailed) and fail.status == 413 and not s.reqs


def two_on_four_blocks(**kw):
    """"a" then "b" (15 prompt tokens each, 40 out) on 4 blocks: both run until the pool is full, then "a" needs
    a fifth block and "b", admitted last, is preempted."""
    s, wire = make(num_blocks=4, cache=kw.pop("cache", False), **kw)
    generate(s, "a", prompt(15), max_tokens=40)
    generate(s, "b", prompt(15, 100), max_tokens=40)
    got: dict[str, list[int]] = {}
    assert [r.transfer_id for r in s.waiting] == ["b"]  # it came during a's step: admitted as the next is built
    step(s, wire)
    assert not s.waiting
    got = streamed(wire)
    while not s.counters["preemptions"]:
        step(s, wire)
        for tid, toks in streamed(wire).items():
            got.setdefault(tid, []).extend(toks)
    return s, wire, got


def test_the_last_admitted_is_preempted_and_waits_at_the_front():
    s, wire, got = two_on_four_blocks()
    a, b = s.by_tid["a"], s.by_tid["b"]
    assert b.state == State.WAITING and s.waiting == [b] and not b.blocks and b.preemptions == 1
    assert len(a.blocks) == 3 and a.state == State.RUNNING
    assert len(b.output) == len(got["b"]) == 17  # what it sent stays sent
    generate(s, "c", prompt(5), max_tokens=2)
    assert s.waiting == [b, s.by_tid["c"]]  # a newcomer queues behind it
    s.publish_metrics()
    assert s.metrics.snap.waiting == 2 and s.metrics.snap.running == 1
    samples = {x.name: x.value for f in s.metrics.registry.collect() for x in f.samples if not x.labels.get("le")}
    assert samples["vllm:num_preemptions_total"] == 1
    assert samples["vllm:kv_cache_usage_perc"] == 3 / 4


def test_readmitted_it_prefills_prompt_and_output_and_samples_the_next_token():
    s, wire, got = two_on_four_blocks()
    b = s.by_tid["b"]
    out = tuple(b.output)
    while b.state == State.WAITING:  # "a" runs to its end alone
        step(s, wire)
        for tid, toks in streamed(wire).items():
            got.setdefault(tid, []).extend(toks)
    (w,) = [w for w in step(s, wire, token=7) if w.seq_id == b.seq_id]
    assert w.token_ids == prompt(15, 100) + out and w.start_pos == 0 and w.sample
    # the blocks of the tokens it computes, as vLLM's allocate_slots (the next token's come before the step that needs
    # them; greedy: no output_index needed)
    assert len(w.block_table) == blocks_for(len(w.token_ids), BS)
    assert w.score_prompt == -1
    (tg,) = [x for x in wire.take("router") if x.transfer_id == "b"]
    assert tg.token_ids == (7,) and tg.prompt_logprobs is None and tg.cached_tokens == 0  # a decode's token
    got["b"].append(7)
    finish(s, wire, got)
    assert {k: len(v) for k, v in got.items()} == {"a": 40, "b": 40}  # none twice, none lost
    assert s.counters["requests_completed"] == 2 and idle(s)
    # one first token each: the readmission is not a second prefill in the histograms
    samples = {x.name: x.value for f in s.metrics.registry.collect() for x in f.samples if not x.labels.get("le")}
    assert samples["vllm:time_to_first_token_seconds_count"] == 2
    assert samples["vllm:generation_tokens_total"] == 80


def test_readmission_takes_its_indexed_blocks_from_the_prefix_cache():
    s, wire, got = two_on_four_blocks(cache=True)
    b = s.by_tid["b"]
    computed = len(b.recompute)
    # b's prompt and output's full blocks stayed cached; "a" then took what it needed, LRU first
    while b.state == State.WAITING:
        step(s, wire)
    (w,) = [w for w in step(s, wire) if w.seq_id == b.seq_id]
    assert w.start_pos % BS == 0 and w.start_pos + len(w.token_ids) == computed
    assert s.counters["recompute_hit_tokens"] == w.start_pos
    finish(s, wire, {})
    assert idle(s)


def test_readmission_chunks_like_any_prompt_and_only_its_last_chunk_samples():
    s, wire, got = two_on_four_blocks(chunk=8)
    b = s.by_tid["b"]
    n = len(b.recompute)
    while b.state == State.WAITING:
        step(s, wire)
    chunks = []
    while b.state == State.PREFILL:
        chunks += [w for w in step(s, wire) if w.seq_id == b.seq_id]
    assert [len(w.token_ids) for w in chunks] == [8] * (n // 8) + ([n % 8] if n % 8 else [])
    assert [w.sample for w in chunks] == [False] * (len(chunks) - 1) + [True]
    finish(s, wire, {})
    assert idle(s)


def test_sampling_fields_of_the_readmission_are_a_decodes():
    sp = m.SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5, min_tokens=30)
    s, wire = make(num_blocks=4, cache=False)
    generate(s, "a", prompt(15), max_tokens=40, stop_token_ids=(9,))
    generate(s, "b", prompt(15, 100), max_tokens=40, sampling=sp, stop_token_ids=(9,))
    while not s.counters["preemptions"]:
        step(s, wire, token=3)
    b = s.by_tid["b"]
    while b.state == State.WAITING:
        step(s, wire, token=3)
    (w,) = [w for w in step(s, wire, token=3) if w.seq_id == b.seq_id]
    assert (w.sampling, w.output_index, w.history, w.suppress) == (sp, 17, (3,) * 17, (9,))
    finish(s, wire, {}, token=3)
    assert idle(s)


def test_a_request_aborted_while_preempted_ends_and_the_rest_go_on():
    s, wire, got = two_on_four_blocks()
    deliver(s, ROUTER, m.Abort("b", 0, "client gone"))
    assert "b" not in s.by_tid and not s.waiting and s.counters["aborted"] == 1
    finish(s, wire, got)
    assert len(got["a"]) == 40 and idle(s)


def test_a_preempted_request_alone_gets_the_pool_back():
    """A lone request whose output needs blocks a request waiting for its KV holds preempts itself, and is
    readmitted once they are free: it never fails for want of a block."""
    s, wire = make(role="decode", mode="push", num_blocks=4, cache=False)
    generate(s, "a", prompt(15), leg="decode", max_tokens=40, source=P_SRC)
    generate(s, "kv", prompt(15, 100), leg="decode", max_tokens=2, source=P_SRC)
    assert len(s.by_tid["kv"].blocks) == 1 and not s.waiting
    deliver(s, s.writers[0], m.KVReceived("a", 0, 42))
    got: dict[str, list[int]] = {}
    while not s.counters["preemptions"]:
        step(s, wire)
    a = s.by_tid["a"]
    assert a.state == State.WAITING and not wire.take("worker")  # nothing to run: "kv" holds one block
    deliver(s, s.writers[0], m.KVReceived("kv", 0, 43))  # "kv" decodes, ends, its block frees: "a" is back
    finish(s, wire, got)
    assert len(got["a"]) == 40 and idle(s)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_preempted_decode_leg_computes_again_on_d_and_never_waits_for_p_again(mode):
    s, wire = make(role="decode", mode=mode, num_blocks=4, cache=False)
    for tid, first in (("a", 1), ("b", 100)):
        if mode == "push":
            generate(s, tid, prompt(15, first), leg="decode", max_tokens=40, source=P_SRC)
        else:
            pull = m.PullParams(P_SRC, (0,), 15, 42, 1e9)
            generate(s, tid, prompt(15, first), leg="decode", max_tokens=40, pull=pull)
        deliver(s, s.writers[0], m.KVReceived(tid, 0, 42))
    wire.take("writer")
    got = streamed(wire)
    while not s.counters["preemptions"]:
        step(s, wire)
    b = s.by_tid["b"]
    assert b.state == State.WAITING and b.recompute == prompt(15, 100) + tuple(b.output)
    assert s.renew_every_s < s.cfg.timeouts.step_s
    s.tick(s.now + s.renew_every_s + 0.1, 0.0)  # lease renewals are due: none for b, whose KV came long ago
    assert not [x for x in wire.take("writer") if x.transfer_id == "b"]
    finish(s, wire, got)
    assert {k: len(v) for k, v in got.items()} == {"a": 40, "b": 40}
    assert not [x for x in wire.take("writer") if isinstance(x, (m.ExpectKV, m.ReadKV))]
    assert s.counters["preemptions"] >= 1 and idle(s)


def lora_decode(num_blocks: int):
    """D serving adapters a and b with --max-loras 1: the requests of both decode there at once (their KV came), a
    step takes one adapter's, and the two take turns."""
    from pushkv.config import DeploymentConfig, InstanceConfig, LoraConfig, LoraModule, preset
    from tests.scheduler.test_scheduler_roles import wired

    lora = LoraConfig(True, (LoraModule("a", "/adapters/a"), LoraModule("b", "/adapters/b")), max_loras=1)
    inst = InstanceConfig(role="decode", engine_id="decode-engine", num_blocks=num_blocks, prefix_cache=False,
                          worker_endpoints=("w0",), writer_endpoints=("x0",))
    prefill = InstanceConfig(role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
    return wired(DeploymentConfig(mode="push", model=preset("tiny", lora=lora), prefill=prefill, decode=inst), inst)


def test_only_the_requests_a_step_takes_get_their_next_block():
    """vLLM allocates only for the requests it schedules. "a" and "b" (adapters a and b, --max-loras 1) decode in
    turns on 3 blocks. At "a"'s third step both are past their first block, one block is free, and the step takes
    "a" alone: "a" gets it, and "b", left out, is not preempted for a block it does not need yet. That step ends
    "a", whose blocks then serve "b": no request is preempted at all (before, "b" was, at that step)."""
    s, wire = lora_decode(num_blocks=3)
    generate(s, "a", prompt(15), leg="decode", max_tokens=3, source=P_SRC, lora="a")
    generate(s, "b", prompt(15, 100), leg="decode", max_tokens=20, source=P_SRC, lora="b")
    for tid in ("a", "b"):
        deliver(s, s.writers[0], m.KVReceived(tid, 0, 42))
    a, b = s.by_tid["a"], s.by_tid["b"]
    taken = []
    while s.reqs:
        if [r for r, _ in s.step] == [a] and len(a.output) == 2:  # the step that draws a's last token, launched
            assert len(a.blocks) == 2 and s.alloc.num_free == 0
            assert len(b.output) == 2 and len(b.blocks) == 1 and b.blocks_short(BS) == 1  # left out, not preempted
        s.now += 1.0  # (a step's token time: whose turn it is goes by the longest wait)
        seqs = step(s, wire)
        taken.append(["a" if w.seq_id == a.seq_id else "b" for w in seqs])
    assert taken[:3] == [["a"], ["b"], ["a"]] and all(len(t) == 1 for t in taken)
    assert s.counters["preemptions"] == 0 and s.counters["requests_completed"] == 2 and idle(s)


def test_each_requests_preemptions_are_observed_at_its_end_as_vllms_histogram():
    from tests.scheduler.test_scheduler_metrics import scrape

    s, wire, got = two_on_four_blocks()
    name, label = "vllm:request_num_preemptions", (("engine", "0"), ("model_name", "small"))
    assert scrape(s)[(f"{name}_count", label)] == 0  # "b" is preempted, not ended
    finish(s, wire, got)
    text = scrape(s)
    buckets = {le: text[(f"{name}_bucket", (label[0], ("le", le), label[1]))]
               for le in ("1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf")}
    assert buckets == dict.fromkeys(buckets, 2)  # "a" never, "b" once: vLLM's first bucket holds both
    assert (text[(f"{name}_count", label)], text[(f"{name}_sum", label)]) == (2, 1)
