"""P writer -> D writer over real NIXL, with this test acting as both schedulers.

Checks the KV bytes directly: after the push, D's blocks equal P's.
"""
import time

import pytest
import torch

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.kv import layout as L
from pushkv.kv.pool import attach_pool
from tests.support.procs import children, dealer, leftover_shm, planned, recv

pytestmark = pytest.mark.timeout(180)


def wait_counter(sock, name: str, at_least: int, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        sock.send(m.encode(m.GetStats()))
        st = recv(sock, m.DEC_WRITER_TO_SCHED)
        if st.counters.get(name, 0) >= at_least:
            return
    raise TimeoutError(f"counter {name} never reached {at_least}")


def pool_of(cfg, role, kids):
    inst = cfg.instance(role)
    lay = L.layout_for(cfg.model, inst.tp, 0, inst.num_blocks, inst.block_size)
    return attach_pool(kids.ready[f"{role}-writer-0"].pool, lay), lay


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _pair(tmp_path_factory)


def _pair(tmp_path_factory, num_blocks: int = 64, prefill_chunk: int = 0, **extra):
    """A P and a D writer process over tiny-model pools: (cfg, P and D scheduler sockets, pools, P layout).
    ``extra``: more DeploymentConfig fields (a link window, say); ``prefill_chunk``: P's (chunk streaming)."""
    cfg = DeploymentConfig(
        # one region: blocks are 6-d pool slices
        model=preset("tiny"), **{"mode": "push", "push_stream": "off", **extra},
        prefill=InstanceConfig(role="prefill", num_blocks=num_blocks, block_size=16, prefill_chunk=prefill_chunk),
        decode=InstanceConfig(role="decode", num_blocks=num_blocks, block_size=16),
    )
    cfg = planned(cfg, tmp_path_factory.mktemp("wt"))
    with children(cfg, [("writer", "prefill", 0), ("writer", "decode", 0)]) as kids:
        p_sched, d_sched = dealer(cfg.prefill.writer_endpoints[0]), dealer(cfg.decode.writer_endpoints[0])
        p_pool, p_lay = pool_of(cfg, "prefill", kids)
        d_pool, _ = pool_of(cfg, "decode", kids)
        yield cfg, p_sched, d_sched, p_pool, d_pool, p_lay
        p_pool.close()
        d_pool.close()
        p_sched.close(0)
        d_sched.close(0)
    assert leftover_shm(cfg.deployment_id) == []


def fill(pool, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        pool.tensor[b].copy_(torch.randn(pool.tensor[b].shape, generator=g))


CASES = [
    # (name, order, P blocks, D blocks, tokens)
    ("one-token", "registration_first", [0], [5], 1),
    ("one-block", "prefill_first", [1], [9], 16),
    ("many-contiguous", "registration_first", list(range(10, 20)), list(range(30, 40)), 160),
    ("fragmented", "prefill_first", [21, 23, 22, 40, 41], [50, 2, 3, 4, 60], 77),
]


@pytest.mark.parametrize("name,order,p_blocks,d_blocks,ntok", CASES, ids=[c[0] for c in CASES])
def test_push_moves_exact_bytes(pair, name, order, p_blocks, d_blocks, ntok):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    tid = f"t-{name}"
    fill(p_pool, p_blocks, seed=len(name))
    for b in d_blocks:
        d_pool.tensor[b].zero_()
    expect = m.ExpectKV(tid, 0, tuple(d_blocks), ntok, m.PrefillSource(cfg.prefill.engine_id, 1,
                        cfg.prefill.handshake_endpoints), 30.0)
    send = m.SendKV(tid, 0, tuple(p_blocks), ntok, first_token=42)
    p_sched.send(m.encode(m.GetStats()))
    before = recv(p_sched, m.DEC_WRITER_TO_SCHED).counters
    if order == "registration_first":
        d_sched.send(m.encode(expect))
        wait_counter(p_sched, "registrations_received", before.get("registrations_received", 0) + 1)
        p_sched.send(m.encode(send))
    else:
        p_sched.send(m.encode(send))
        wait_counter(p_sched, "prefill_done_received", before.get("prefill_done_received", 0) + 1)
        d_sched.send(m.encode(expect))
    got_d = recv(d_sched, m.DEC_WRITER_TO_SCHED)
    got_p = recv(p_sched, m.DEC_WRITER_TO_SCHED)
    assert isinstance(got_d, m.KVReceived), got_d
    assert isinstance(got_p, m.KVSent), got_p
    assert got_d.first_token == 42
    assert got_p.rendezvous == order
    # D holds exactly P's KV for every token that was moved (whole blocks here)
    for pb, db in zip(p_blocks, d_blocks):
        assert torch.equal(p_pool.tensor[pb], d_pool.tensor[db]), (pb, db)
    # contiguous blocks were merged into one descriptor
    if name == "many-contiguous":
        assert got_p.num_descs == 1
    assert got_p.nbytes == len(p_blocks) * L.block_bytes(lay)


def test_unknown_completion_and_garbage_are_counted(pair):
    cfg, p_sched, d_sched, *_ = pair
    p_sched.send(b"\x00garbage")
    wait_counter(p_sched, "bad_frame", 1)
    # the writer still works afterwards
    p_sched.send(m.encode(m.GetStats()))
    assert isinstance(recv(p_sched, m.DEC_WRITER_TO_SCHED), m.WriterStats)


def test_planned_pools_post_by_index(pair):
    """Every WRITE above went through the prepared descriptor lists (whole blocks on both grids:
    none needed the descriptors built per transfer)."""
    cfg, p_sched, *_ = pair
    p_sched.send(m.encode(m.GetStats()))
    st = recv(p_sched, m.DEC_WRITER_TO_SCHED).counters
    assert st.get("posts_prepped", 0) >= len(CASES), st
    assert st.get("posts_adhoc", 0) == 0, st
