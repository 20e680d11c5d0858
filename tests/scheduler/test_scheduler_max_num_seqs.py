"""vLLM's max_num_seqs bounds the requests running on an instance, not only a step's sequences: past it a request
waits in the queue (its queue time running on, the waiting gauge counting it) and is admitted as one ends. D admits
on (its early registration is push), and so do the requests P has sent."""
from __future__ import annotations

import msgspec

from pushkv import messages as m
from tests.scheduler.test_scheduler_prefix import generate, idle, make, prompt, run_all, run_step
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, deliver, wired


def capped(role: str, mode: str, max_num_seqs: int):
    s, _ = make(role=role, mode=mode, num_blocks=64)
    return wired(s.cfg, msgspec.structs.replace(s.inst, max_num_seqs=max_num_seqs))


def test_local_runs_at_most_max_num_seqs_and_admits_the_next_as_one_ends():
    s, wire = capped("local", "local", 2)
    for i in range(4):
        generate(s, f"t{i}", prompt(10, i), max_tokens=1 + 2 * (i == 1))  # t1 decodes longest
    # t0's step runs; the rest came meanwhile and are admitted as a step is built (vLLM's scheduler admits then)
    assert [r.transfer_id for r in s.waiting] == ["t1", "t2", "t3"]
    s.now += 5.0  # their queue time: from arrival to admission
    run_step(s, wire)  # t0 ends with its first token: t1 and t2 come in, t3 waits for one of them
    assert [r.transfer_id for r in s.waiting] == ["t3"]
    waited = {x.labels.get("le"): x.value for x in s.metrics.queue.collect()[0].samples if x.name.endswith("_sum")}
    assert waited[None] == 10.0  # t0 at once, t1 and t2 after 5 s
    s.publish_metrics()
    assert (s.metrics.snap.running, s.metrics.snap.waiting) == (2, 1)  # vllm:num_requests_running / _waiting
    run_all(s, wire)
    assert idle(s) and s.counters["requests_completed"] == 4


def test_decode_admits_past_max_num_seqs_while_it_waits_for_kv():
    s, _ = capped("decode", "push", 1)
    for i in range(3):
        deliver(s, ROUTER, m.Generate(f"d{i}", 0, "decode", prompt(10, i), 4, source=P_SRC))
    assert not s.waiting and len(s.reqs) == 3  # every one registered with P at once


def test_a_timed_out_step_whose_one_rank_answered_in_time_frees_when_the_other_answers():
    """TP 2, rank 1 hangs: the request fails at the step's deadline; rank 0 had answered already and will not again,
    so the blocks are freed once rank 1 answers (they had waited for two late answers, for ever)."""
    s, wire = make(tp=2, num_blocks=64)
    generate(s, "t0", prompt(20), max_tokens=3)
    (step,) = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)][:1]
    deliver(s, s.workers[0], m.StepDone(step.step_id, (42,)))
    s.tick(s.now + s.cfg.timeouts.step_s + 1, 0.0)
    assert not s.reqs and s.alloc.num_free < s.alloc.num_blocks  # failed, its blocks held for rank 1
    deliver(s, s.workers[1], m.StepDone(step.step_id, (42,)))
    assert idle(s) and not s.late_steps and s.counters["late_step_blocks_freed"] > 0


def test_decode_steps_at_most_max_num_seqs_in_the_order_the_kv_landed_and_counts_the_rest_waiting():
    """--max-num-seqs 1 on D: d1's KV lands first and it decodes; d0's lands next and waits (vllm:num_requests_waiting,
    as vLLM's D keeps a request whose KV came in its queue while its running list is full) until d1 ends: d0 came
    first, but a request that is decoding is never set aside for one that arrived before it."""
    s, wire = capped("decode", "push", 1)
    for i in range(2):
        deliver(s, ROUTER, m.Generate(f"d{i}", 0, "decode", prompt(10, i), 4, source=P_SRC))
    for tid in ("d1", "d0"):
        for w in s.writers:
            deliver(s, w, m.KVReceived(tid, 0, 42))
    d0, d1 = s.by_tid["d0"], s.by_tid["d1"]
    s.publish_metrics()
    assert (s.metrics.snap.running, s.metrics.snap.waiting) == (1, 1)
    order = []
    while s.reqs:
        order += [tid for w in run_step(s, wire) for tid, r in (("d0", d0), ("d1", d1)) if w.seq_id == r.seq_id]
        s.publish_metrics()
        assert s.metrics.snap.running <= 1
    assert order == ["d1"] * 3 + ["d0"] * 3  # each step one sequence; d1 to its end, then d0
    assert idle(s) and s.counters["requests_completed"] == 2


def test_a_timed_out_step_of_two_requests_sharing_a_cached_prefix_frees_every_block_once_answered():
    """Two requests decode in one step over the same cached prefix (their shared blocks held twice), and the step
    times out: once the hung worker answers, each of their blocks is given back once for each request that held it.
    The blocks of the step were freed as one list, which the prefix cache refuses where a block repeats ('given
    twice'): the answer raised, and every block of that step was lost to the pool for good."""
    s, wire = make(num_blocks=16)
    generate(s, "warm", prompt(40))
    run_all(s, wire)  # its prompt's two full blocks are cached
    generate(s, "a", prompt(40), max_tokens=4)  # its prefill's step runs
    generate(s, "b", prompt(40), max_tokens=4)  # came meanwhile
    run_step(s, wire)  # a's first token: b is admitted and prefills beside a's decode
    (step,) = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)]
    shared = set(s.reqs[("a", 0)].blocks) & set(s.reqs[("b", 0)].blocks)
    assert len(step.seqs) == 2 and shared  # both in the step, over the same cached blocks
    s.tick(s.now + s.cfg.timeouts.step_s + 1, 0.0)
    assert not s.reqs and s.late_steps
    deliver(s, s.workers[0], m.StepDone(step.step_id, (42, 42)))  # the hung worker answers at last
    assert idle(s) and not s.late_steps
    assert s.counters["late_step_blocks_freed"] == s.counters["late_step_blocks_held"] > 0
