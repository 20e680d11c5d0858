"""The vLLM connector's stamps (``pushkv.trace.stamp``) read back by ``tools/vllm_timing.py``: each event's
offset after its transfer's first one, from lines inside a server's log."""
from __future__ import annotations

import os
import subprocess
import sys

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


def test_a_stamp_is_one_write_call_with_its_newline(tmp_path, monkeypatch):
    """Several processes (vLLM's worker, the writer) stamp into one log: each stamp is one write of its whole line, so
    no other process's stamp lands between its text and its newline."""
    trace.stamps_on.cache_clear()
    monkeypatch.setenv("PUSHKV_VLLM_TIMING", "1")
    writes: list[bytes] = []
    real = os.write
    monkeypatch.setattr(trace.os, "write", lambda fd, b: writes.append(b) or real(fd, b))
    with open(tmp_path / "log", "a") as f:
        monkeypatch.setattr(trace.sys, "stderr", f)
        trace.stamp("p_send_sent", "t1")
        trace.stamp("p_part_posted", "t1")
    trace.stamps_on.cache_clear()
    assert [b.count(b"\n") for b in writes] == [1, 1] and all(b.endswith(b"\n") for b in writes), writes
    assert list(offsets_ms((tmp_path / "log").read_text().splitlines())) == ["p_send_sent", "p_part_posted"]


def test_stamps_of_processes_sharing_a_log_stay_whole_lines(tmp_path):
    """Four processes stamping at once into one log file: every line is one stamp of four fields."""
    code = ("from pushkv import trace\n"
            "for i in range(300):\n"
            "    trace.stamp('p_part_posted', f't{i}')\n")
    env = dict(os.environ, PUSHKV_VLLM_TIMING="1")
    with open(tmp_path / "log", "ab") as log:
        procs = [subprocess.Popen([sys.executable, "-c", code], stderr=log, env=env) for _ in range(4)]
        assert [p.wait(timeout=120) for p in procs] == [0] * 4
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 1200 and all(ln.startswith(trace.STAMP_PREFIX) and len(ln.split()) == 4 for ln in lines)
