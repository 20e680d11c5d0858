"""Weight loading shows its progress per rank, in GiB and seconds: a bar on a terminal, a log line
otherwise, and the total at the end, which is every byte the rank keeps (``model.footprint``)."""
from __future__ import annotations

import io
import logging

import pytest

from pushkv.config import PRESETS
from pushkv.model.build import build_model
from pushkv.model.footprint import weight_bytes
from pushkv.model.load_progress import GIB, LOG_EVERY_S, MIB, LoadProgress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_terminal_gets_a_bar_that_redraws_in_place():
    out, clock = io.StringIO(), Clock()
    p = LoadProgress("prefill-worker-0", 4 * GIB, out, clock, tty=True)
    clock.t += 2.0
    p(GIB)
    assert out.getvalue() == "\rprefill-worker-0: loading weights [######------------------] 1.00/4.00 GiB (25%) 2.0 s"
    p(GIB)  # within BAR_EVERY_S of the last draw: not redrawn
    assert out.getvalue().count("\r") == 1
    clock.t += 2.0
    p(2 * GIB)
    p.finish()
    assert out.getvalue().endswith("[########################] 4.00/4.00 GiB (100%) 4.0 s\n")


def test_elsewhere_a_log_line_every_few_seconds_and_the_total(caplog):
    caplog.set_level(logging.INFO, logger="pushkv.model.load_progress")
    out, clock = io.StringIO(), Clock()
    p = LoadProgress("decode-worker-1", 2 * GIB, out, clock, tty=False)
    p(GIB // 2)  # at once: too soon for a line
    clock.t += LOG_EVERY_S
    p(GIB // 2)
    clock.t += 5.0
    p(GIB)
    assert p.finish() == "decode-worker-1: weights loaded, 2.00 GiB in 10.0 s (0.20 GiB/s)"
    assert out.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "decode-worker-1: loading weights 1.00/2.00 GiB (50%) 5.0 s",
        "decode-worker-1: loading weights 2.00/2.00 GiB (100%) 10.0 s",
        "decode-worker-1: weights loaded, 2.00 GiB in 10.0 s (0.20 GiB/s)"]


@pytest.mark.parametrize("name", ["tiny", "hybrid", "mla"])
def test_building_a_model_counts_every_byte_it_keeps(caplog, name):
    caplog.set_level(logging.INFO, logger="pushkv.model.load_progress")
    model = PRESETS[name]
    counted = LoadProgress("local-worker-0", weight_bytes(model, 1), io.StringIO(), tty=False)
    build_model(model, progress=counted)
    if not model.is_mla:  # MLA's attention is not dense: its count is the dense estimate
        assert counted.done == weight_bytes(model, 1)
    assert counted.done > 0
    caplog.clear()
    build_model(model, label="local-worker-0")  # the worker's own: its total said at the end
    (done,) = [r.getMessage() for r in caplog.records if "weights loaded" in r.getMessage()]
    assert done.startswith(f"local-worker-0: weights loaded, {counted.done / MIB:.2f} MiB in ")
