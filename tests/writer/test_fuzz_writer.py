"""Random valid-shaped messages sent straight to a P and a D writer (hypothesis), real
processes and real NIXL: this test is both schedulers and a third writer (its own NIXL
agent, handshaken with both) that sends notifications.

Each message decodes (it went through the wire's encoder and decoder) but its values are
anything: block ids outside the pool or negative, token counts past the blocks, NaN and
infinite deadlines and leases, unknown or stale transfers and generations, ranks and TP
sizes no deployment has, checksums of any shape, sources that name nobody. Checked: both
writers live through it and still answer; no handler raises; and a transfer afterwards
moves its blocks' bytes exactly (the fuzz never names its blocks, as a scheduler never hands
out a block twice).
"""
from __future__ import annotations

import math
import mmap
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, Timeouts, preset
from pushkv.kv import layout as L
from tests.support.procs import children, dealer, leftover_shm, planned
from tests.writer.test_writer_bad_input import FakePeer, Inbox

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NUM_BLOCKS = 64
VICTIM_BLOCKS = (48, 49, 50, 51)  # never named by the fuzz
TIDS = ["a", "b", "c", ""]  # few, so commands and notifications meet the transfers they name
PEER_TIDS = ["x", "y"]  # the fake peer's registrations: never paired with a prefill (it has no pool to WRITE to)

EDGE_INTS = [-1, NUM_BLOCKS, 2**31, -(2**63), 2**63 - 1]
EDGE_FLOATS = [0.0, -1.0, 1e-9, 0.05, 1e300, math.nan, math.inf, -math.inf]
block = st.integers(0, 31) | st.sampled_from(EDGE_INTS)
blocks = st.lists(block, max_size=5).map(tuple)
count = st.integers(0, 80) | st.sampled_from(EDGE_INTS)
rank = st.integers(0, 2) | st.sampled_from(EDGE_INTS)
seconds = st.sampled_from(EDGE_FLOATS) | st.floats(0, 0.5)
tid = st.sampled_from(TIDS)
gen = st.integers(-1, 2)
sums = st.none() | st.builds(m.KVChecksums, count, count, st.lists(count, max_size=4).map(tuple),
                             st.lists(rank, max_size=3).map(tuple),
                             st.binary(max_size=96))


def strategies(cfg: DeploymentConfig):
    real = m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)
    source = st.sampled_from([real, real, m.PrefillSource("nobody", 1, ("ipc:///nonexistent",)),
                              m.PrefillSource(cfg.prefill.engine_id, 3, cfg.prefill.handshake_endpoints),
                              m.PrefillSource(cfg.prefill.engine_id, 1, ())])
    pull = st.builds(m.PullParams, source, blocks, count, count, seconds, sums)
    to_p = st.one_of(
        st.builds(m.SendKV, tid, gen, blocks, count, count, sums),
        st.builds(m.StreamKV, tid, gen, blocks, count),
        st.builds(m.HoldKV, tid, gen, blocks, count, count, seconds, st.booleans()),
        st.builds(m.CancelKV, tid, gen, st.just("fuzz")),
        st.builds(m.PeerLost, st.sampled_from([cfg.decode.engine_id, "nobody"]), st.sampled_from(["decode", "x"]),
                  st.just("fuzz")),
        st.just(m.GetStats()))
    to_d = st.one_of(
        st.builds(m.ExpectKV, tid, gen, blocks, count, source, seconds),
        st.builds(m.ReadKV, tid, gen, blocks, pull, seconds, st.booleans()),
        st.builds(m.CancelKV, tid, gen, st.just("fuzz")),
        st.builds(m.RenewKV, tid, gen, source),
        st.builds(m.PeerLost, st.sampled_from([cfg.prefill.engine_id, "nobody"]), st.sampled_from(["prefill", "x"]),
                  st.just("fuzz")),
        st.just(m.GetStats()))
    peer_to_p = st.one_of(
        st.builds(m.Register, st.sampled_from(PEER_TIDS), gen, st.sampled_from(["fake-fuzz", "nobody"]), rank, rank,
                  blocks, count, seconds, st.booleans()),
        st.builds(m.ReadDone, tid, gen, rank),
        st.builds(m.CancelTransfer, tid, gen, st.just("fuzz")),
        st.builds(m.RenewLease, tid, gen, rank))
    peer_to_d = st.one_of(
        st.builds(m.WriteDone, tid, gen, rank, count, count, count, sums),
        st.builds(m.WriteFailed, tid, gen, rank, st.just("fuzz")),
        st.builds(m.PartWritten, tid, gen, rank, st.lists(st.tuples(count, count, count), max_size=3).map(tuple)),
        st.builds(m.CancelTransfer, tid, gen, st.just("fuzz")))
    return st.lists(st.tuples(st.sampled_from(["p", "d", "peer_p", "peer_d"]), st.data()), min_size=1, max_size=8), \
        {"p": to_p, "d": to_d, "peer_p": peer_to_p, "peer_d": peer_to_d}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = DeploymentConfig(  # unstreamed: one region, so a block's KV is one slice of the pool (checked below)
        mode="push", push_stream="off", model=preset("tiny"), timeouts=Timeouts(registration_wait_s=0.5, write_wait_s=1.0, transfer_s=1.0,
                                                             lease_s=1.0, lease_max_s=2.0),
        prefill=InstanceConfig(role="prefill", num_blocks=NUM_BLOCKS, block_size=16),
        decode=InstanceConfig(role="decode", num_blocks=NUM_BLOCKS, block_size=16),
    )
    cfg = planned(cfg, tmp_path_factory.mktemp("fuzzw"))
    with children(cfg, [("writer", "prefill", 0), ("writer", "decode", 0)]) as procs:
        p, d = Inbox(dealer(cfg.prefill.writer_endpoints[0])), Inbox(dealer(cfg.decode.writer_endpoints[0]))
        fake = FakePeer("fake-fuzz", cfg, "decode")
        remotes = {}
        for where, ep in (("peer_p", cfg.prefill.handshake_endpoints[0]), ("peer_d", cfg.decode.handshake_endpoints[0])):
            fake.handshake(ep)
            remotes[where] = fake.remote
        yield cfg, procs, p, d, fake, remotes
        p.sock.close(0)
        d.sock.close(0)
    assert leftover_shm(cfg.deployment_id) == []


