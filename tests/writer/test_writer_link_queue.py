"""P's link queue (--link-window) in a real P writer -> D writer pair over real NIXL, this test
acting as both schedulers: many requests at once go one WRITE at a time on the link, each lands
whole, and a cancel amid them ends every request once with nothing left queued or in flight."""
import pytest
import torch

from pushkv import messages as m
from pushkv.kv import layout as L
from tests.support.procs import recv
from tests.writer.test_writer_transfer import _pair, fill

pytestmark = pytest.mark.timeout(180)

BLOCKS = 4  # per request
N = 8  # requests at once


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _pair(tmp_path_factory, num_blocks=2 * N * BLOCKS, link_window=1)


def stats(sock) -> dict:
    sock.send(m.encode(m.GetStats()))
    while True:  # answers to requests may come first: this test counts those itself
        msg = recv(sock, m.DEC_WRITER_TO_SCHED)
        if isinstance(msg, m.WriterStats):
            return msg.counters


def start(cfg, p_sched, d_sched, tid, blocks):
    ntok = len(blocks) * 16
    src = m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)
    d_sched.send(m.encode(m.ExpectKV(tid, 0, tuple(blocks), ntok, src, 30.0)))
    p_sched.send(m.encode(m.SendKV(tid, 0, tuple(blocks), ntok, first_token=7)))


def answers(sock, tids, kinds) -> dict:
    """One answer per transfer id, of the types ``kinds`` (a second one would be a bug, and shows
    as a later test's stray answer)."""
    got: dict = {}
    while len(got) < len(tids):
        msg = recv(sock, m.DEC_WRITER_TO_SCHED)
        if isinstance(msg, m.WriterStats):
            continue
        assert isinstance(msg, kinds), msg
        assert msg.transfer_id in tids and msg.transfer_id not in got, msg
        got[msg.transfer_id] = msg
    return got


def test_many_requests_go_one_at_a_time_and_land_whole(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    tids = [f"q{i}" for i in range(N)]
    for i, tid in enumerate(tids):
        blocks = list(range(i * BLOCKS, (i + 1) * BLOCKS))
        fill(p_pool, blocks, seed=i)
        for b in blocks:
            d_pool.tensor[b].zero_()
    for i, tid in enumerate(tids):  # every registration and prefill half at once: the queue fills
        start(cfg, p_sched, d_sched, tid, range(i * BLOCKS, (i + 1) * BLOCKS))
    sent = answers(p_sched, set(tids), (m.KVSent,))
    got = answers(d_sched, set(tids), (m.KVReceived,))
    assert all(g.first_token == 7 for g in got.values())
    assert all(dict(g.timeline).get("writer_registration_sent", 0) > 0 for g in got.values())  # D's send, stamped
    assert all(s.nbytes == BLOCKS * L.block_bytes(lay) for s in sent.values())
    for b in range(N * BLOCKS):  # P's blocks and D's are the same ids here
        assert torch.equal(p_pool.tensor[b], d_pool.tensor[b]), b
    st = stats(p_sched)
    assert st["link_posts_queued"] == N, st
    assert st["link_inflight_peak"] == 1, st  # the window: one WRITE on the link at a time
    assert (st["link_queued"], st["link_inflight"]) == (0, 0), st
    # D's registrations came on the handshake link, not behind the KV bytes as NIXL notifications
    assert st.get("control_received", 0) >= N and st.get("control_by_notif", 0) == 0, st


def test_cancel_amid_the_queue_ends_every_request_once(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    base = N * BLOCKS
    tids = [f"c{i}" for i in range(N)]
    for i, tid in enumerate(tids):
        start(cfg, p_sched, d_sched, tid, range(base + i * BLOCKS, base + (i + 1) * BLOCKS))
    cancelled = set(tids[N // 2:])
    for tid in sorted(cancelled):  # behind the first half on the link: queued, or already gone
        p_sched.send(m.encode(m.CancelKV(tid, 0, "test cancel")))
    p_got = answers(p_sched, set(tids), (m.KVSent, m.KVFailed))
    d_got = answers(d_sched, set(tids), (m.KVReceived, m.KVFailed))
    for tid in set(tids) - cancelled:
        assert isinstance(p_got[tid], m.KVSent) and isinstance(d_got[tid], m.KVReceived), tid
    for tid in cancelled:  # P and D agree on each
        assert isinstance(p_got[tid], m.KVSent) == isinstance(d_got[tid], m.KVReceived), tid
    st = stats(p_sched)
    ended = sum(isinstance(p_got[t], m.KVFailed) for t in cancelled)
    assert st.get("link_posts_dropped", 0) <= ended, st  # a dropped post fails its request
    assert (st["link_queued"], st["link_inflight"]) == (0, 0), st
    assert st["link_inflight_peak"] == 1, st
