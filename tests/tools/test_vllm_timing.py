"""The vLLM connector's stamps (``pushkv.trace.stamp``) read back by ``tools/vllm_timing.py``: each event's
offset after its transfer's first one, from lines inside a server's log."""
from __future__ import annotations

import pytest

from pushkv import trace
from tools.vllm_timing import offsets_ms


def test_offsets_per_event_from_each_transfers_first_stamp():
    lines = ["INFO starting\n",
             "(EngineCore pid=1) pushkv-timing d_arrived t1 100.000\n",
             "pushkv-timing p_write_posted t1 100.020\n",
             "pushkv-timing d_arrived t2 200.000\n",
             "pushkv-timing p_write_posted t2 200.040\n",
             "pushkv-timing p_write_posted t2 300.000\n"]  # a repeat keeps the first
    offs = offsets_ms(lines)
    assert offs["d_arrived"] == [0.0, 0.0]
    assert offs["p_write_posted"] == pytest.approx([20.0, 40.0])


def test_a_stamp_is_a_line_the_reader_takes_and_off_prints_nothing(capsys, monkeypatch):
    trace.stamps_on.cache_clear()
    monkeypatch.setenv("PUSHKV_VLLM_TIMING", "1")
    trace.stamp("d_arrived", "t9")
    err = capsys.readouterr().err
    assert list(offsets_ms(err.splitlines())) == ["d_arrived"]
    trace.stamps_on.cache_clear()
    monkeypatch.setenv("PUSHKV_VLLM_TIMING", "0")
    trace.stamp("d_arrived", "t9")
    assert capsys.readouterr().err == ""
    trace.stamps_on.cache_clear()
