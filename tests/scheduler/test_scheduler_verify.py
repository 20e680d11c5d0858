"""--kv-verify in the schedulers, driven by plain calls (no sockets): P asks for the KV's
checksums in the step that stores the prompt's last tokens and hands them on (SendKV, or
PullParams in pull); D sends P's first token on (it does not depend on the moved KV) and asks its
workers to verify before the first decode step, and a mismatch, an abort meanwhile or checksums
that cannot be checked each end with every block free."""
from __future__ import annotations

import msgspec

from pushkv import messages as m
from pushkv.config import DeploymentConfig
from pushkv.kv import checksum
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, all_free, deliver, generate, make, step_done, wired

PROMPT = tuple(range(1, 41))  # 40 tokens: 3 blocks of 16


def verifying(role: str, mode: str = "push", **kw):
    s, _ = make(role, mode=mode, **kw)
    # one layer group: the sums below are a row per head (layer streaming would cut the pool in more)
    cfg = msgspec.structs.replace(s.cfg, kv_verify="sample", push_stream="off")
    return wired(cfg, s.inst)


def sums(heads=(0, 1), units=(0, 1, 2), value=5) -> m.KVChecksums:
    return m.KVChecksums(16, len(PROMPT), units, heads, checksum.pack([(value,) * len(units) for _ in heads]))


def test_prefill_asks_the_last_chunk_for_checksums_and_sends_them_merged():
    s, wire = verifying("prefill")
    s.inst = msgspec.structs.replace(s.inst, prefill_chunk=16)
    generate(s, "t1", "prefill", prompt=PROMPT)
    asked = []
    while s.reqs["t1", 0].state.value == "prefill":
        steps = wire.take("worker")
        seq = steps[0].seqs[0]
        asked.append(seq.checksum)
        done = seq.start_pos + len(seq.token_ids) == len(PROMPT)
        for r, ch in enumerate(s.workers):  # each rank sums its own heads
            got = (sums(heads=(r,)),) if seq.checksum else ()
            deliver(s, ch, m.StepDone(steps[0].step_id, (9,) if done else (), checksums=got))
    assert asked == ["", "", "sample"]
    send = wire.take("writer")
    assert [type(x) for x in send] == [m.SendKV, m.SendKV]
    assert send[0].checksums == sums()


def test_prefill_pull_relays_checksums():
    s, wire = verifying("prefill", mode="pull")
    generate(s, "t1", "prefill", prompt=PROMPT)
    steps = wire.take("worker")
    assert steps[0].seqs[0].checksum == "sample"
    for r, ch in enumerate(s.workers):
        deliver(s, ch, m.StepDone(steps[0].step_id, (9,), checksums=(sums(heads=(r,)),)))
    done = [x for x in wire.take("router") if isinstance(x, m.PrefillFinished)]
    assert done[0].pull.checksums == sums()


def test_prefill_without_verify_asks_nothing():
    assert DeploymentConfig().kv_verify == "sample"  # the default; off must be asked for
    s, _ = make("prefill")
    s, wire = wired(msgspec.structs.replace(s.cfg, kv_verify="off"), s.inst)
    generate(s, "t1", "prefill", prompt=PROMPT)
    assert wire.take("worker")[0].seqs[0].checksum == ""


def _arrived(s, wire, tid="t1", checksums=None, first=42, max_tokens=2):
    generate(s, tid, "decode", prompt=PROMPT, source=P_SRC, max_tokens=max_tokens)
    wire.take("writer")
    for ch in s.writers:
        deliver(s, ch, m.KVReceived(tid, 0, first, checksums=checksums))


def test_decode_sends_ps_token_at_once_and_verifies_before_the_first_step():
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=sums())
    out = wire.take("router")  # P's token: computed from P's own KV, out before the check
    assert [x.token_ids for x in out] == [(42,)] and not out[0].finished
    assert "first_token" in s.reqs["t1", 0].timeline
    cmds = wire.take("worker")
    assert [type(x) for x in cmds] == [m.VerifyKV, m.VerifyKV] and cmds[0].checksums == sums()
    assert cmds[0].block_ids == tuple(s.reqs["t1", 0].blocks)
    assert s.reqs["t1", 0].indexed == 0  # unchecked KV is not offered to the prefix cache
    deliver(s, s.workers[0], m.KVVerified("t1", 0, "", 3))
    assert wire.take("router") == [] and wire.take("worker") == []  # no decode step before every verdict
    deliver(s, s.workers[1], m.KVVerified("t1", 0, "", 3))
    assert s.counters["kv_verified"] == 1 and s.counters["kv_verify_sums"] == 6
    step = step_done(s, wire, (7,))
    assert step.seqs[0].token_ids == (42,)
    out = wire.take("router")
    assert [x.token_ids for x in out] == [(7,)] and out[-1].finished
    assert all_free(s)


def test_decode_first_token_that_ends_the_request_waits_for_the_verdict():
    """A token that finishes the request would free and index its blocks: it goes out once checked."""
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=sums(), max_tokens=1)
    assert wire.take("router") == []
    assert [type(x) for x in wire.take("worker")] == [m.VerifyKV, m.VerifyKV]
    for ch in s.workers:
        deliver(s, ch, m.KVVerified("t1", 0, "", 3))
    out = wire.take("router")
    assert [x.token_ids for x in out] == [(42,)] and out[0].finished
    assert all_free(s)


