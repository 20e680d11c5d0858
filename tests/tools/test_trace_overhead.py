"""experiments/trace_overhead.py's rounds, on stand-in deployments: a run of many rounds says on stderr how far it
got as each round ends (it printed nothing until its table, minutes later), and each round pairs every variant."""
from __future__ import annotations

import io
import random

from experiments import trace_overhead as T


def test_each_round_prints_a_line_of_progress_as_it_ends():
    asked: list = []
    ttfts = {"off": 0.010, "trace": 0.011, "trace+tap": 0.012}

    def ttft(dep, prompt, max_tokens=8):
        asked.append((dep, len(prompt), max_tokens))
        return ttfts[dep]

    progress = io.StringIO()
    seq, burst = T.run_rounds({v: v for v in T.VARIANTS}, 3, random.Random(0), ttft, progress)
    lines = progress.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["round 1/3", "round 2/3", "round 3/3"]
    assert lines[-1].endswith("off 10.00  trace 11.00  trace+tap 12.00")
    assert all(len(seq[(v, n)]) == 3 for v in T.VARIANTS for n in (256, 1024))
    assert all(len(burst[v]) == 3 * 8 and set(burst[v]) == {ttfts[v]} for v in T.VARIANTS)
    assert len(asked) == 3 * len(T.VARIANTS) * (2 + 8)