def _pool(ready: m.Ready) -> np.ndarray:
    fd = os.open(ready.pool.name, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, ready.pool.nbytes)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def test_fuzzed_writers_survive_and_still_move_bytes_exactly(pair):
    cfg, procs, p, d, fake, remotes = pair
    plan, kinds = strategies(cfg)
    sent = {"n": 0}

    @FUZZ
    @given(plan)
    def run(batch):
        for where, data in batch:
            msg = data.draw(kinds[where])
            if where == "p":
                p.sock.send(m.encode(msg))
            elif where == "d":
                d.sock.send(m.encode(msg))
            else:
                fake.remote = remotes[where]
                fake.notify(m.encode(msg))
            sent["n"] += 1
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} died"

    run()
    # every deadline the fuzz set (at most ~2 s here) passes: the writers act on them, still alive
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} died"
        p.counters(), d.counters()
        fake.agent.poll_notifs()
    cp, cd = p.counters(), d.counters()
    print(f"\nfuzz: {sent['n']} messages; P counters {cp}\nD counters {cd}")
    assert cp.get("handler_error", 0) == 0 and cd.get("handler_error", 0) == 0, (cp, cd)

    # a transfer after the fuzz moves its bytes exactly
    pp, dp = _pool(procs.ready["prefill-writer-0"]), _pool(procs.ready["decode-writer-0"])
    lay = L.layout_for(cfg.model, 1, 0, NUM_BLOCKS, 16)
    bb = L.block_bytes(lay)
    span = slice(VICTIM_BLOCKS[0] * bb, (VICTIM_BLOCKS[-1] + 1) * bb)
    pp[span] = np.random.default_rng(0).integers(0, 256, span.stop - span.start, dtype=np.uint8)
    dp[span] = 0
    d.sock.send(m.encode(m.ExpectKV("victim", 0, VICTIM_BLOCKS, 60, cfg.prefill.source(), 30.0)))
    p.sock.send(m.encode(m.SendKV("victim", 0, VICTIM_BLOCKS, 60, first_token=7)))
    p.take(lambda x: isinstance(x, (m.KVSent, m.KVFailed)) and x.transfer_id == "victim")
    got = d.take(lambda x: isinstance(x, (m.KVReceived, m.KVFailed)) and x.transfer_id == "victim")
    assert isinstance(got, m.KVReceived), got
    assert np.array_equal(pp[span], dp[span])