def test_decode_mismatch_fails_the_request_and_frees_its_blocks():
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=sums())
    wire.take("worker")
    deliver(s, s.workers[0], m.KVVerified("t1", 0, "KV checksum mismatch: tokens 0..15 (unit 0)", 1))
    deliver(s, s.workers[1], m.KVVerified("t1", 0, "", 3))
    out = wire.take("router")  # P's token, then the failure: no token decoded from the KV
    assert [type(x) for x in out] == [m.TokensGenerated, m.RequestFailed]
    assert out[1].status == 502 and "KV verification failed: KV checksum mismatch" in out[1].reason
    assert wire.take("worker") == []
    assert s.counters["kv_verify_failed"] == 1
    assert all_free(s)


def test_decode_abort_while_verifying_holds_the_blocks_until_every_worker_has_checked_them():
    """The workers still read the blocks: freed at the abort, they could take another request's WRITE first, and the
    check would report a mismatch that is not there (seen: a client leaving during the check)."""
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=sums())
    assert [type(x) for x in wire.take("router")] == [m.TokensGenerated]
    assert [type(x) for x in wire.take("worker")] == [m.VerifyKV, m.VerifyKV]
    free = s.alloc.num_free
    deliver(s, ROUTER, m.Abort("t1", 0))
    assert s.alloc.num_free == free and not all_free(s) and wire.take("writer") == []
    deliver(s, s.workers[0], m.KVVerified("t1", 0, "", 3))
    assert s.alloc.num_free == free
    deliver(s, s.workers[1], m.KVVerified("t1", 0, "", 3))
    assert all_free(s) and wire.take("router") == [] and wire.take("worker") == []
    assert s.counters["verify_answer_after_abort"] == 1 and s.counters["kv_verified"] == 0
    deliver(s, s.workers[0], m.KVVerified("t1", 0, "", 3))  # a duplicate: the request is gone
    assert s.counters["stale_verify_answer"] == 1


def test_decode_verification_past_the_step_deadline_fails_and_frees_when_the_workers_answer():
    """A hung worker never answers the check: the request fails (503) after a step's deadline, as a step would; its
    blocks wait for the workers."""
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=sums())
    wire.take("router")
    wire.take("worker")
    free = s.alloc.num_free
    s.tick(s.now + s.cfg.timeouts.step_s / 2, 0.0)
    assert wire.take("router") == []
    s.tick(s.now + s.cfg.timeouts.step_s + 1, 0.0)
    (failed,) = wire.take("router")
    assert isinstance(failed, m.RequestFailed) and failed.status == 503 and "KV verification exceeded" in failed.reason
    s.tick(s.now + 1, 0.0)  # failed once
    assert wire.take("router") == [] and s.counters["kv_verify_timeout"] == 1 and s.alloc.num_free == free
    deliver(s, ROUTER, m.Abort("t1", 0))  # the router ends its legs
    for ch in s.workers:
        deliver(s, ch, m.KVVerified("t1", 0, "", 3))
    assert all_free(s) and wire.take("router") == [] and wire.take("worker") == []


def test_decode_pull_takes_the_relayed_checksums():
    s, wire = verifying("decode", mode="pull")
    pull = m.PullParams(P_SRC, (0, 1, 2), len(PROMPT), 42, 0.0, sums())
    generate(s, "t1", "decode", prompt=PROMPT, pull=pull)
    wire.take("writer")
    for ch in s.writers:
        deliver(s, ch, m.KVReceived("t1", 0, 42))
    cmds = wire.take("worker")
    assert [type(x) for x in cmds] == [m.VerifyKV, m.VerifyKV] and cmds[0].checksums == sums()


def test_decode_without_checksums_is_counted_and_served():
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=None)
    assert [x.token_ids for x in wire.take("router")] == [(42,)]
    assert s.counters["kv_verify_skipped"] == 1


def test_decode_checksums_that_cannot_be_checked_fail_the_request():
    s, wire = verifying("decode")
    _arrived(s, wire, checksums=msgspec.structs.replace(sums(), num_tokens=7))
    out = wire.take("router")
    assert [type(x) for x in out] == [m.RequestFailed] and "cover 7 tokens" in out[0].reason
    assert wire.take("worker") == [] and all_free(s)


def test_config_refuses_an_unknown_mode():
    import pytest

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kv_verify": "most"}, DeploymentConfig)


def test_decode_drops_a_writers_answer_of_the_other_role():
    """A KVSent (P's answer) from a D writer never ends D's wait for the KV: it had crashed the
    scheduler (no KVReceived, so no first token; found by tests/scheduler/test_fuzz_scheduler.py). It is
    counted and dropped; the real answers then complete the request."""
    s, wire = verifying("decode")
    generate(s, "t1", "decode", prompt=PROMPT, source=P_SRC)
    wire.take("writer")
    for ch in s.writers:
        deliver(s, ch, m.KVSent("t1", 0, -1, -1, 0.0))
    assert s.counters["wrong_writer_answer"] == len(s.writers) and wire.take("router") == []
    for ch in s.writers:
        deliver(s, ch, m.KVReceived("t1", 0, 42, checksums=sums()))
    for ch in s.workers:
        deliver(s, ch, m.KVVerified("t1", 0, "", 3))
    assert [x.token_ids for x in wire.take("router")] == [(42,)]
