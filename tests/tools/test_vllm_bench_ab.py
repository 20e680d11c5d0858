"""The vLLM bench's A/B report (``pushkv vllm-bench --ab REV``) on made-up rounds: the ratios it
prints, and the exit status that makes a change costing D's TPOT show."""
from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from tools import vllm_bench as vb

CELL = (2.0, 400)


def req(ttft_s: float, tpot_s: float, wrong: bool = False) -> dict:
    return {"ok": True, "ttft": ttft_s, "tpot": tpot_s, "tokens": [1, 2], "error": "", "wrong": wrong}


def rounds(ttft_s: float, tpot_s: float, n: int = 3) -> list[list[dict]]:
    return [[req(ttft_s, tpot_s) for _ in range(4)] for _ in range(n)]


def report(tmp_path, new_itl_ms: float, old_itl_ms: float, max_ratio: float) -> tuple[int, dict]:
    """Both systems' rounds: the client saw the same; D's engine stamped ``*_itl_ms`` per token."""
    args = argparse.Namespace(rounds=3, out=str(tmp_path / "ab.json"), max_tpot_ratio=max_ratio)
    labels = ["pushkv", "pushkv@abc1234"]
    results = {(CELL, "pushkv"): rounds(0.05, 0.004), (CELL, "pushkv@abc1234"): rounds(0.05, 0.002)}
    cpu = [{"api": 0.1, "engine": 5.0, "writer": 0.1}] * 2
    cpus = {(CELL, lab): [cpu] * 3 for lab in labels}
    itls = {(CELL, "pushkv"): [(new_itl_ms / 1e3 * 300, 300)] * 3,
            (CELL, "pushkv@abc1234"): [(old_itl_ms / 1e3 * 300, 300)] * 3}
    rc = vb.ab_report(args, [CELL], labels, results, cpus, itls)
    with open(args.out) as f:
        return rc, json.load(f)


@pytest.mark.parametrize("new_ms, old_ms, max_ratio, rc", [
    (3.0, 3.0, 1.2, 0),  # the same D steps: passes
    (6.0, 3.0, 1.2, 1),  # D's steps twice as slow: the run fails
    (6.0, 3.0, 0.0, 0),  # no limit asked: only printed
])
def test_ab_report_ratios_and_exit(tmp_path, capsys, new_ms, old_ms, max_ratio, rc):
    got, out = report(tmp_path, new_ms, old_ms, max_ratio)
    cell = out["cells"]["qps=2.0 words=400"]
    assert got == rc
    assert cell["d_engine_tpot_ratio"] == pytest.approx(new_ms / old_ms)
    assert cell["tpot_ratio"] == pytest.approx(2.0)  # the client's medians: 4 ms against 2 ms
    assert cell["pushkv"]["d_engine_tpot_rounds_ms"] == pytest.approx([new_ms] * 3)
    assert cell["pushkv"]["cpu_s"]["D_writer"] == pytest.approx(0.3)
    assert f"D's engine TPOT x{new_ms / old_ms:.2f}" in capsys.readouterr().out


def test_checkout_extracts_the_package_of_a_revision(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    code, short = vb.checkout("HEAD", str(tmp_path))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert short == head and (tmp_path / f"code-{short}" / "pushkv" / "vllm" / "writer.py").is_file()
    assert code == str(tmp_path / f"code-{short}")
