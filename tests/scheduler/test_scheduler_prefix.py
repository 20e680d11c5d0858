"""Prefix caching in the schedulers, driven by plain calls (the harness of
tests/scheduler/test_scheduler_roles.py): what a request computes when its prompt's prefix is cached,
which blocks it shares, when blocks are indexed, and that a shared block outlives every
request but the last that holds it."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.protocol.prefix_cache import block_hashes, root_of
from pushkv.scheduler.requests import State
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, deliver, wired

BS = 16


def make(role="local", mode="local", num_blocks=16, cache=True, tp=1, chunk=0):
    inst = InstanceConfig(role=role, engine_id=f"{role}-engine", tp=tp, num_blocks=num_blocks, prefix_cache=cache,
                          prefill_chunk=chunk, worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                          writer_endpoints=tuple(f"x{r}" for r in range(tp)))
    prefill = InstanceConfig(role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
    return wired(DeploymentConfig(mode=mode, **{"prefill": prefill, role: inst}), inst)


def prompt(n, first=1):
    return tuple((first + i) % 300 for i in range(n))


def generate(s, tid, toks, leg="local", max_tokens=1, **kw):
    deliver(s, ROUTER, m.Generate(tid, 0, leg, toks, max_tokens, **kw))


def run_step(s, wire, token=42):
    """Answer the step the scheduler launched; returns its SeqWorks."""
    steps = wire.take("worker")
    assert steps and all(isinstance(x, m.ExecuteStep) for x in steps), steps
    sampled = tuple(token for w in steps[0].seqs if w.sample)
    for ch in s.workers:
        deliver(s, ch, m.StepDone(steps[0].step_id, sampled))
    return steps[0].seqs


def run_all(s, wire):
    seqs = []
    while wire.sent and any(isinstance(x, m.ExecuteStep) for _, x in wire.sent):
        seqs += run_step(s, wire)
    return seqs


def idle(s):
    s.alloc.check()
    return s.alloc.num_free == s.alloc.num_blocks and not s.reqs and not s.waiting


# name, first prompt, second prompt, (second's start_pos, its hit tokens)
LOCAL = [
    ("same_prompt_reuses_all_but_the_last_block", prompt(40), prompt(40), (32, 32)),
    ("block_aligned_prompt_computes_its_last_block", prompt(32), prompt(32), (16, 16)),
    ("longer_prompt_reuses_the_shared_blocks", prompt(40), prompt(70), (32, 32)),
    ("a_differing_first_block_hits_nothing", prompt(40), (7,) + prompt(39, 2), (0, 0)),
    ("a_differing_middle_block_hits_up_to_it", prompt(40), prompt(20) + (7,) + prompt(19, 22), (16, 16)),
    ("shorter_than_a_block_hits_nothing", prompt(10), prompt(10), (0, 0)),
]


@pytest.mark.parametrize("name,first,second,want", LOCAL, ids=[c[0] for c in LOCAL])
def test_local_second_request_computes_only_its_uncached_suffix(name, first, second, want):
    s, wire = make()
    generate(s, "a", first)
    run_all(s, wire)
    assert idle(s)
    generate(s, "b", second)
    (w,) = run_step(s, wire)
    assert (w.start_pos, s.counters["prefix_hit_tokens"]) == want
    assert w.token_ids == second[w.start_pos:] and w.sample
    assert s.counters["prefix_queries"] == 2
    assert s.counters["prefix_hits"] == (1 if want[1] else 0)
    assert idle(s)


def test_local_first_token_tells_the_prefix_hits_before_the_finish():
    """A choice a stop string ends at the router never gets its finish: its usage's cached tokens come with the
    first token (the later ones say 0)."""
    s, wire = make()
    generate(s, "a", prompt(40))
    run_all(s, wire)
    generate(s, "b", prompt(40), max_tokens=3)
    run_step(s, wire)
    run_step(s, wire)
    got = [x for _, x in wire.sent if isinstance(x, m.TokensGenerated) and x.transfer_id == "b"]
    assert [(x.finished, x.cached_tokens) for x in got] == [(False, 32), (False, 0)]
    run_all(s, wire)
    assert idle(s)


@pytest.mark.parametrize("first, second, hit", [("", "", 32), ("tenant-a", "tenant-a", 32), ("tenant-a", "tenant-b", 0),
                                                ("tenant-a", "", 0), ("", "tenant-a", 0)])
def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(first, second, hit):
    """vLLM's cache_salt: the same prompt finds the first request's blocks only when both give the same salt
    (none being a salt of its own)."""
    s, wire = make()
    generate(s, "a", prompt(40), cache_salt=first)
    run_all(s, wire)
    generate(s, "b", prompt(40), cache_salt=second)
    assert s.by_tid["b"].hashes[:2] == block_hashes(prompt(40), BS, root_of(second))[:2]
    (w,) = run_step(s, wire)
    assert (w.start_pos, s.counters["prefix_hit_tokens"]) == (hit, hit)
    run_all(s, wire)
    assert idle(s)


def test_local_output_blocks_are_cached_for_the_next_turn():
    """Turn 2 repeats turn 1's prompt and output: it hits the output's full blocks too."""
    s, wire = make()
    generate(s, "t1", prompt(20), max_tokens=30)
    run_all(s, wire)
    out = [t for x in wire.take("router") for t in x.token_ids]
    assert len(out) == 30 and idle(s)
    # tokens with KV: the prompt and the output but its last token: 49, so 3 full blocks
    turn2 = prompt(20) + tuple(out) + prompt(5, 100)
    generate(s, "t2", turn2)
    (w,) = run_step(s, wire)
    assert w.start_pos == 48


def test_shared_blocks_are_held_by_every_request_that_hit_them():
    s, wire = make()
    generate(s, "a", prompt(40), max_tokens=3)
    run_step(s, wire)  # a's prefill: its 2 full blocks are indexed now
    a = s.by_tid["a"]
    generate(s, "b", prompt(40), max_tokens=3)  # during a's first decode: admitted as the next step is built
    run_step(s, wire)
    b = s.by_tid["b"]
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [s.alloc.refs(x) for x in a.blocks[:3]] == [2, 2, 1]
    deliver(s, ROUTER, m.Abort("a", 0, "gone"))  # a's first decode step runs: held till it ends
    assert [s.alloc.refs(x) for x in b.blocks[:2]] == [2, 2]
    run_step(s, wire)
    assert "a" not in s.by_tid and [s.alloc.refs(x) for x in b.blocks[:3]] == [1, 1, 1]
    run_all(s, wire)
    assert idle(s) and s.alloc.num_cached >= 2


def test_a_block_is_indexed_only_once_its_step_ended():
    """A block is indexed (and hit) only once the step that computed it ended; a request that comes while that step
    runs is admitted as the next step is built (vLLM's scheduler admits between steps), and hits it then."""
    s, wire = make(chunk=16)
    generate(s, "a", prompt(40))
    steps = wire.take("worker")  # a's first chunk is computing
    assert s.alloc.num_cached == 0
    generate(s, "b", prompt(40))
    assert s.by_tid["b"].state == State.WAITING and s.by_tid["b"].cached == 0
    for ch in s.workers:
        deliver(s, ch, m.StepDone(steps[0].step_id, ()))
    assert s.alloc.num_cached == 1 and s.by_tid["b"].cached == 16  # a's first block is in now
    run_all(s, wire)
    assert idle(s)


def test_a_reset_during_a_prefill_leaves_no_orphan_of_it_cached():
    """/reset_prefix_cache while a prompt is computed chunk by chunk: its first chunk's block is forgotten, so its
    later blocks, whose hashes chain from it, could never be hit, and their KV events would name a parent that was
    cleared (vLLM refuses a reset while blocks are held, so its consumers never see one). The request indexes none
    after the reset; a preempted one recomputes from a chain head again and indexes on."""
    s, wire = make(chunk=16)
    s.alloc.journal = []
    generate(s, "a", prompt(50))
    run_step(s, wire)  # its first 16 tokens: block 0 indexed
    assert s.alloc.num_cached == 1
    deliver(s, ROUTER, m.ResetPrefixCache())
    run_all(s, wire)  # blocks 1 and 2 complete after the reset
    assert idle(s)
    after = s.alloc.journal[s.alloc.journal.index(("cleared",)) + 1:]
    assert s.alloc.num_cached == 0 and after == [], after
    generate(s, "b", prompt(50))  # computes it whole, and indexes it whole from the chain's head
    run_all(s, wire)
    generate(s, "c", prompt(50))
    (w,) = run_step(s, wire)
    assert w.start_pos == 48
    assert idle(s)


def test_evicted_when_memory_is_needed():
    s, wire = make(num_blocks=8)
    generate(s, "a", prompt(64))  # 4 blocks, all indexed
    run_all(s, wire)
    assert idle(s) and s.alloc.num_cached == 4
    generate(s, "b", prompt(100, 150))  # 7 blocks: 3 cached ones must go
    run_all(s, wire)
    assert idle(s)
    assert s.alloc.evictions == 3
    generate(s, "c", prompt(64))  # a's first block survived: evicted last-block first
    (w,) = run_step(s, wire)
    assert w.start_pos == 16


def test_cache_off_computes_every_prompt_whole():
    s, wire = make(cache=False)
    for tid in ("a", "b"):
        generate(s, tid, prompt(40))
        (w,) = run_step(s, wire)
        assert w.start_pos == 0
    assert idle(s) and s.alloc.num_cached == 0 and s.counters["prefix_queries"] == 0


def test_prefill_push_sends_every_block_shared_or_not():
    """P computes only the suffix, but D needs the whole prompt's KV: every block is sent."""
    s, wire = make(role="prefill", mode="push", tp=2)
    generate(s, "a", prompt(40), leg="prefill")
    run_step(s, wire)
    a_blocks = wire.take("writer")[0].block_ids
    for ch in s.writers:
        deliver(s, ch, m.KVSent("a", 0, nbytes=1, num_descs=1))
    generate(s, "b", prompt(40), leg="prefill")
    (w,) = run_step(s, wire)
    assert w.start_pos == 32
    send = wire.take("writer")
    assert [type(x) for x in send] == [m.SendKV, m.SendKV]
    assert send[0].block_ids[:2] == a_blocks[:2] and send[0].num_tokens == 40
    for ch in s.writers:
        deliver(s, ch, m.KVSent("b", 0, nbytes=1, num_descs=1))
    assert idle(s)


def test_prefill_shared_blocks_stay_while_a_write_reads_them():
    """b hit a's blocks; a finishing (its WRITE done) must not free what b's WRITE still reads."""
    s, wire = make(role="prefill", mode="push", tp=1)
    generate(s, "a", prompt(40), leg="prefill")
    run_step(s, wire)
    generate(s, "b", prompt(40), leg="prefill")
    run_step(s, wire)
    b_blocks = list(s.by_tid["b"].blocks)
    deliver(s, s.writers[0], m.KVSent("a", 0))
    assert all(s.alloc.refs(x) == 1 for x in b_blocks)  # b's WRITE is still out
    deliver(s, s.writers[0], m.KVSent("b", 0))
    assert idle(s)


def test_decode_registers_only_the_uncached_tail():
    """Turn 1's prompt arrived whole; turn 2 (its prompt and answer and more) registers every
    block but tells P the tokens D holds: P WRITEs only the rest."""
    s, wire = make(role="decode", mode="push", tp=1)
    generate(s, "a", prompt(40), leg="decode", max_tokens=20, source=P_SRC)
    (expect,) = wire.take("writer")
    assert (len(expect.block_ids), expect.cached_tokens) == (3, 0)  # the prompt and the next token's slot
    deliver(s, s.writers[0], m.KVReceived("a", 0, 42))
    run_all(s, wire)
    out = [t for x in wire.take("router") for t in x.token_ids]
    assert idle(s) and s.alloc.num_cached == 3  # 40 + 19 tokens with KV: 3 full blocks
    turn2 = prompt(40) + tuple(out) + prompt(10, 200)
    generate(s, "b", turn2, leg="decode", max_tokens=2, source=P_SRC)
    (expect,) = wire.take("writer")
    assert expect.cached_tokens == 48 and expect.num_tokens == len(turn2)
    assert s.by_tid["b"].blocks[:3] == list(expect.block_ids[:3])
    assert all(s.alloc.refs(x) == 1 for x in expect.block_ids)  # held (pinned) by b until it ends
    assert (s.counters["prefix_hits"], s.counters["prefix_hit_tokens"]) == (1, 48)
    deliver(s, s.writers[0], m.KVReceived("b", 0, 42))
    run_all(s, wire)
    assert idle(s)


@pytest.mark.parametrize("d_bs,p_bs,n,want", [
    (16, 16, 40, 32), (16, 32, 40, 32), (16, 32, 70, 64), (16, 32, 60, 32), (32, 16, 70, 64), (16, 48, 100, 96),
    (16, 16, 32, 16),  # the last prompt token always moves
])
def test_decode_hits_are_whole_blocks_of_both_sides(d_bs, p_bs, n, want):
    inst = InstanceConfig(role="decode", engine_id="decode-engine", tp=1, num_blocks=32, block_size=d_bs,
                          worker_endpoints=("w0",), writer_endpoints=("x0",))
    prefill = InstanceConfig(role="prefill", engine_id=P_SRC.engine_id, tp=2, block_size=p_bs,
                             handshake_endpoints=P_SRC.handshake)
    s, wire = wired(DeploymentConfig(mode="push", prefill=prefill, decode=inst), inst)
    for tid in ("a", "b"):
        generate(s, tid, prompt(n), leg="decode", max_tokens=2, source=P_SRC)
        (expect,) = wire.take("writer")
        deliver(s, s.writers[0], m.KVReceived(tid, 0, 42))
        run_all(s, wire)
    assert expect.cached_tokens == want and idle(s)


def test_decode_pull_reads_only_the_uncached_tail():
    s, wire = make(role="decode", mode="pull", tp=1)
    for tid in ("a", "b"):
        pull = m.PullParams(P_SRC, (0, 1, 2), 40, 42, 0.0)
        generate(s, tid, prompt(40), leg="decode", max_tokens=2, pull=pull)
        (read,) = wire.take("writer")
        assert isinstance(read, m.ReadKV) and read.cached_tokens == (0 if tid == "a" else 32)
        deliver(s, s.writers[0], m.KVReceived(tid, 0, 42))
        run_all(s, wire)
    assert idle(s)


def test_decode_window_model_moves_and_keeps_nothing_cached():
    """A window layer moves only the window's blocks: a cached block would lack the rest."""
    inst = InstanceConfig(role="decode", engine_id="decode-engine", tp=1, num_blocks=16,
                          worker_endpoints=("w0",), writer_endpoints=("x0",))
    prefill = InstanceConfig(role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
    from pushkv.config import preset
    s, wire = wired(DeploymentConfig(mode="push", model=preset("hybrid"), prefill=prefill, decode=inst), inst)
    for tid in ("a", "b"):
        generate(s, tid, prompt(40), leg="decode", max_tokens=2, source=P_SRC)
        (expect,) = wire.take("writer")
        assert expect.cached_tokens == 0
        deliver(s, s.writers[0], m.KVReceived(tid, 0, 42))
        run_all(s, wire)
    assert idle(s) and s.alloc.num_cached == 0


def test_hashes_follow_the_token_chain():
    s, wire = make()
    generate(s, "a", prompt(40), max_tokens=20)
    run_all(s, wire)
    out = [t for x in wire.take("router") for t in x.token_ids]
    seq = prompt(40) + tuple(out)
    assert idle(s)
    r_hashes = block_hashes(seq[:59], BS)
    assert len(r_hashes) == 3 and s.alloc.match(r_hashes) and len(s.alloc.match(r_hashes)) == 3


# --------------------------------------------------------------------------- random traffic
FAMILY = [prompt(16 * k + extra, first) for first in (1, 1, 1, 50) for k in range(1, 5) for extra in (0, 5)]


def _written_blocks(w: m.SeqWork, bs: int = BS) -> set[int]:
    """The blocks a step stores K/V into for this sequence."""
    return {w.block_table[p // bs] for p in range(w.start_pos, w.start_pos + len(w.token_ids))}


def _writers_hold(r) -> bool:
    """A transfer the writers still answer for: sending or awaiting the KV, or an aborted
    prefill whose layer-streamed parts the writers may still be reading."""
    return r.state in (State.SENDING, State.AWAIT_KV) or (
        r.state == State.PREFILL and r.streamed and r.aborted and not r.in_step)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("role", ["local", "prefill", "decode"])
def test_random_traffic_never_writes_a_shared_block_and_returns_every_block(role, seed):
    """Shared-prefix prompts arrive, steps succeed or fail, requests are aborted, transfers end
    either way, in random order. After every event the cache's invariants hold; a step, or a
    transfer into D, only ever writes into blocks the request holds alone; at the end every block
    is allocatable again."""
    import random

    rng = random.Random(seed)
    mode = {"local": "local", "prefill": "push", "decode": "push"}[role]
    s, wire = make(role=role, mode=mode, num_blocks=24, tp=1, chunk=rng.choice([0, 16]))
    live: list[str] = []
    n = 0
    for _ in range(150):
        pending = [x for _, x in wire.sent if isinstance(x, m.ExecuteStep)]
        for x in wire.take("writer"):  # D registers: P may write only from cached_tokens on
            if isinstance(x, m.ExpectKV):
                assert all(s.alloc.refs(b) == 1 for b in x.block_ids[x.cached_tokens // BS:]), x
        ev = rng.random()
        if ev < 0.3:
            n += 1
            tid = f"r{n}"
            generate(s, tid, rng.choice(FAMILY), leg=role, max_tokens=rng.randint(1, 20),
                     **({"source": P_SRC} if role == "decode" else {}))
            live.append(tid)
        elif ev < 0.4 and live:
            deliver(s, ROUTER, m.Abort(rng.choice(live), 0, "gone"))
        elif ev < 0.8 and pending:
            step = wire.take("worker")[0]
            for w in step.seqs:
                assert all(s.alloc.refs(b) == 1 for b in _written_blocks(w)), (w, step)
            if rng.random() < 0.1:
                answer = m.StepFailed(step.step_id, "injected")
            else:
                answer = m.StepDone(step.step_id, tuple(rng.randrange(300) for w in step.seqs if w.sample))
            for ch in s.workers:
                deliver(s, ch, answer)
        elif role != "local":  # a writer answers a transfer it holds
            waiting = [r for r in s.reqs.values() if _writers_hold(r)]
            if waiting:
                r = rng.choice(waiting)
                ok = rng.random() < 0.85
                if role == "prefill":
                    msg = m.KVSent(r.transfer_id, 0) if ok else m.KVFailed(r.transfer_id, 0, "x")
                else:
                    msg = m.KVReceived(r.transfer_id, 0, 7) if ok else m.KVFailed(r.transfer_id, 0, "x")
                deliver(s, s.writers[0], msg)
        live = [t for t in live if t in s.by_tid]
        s.alloc.check()
    for _ in range(400):  # drain: every step answered, every transfer ended
        for x in wire.take("writer"):
            if isinstance(x, m.ExpectKV):
                assert all(s.alloc.refs(b) == 1 for b in x.block_ids[x.cached_tokens // BS:]), x
        if any(isinstance(x, m.ExecuteStep) for _, x in wire.sent):
            run_step(s, wire, token=5)
            continue
        waiting = [r for r in s.reqs.values() if _writers_hold(r)]
        if not waiting:
            break
        for r in waiting:
            ok = m.KVSent(r.transfer_id, 0) if role == "prefill" else m.KVReceived(r.transfer_id, 0, 7)
            if r.state == State.PREFILL:  # an aborted stream: the writers answer its CancelKV
                ok = m.KVFailed(r.transfer_id, 0, "cancelled")
            deliver(s, s.writers[0], ok)
    assert idle(s), (s.reqs, s.waiting)
    if n > 3:
        assert s.counters["prefix_queries"] > 0
