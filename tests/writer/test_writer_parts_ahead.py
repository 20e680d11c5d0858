"""Two streamed parts of one transfer asked at once (``rendezvous.PARTS_AHEAD``) in a real P writer
-> D writer pair over real NIXL, this test acting as both schedulers, with P's link queue (one post
on the link at a time) and ``--staging pushkv``: each part takes its own staging cells and is copied
out when asked, waits its turn on the link, and the last WRITE follows both; D holds exactly P's KV
and each WRITE's stamps run in order. (Whether the first part is still on the wire when the second
is asked is up to the machine's timing here; on an idle one it is: part 2 asked at 1.3 ms, copied
out by 1.6, posted at 2.9 as part 1's handle ended.)"""
import pytest

from pushkv import messages as m
from tests.support.procs import recv
from tests.writer.test_writer_link_queue import answers, stats
from tests.writer.test_writer_transfer import _pair, fill, wait_counter

pytestmark = pytest.mark.timeout(180)

BS = 16  # tokens a block, both sides


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _pair(tmp_path_factory, num_blocks=16, link_window=1, push_stream="chunk", prefill_chunk=BS,
                     staging="pushkv", staging_mib=1)


def test_two_parts_ahead_then_the_last_write(pair):
    cfg, p_sched, d_sched, p_pool, d_pool, _ = pair
    blocks = (3, 4, 5, 6)
    fill(p_pool, blocks, seed=5)
    for b in blocks:
        d_pool.tensor[b].zero_()
    before = stats(p_sched)
    src = m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)
    d_sched.send(m.encode(m.ExpectKV("t", 0, blocks, 4 * BS, src, 30.0)))
    wait_counter(p_sched, "registrations_received", before.get("registrations_received", 0) + 1)
    for n in (1, 2):  # two chunks end back to back: a part each, the second asked while the first may fly
        p_sched.send(m.encode(m.StreamKV("t", 0, blocks, n * BS)))
    wait_counter(p_sched, "part_posts", before.get("part_posts", 0) + 2)  # (a prefill half overtaking the
    p_sched.send(m.encode(m.SendKV("t", 0, blocks, 4 * BS, first_token=9)))  # chunks would leave no part)
    assert isinstance(recv(d_sched, m.DEC_WRITER_TO_SCHED), m.KVReceived)
    sent = answers(p_sched, {"t"}, m.KVSent)["t"]
    # a prefill half that comes while a part still flies sends its remaining whole unit as one
    # more part at once (the last WRITE then carries the final unit); one that comes after both
    # landed leaves it all to the last WRITE
    assert sent.parts in (2, 3), sent
    for b in blocks:
        assert (d_pool.tensor[b] == p_pool.tensor[b]).all(), b
    tl = dict(sent.timeline)
    writes = sent.parts + 1
    for n in range(1, writes + 1):  # each WRITE: asked, its copy out issued and seen done, posted, done
        seq = [tl[f"w{n}_{s}"] for s in ("asked", "stage_out_start", "stage_out_issued", "stage_out_done",
                                         "posted", "done")]
        assert seq == sorted(seq), (n, tl)
    assert tl[f"w{writes}_asked"] >= max(tl[f"w{n}_done"] for n in range(1, writes)), tl  # the last after every part
    after = stats(p_sched)
    for k, n in (("part_posts", sent.parts), ("write_posts", 1), ("link_posts_queued", writes),
                 ("stage_out_copies", writes)):
        assert after.get(k, 0) - before.get(k, 0) == n, (k, after)
    assert after["link_inflight_peak"] == 1 and after["link_queued"] == 0 and after["link_inflight"] == 0, after
