"""tools/stream_bench's per-WRITE breakdown read from a request's timeline (pure)."""
from __future__ import annotations

from tools.stream_bench import format_marks, format_writes, marks_of, medians, writes_of

T0 = 100.0  # prefill start (wall seconds)


def _tl(**stamps: float) -> dict:
    return {k.replace("__", "."): T0 + v / 1e3 for k, v in stamps.items()}


def test_each_write_has_its_stamps_after_prefill_start_and_the_group_its_newest_mark_carries():
    tl = _tl(prefill__layers_stored_0=60, prefill__layers_stored_1=130, prefill__layers_stored_2=200,
             prefill__w1_stored=60, prefill__w1_asked=61, prefill__w1_stage_out_start=61,
             prefill__w1_stage_out_issued=61.5, prefill__w1_copy_begun=62, prefill__w1_stage_out_done=70,
             prefill__w1_posted=70.5, prefill__w1_poster_picked=70.6, prefill__w1_poster_returned=100,
             prefill__w1_poster_ended=100.1, prefill__w1_done=110, decode__pw1_landed=111,
             prefill__w2_stored=200, prefill__w2_asked=201, prefill__w2_posted=240, prefill__w2_done=300,
             prefill__w3_asked=690, prefill__w3_done=800)
    w = writes_of(tl, T0)
    assert [x["n"] for x in w] == [1, 2, 3]
    assert w[0] == {"n": 1, "group": 0, "mark": 60.0, "asked": 61.0, "out_start": 61.0, "out_issued": 61.5,
                    "copy_begun": 62.0, "out_done": 70.0, "posted": 70.5, "picked": 70.6, "returned": 100.0,
                    "ended": 100.1, "done": 110.0, "landed": 111.0}
    assert w[1]["group"] == 2 and "out_start" not in w[1]  # carries groups 1-2; not staged
    assert w[2]["group"] == -1 and w[2]["done"] == 800.0  # the last WRITE, asked after every mark came
    text = format_writes(w, 690.0)
    assert len(text.splitlines()) == 4 and text.splitlines()[-1].split()[0] == "last", text


def test_no_write_stamps_no_writes_and_medians_skip_the_lists():
    assert writes_of(_tl(prefill__write_done=5), T0) == []
    rows = [{"ttft_ms": 3.0, "writes": [{"n": 1}], "timeline_ms": {"a": 1.0}}, {"ttft_ms": 1.0, "writes": [],
            "timeline_ms": {}}, {"ttft_ms": 2.0, "writes": [], "timeline_ms": {}}]
    assert medians(rows) == {"ttft_ms": 2.0}


def test_each_marks_worker_side_and_writer_side_in_group_order():
    tl = _tl(prefill__layers_recorded_0=20, prefill__layers_gpu_done_0=59, prefill__layers_synced_0=59.5,
             prefill__layers_stored_0=60, prefill__layers_stored_1=130, prefill__layers_recorded_1=21)
    got = marks_of(tl, T0)
    assert got == [{"group": 0, "recorded": 20.0, "gpu": 59.0, "synced": 59.5, "taken": 60.0},
                   {"group": 1, "recorded": 21.0, "taken": 130.0}]  # a CPU worker: no device time
    assert format_marks(got).splitlines()[2].split() == ["1", "21.0", "-", "-", "130.0"]
