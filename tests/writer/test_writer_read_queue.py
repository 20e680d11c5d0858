"""D's READ queue (pull, background, --link-window) in a real P writer -> D writer pair over real NIXL,
this test acting as both schedulers: many READs from one P at once go one at a time on its link, each
lands whole, and a cancel amid them ends every request once on both sides, nothing left queued."""
import time

import pytest
import torch

from pushkv import messages as m
from pushkv.kv import layout as L
from tests.writer.test_writer_link_queue import answers, stats
from tests.writer.test_writer_transfer import _pair, fill

pytestmark = pytest.mark.timeout(180)

BLOCKS = 4  # per request
N = 8  # requests at once


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _pair(tmp_path_factory, num_blocks=2 * N * BLOCKS, mode="pull", pull_read="background",
                     link_window=1)


def hold_and_read(cfg, p_sched, d_sched, tid, blocks):
    ntok = len(blocks) * 16
    p_sched.send(m.encode(m.HoldKV(tid, 0, tuple(blocks), ntok, first_token=7, lease_s=30.0)))
    src = m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)
    pull = m.PullParams(src, tuple(blocks), ntok, 7, time.monotonic() + 30.0)
    d_sched.send(m.encode(m.ReadKV(tid, 0, tuple(blocks), pull, 30.0)))


def test_many_reads_go_one_at_a_time_and_land_whole(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    tids = [f"r{i}" for i in range(N)]
    for i in range(N):
        blocks = list(range(i * BLOCKS, (i + 1) * BLOCKS))
        fill(p_pool, blocks, seed=i)
        for b in blocks:
            d_pool.tensor[b].zero_()
    for i, tid in enumerate(tids):  # every lease and READ at once: D's link queue fills
        hold_and_read(cfg, p_sched, d_sched, tid, range(i * BLOCKS, (i + 1) * BLOCKS))
    got = answers(d_sched, set(tids), (m.KVReceived,))
    sent = answers(p_sched, set(tids), (m.KVSent,))  # P freed each lease on D's ReadDone
    assert all(g.first_token == 7 and g.nbytes == BLOCKS * L.block_bytes(lay) for g in got.values())
    assert all(s.rendezvous == "pull" for s in sent.values()), sent
    for b in range(N * BLOCKS):  # P's blocks and D's are the same ids here
        assert torch.equal(p_pool.tensor[b], d_pool.tensor[b]), b
    # each READ's posting came after the one before it ended (its timeline's read_posted)
    posted = sorted((dict(g.timeline)["read_posted"], dict(g.timeline)["read_done"]) for g in got.values())
    assert all(a[1] <= b[0] for a, b in zip(posted, posted[1:])), posted
    st = stats(d_sched)
    assert st["read_posts_queued"] == N, st
    assert st.get("read_posts_waited", 0) >= 1, st  # offered while one was on the link: it waited its turn
    assert st["link_inflight_peak"] == 1, st  # the window: one READ on P's link at a time
    assert (st["link_queued"], st["link_inflight"]) == (0, 0), st


def test_cancel_amid_the_queued_reads_ends_every_request_once(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    base = N * BLOCKS
    tids = [f"c{i}" for i in range(N)]
    for i, tid in enumerate(tids):
        hold_and_read(cfg, p_sched, d_sched, tid, range(base + i * BLOCKS, base + (i + 1) * BLOCKS))
    cancelled = set(tids[N // 2:])
    for tid in sorted(cancelled):  # behind the first half on P's link: queued, or already read
        d_sched.send(m.encode(m.CancelKV(tid, 0, "test cancel")))
    d_got = answers(d_sched, set(tids), (m.KVReceived, m.KVFailed))
    for tid in set(tids) - cancelled:
        assert isinstance(d_got[tid], m.KVReceived), tid
    failed = {t for t in cancelled if isinstance(d_got[t], m.KVFailed)}
    # P frees every lease once and agrees with D: on D's ReadDone (read), or on its CancelTransfer (a
    # queued READ dropped, or one cancelled while it ran, answered when it ended)
    p_got = answers(p_sched, set(tids), (m.KVSent, m.KVFailed))
    for tid in tids:
        assert isinstance(p_got[tid], m.KVSent) == (tid not in failed), (tid, p_got[tid])
    st = stats(d_sched)
    # the last cancelled READs were still queued (D moves one at a time): dropped, never posted
    assert st.get("read_posts_dropped", 0) >= 1, st
    assert st.get("read_posts_dropped", 0) + st.get("read_cancel_deferred", 0) == len(failed), st
    assert (st["link_queued"], st["link_inflight"]) == (0, 0), st
    assert st["link_inflight_peak"] == 1, st
