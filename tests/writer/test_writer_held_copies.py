"""P's staged last WRITEs waiting for their copies, in a real P writer -> D writer pair over real
NIXL on the CPU, this test acting as both schedulers: ``--staging pushkv``, one WRITE on the link at
a time, unstreamed push (every WRITE a last WRITE), and each copy into P's staging area reported
running for a while after its issue (the fault ``hold-<process>-stage_out``), as a GPU's copy stream
makes it. Several requests' last WRITEs then keep a room on the link at once. On the H200 two of
them once waited for each other's room forever, and every transfer on the link failed at its
deadline; here every request lands whole, in time, and nothing is left kept, queued or in flight."""
import pytest
import torch

from pushkv import faults
from pushkv import messages as m
from pushkv.kv import layout as L
from tests.writer.test_writer_link_queue import answers, start, stats
from tests.writer.test_writer_transfer import _pair, fill

pytestmark = pytest.mark.timeout(180)

BLOCKS = 2  # per request
N = 6  # requests at once
HOLD_S = 0.3  # each copy's time "on the copy stream": every request's copy overlaps the others'


@pytest.fixture
def pair(tmp_path_factory, monkeypatch):
    fdir = tmp_path_factory.mktemp("faults")
    faults.arm_copy_hold(str(fdir), "prefill-writer-0", HOLD_S)
    monkeypatch.setenv("PUSHKV_FAULTS_DIR", str(fdir))  # (the writers inherit it)
    yield from _pair(tmp_path_factory, num_blocks=N * BLOCKS, link_window=1, staging="pushkv", staging_mib=1)


def test_last_writes_copied_at_once_each_take_the_link_in_turn(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, lay = pair
    tids = [f"h{i}" for i in range(N)]
    for i in range(N):
        blocks = list(range(i * BLOCKS, (i + 1) * BLOCKS))
        fill(p_pool, blocks, seed=100 + i)
        for b in blocks:
            d_pool.tensor[b].zero_()
    for i, tid in enumerate(tids):  # every registration and prefill end at once: the copies overlap
        start(cfg, p_sched, d_sched, tid, range(i * BLOCKS, (i + 1) * BLOCKS))
    sent = answers(p_sched, set(tids), (m.KVSent, m.KVFailed))
    got = answers(d_sched, set(tids), (m.KVReceived, m.KVFailed))
    assert all(isinstance(s, m.KVSent) for s in sent.values()), sent
    assert all(isinstance(g, m.KVReceived) for g in got.values()), got
    assert all(s.nbytes == BLOCKS * L.block_bytes(lay) for s in sent.values())
    for b in range(N * BLOCKS):
        assert torch.equal(p_pool.tensor[b], d_pool.tensor[b]), b
    for s in sent.values():  # each WRITE went only once its copy was seen done, HOLD_S after its issue
        tl = dict(s.timeline)
        assert tl["w1_stage_out_done"] - tl["w1_stage_out_issued"] >= HOLD_S * 0.9, tl
    st = stats(p_sched)
    assert st["stage_out_pending"] >= N, st  # every WRITE waited for its copy (the fault took)
    assert st["link_inflight_peak"] == 1, st  # the window: one WRITE on the link at a time
    assert (st["link_queued"], st["link_inflight"]) == (0, 0), st
