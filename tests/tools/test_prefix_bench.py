"""tools/prefix_bench.py's table: medians per (mode, cache, turn) and the off/on TTFT ratio."""
from tools.prefix_bench import table


def row(mode, cache, turn, ttft, hit=0, kv=0):
    return {"mode": mode, "cache": cache, "conversation": 0, "turn": turn, "prompt_tokens": 100,
            "ttft_ms": ttft, "hit_tokens": hit, "kv_bytes": kv}


def test_table_medians_and_ratio():
    rows = [row("push", False, 2, t, kv=4e6) for t in (300.0, 310.0, 900.0)]
    rows += [row("push", True, 2, t, hit=96, kv=3e5) for t in (30.0, 31.0, 20.0)]
    lines = table(rows).splitlines()
    assert len(lines) == 3
    off, on = lines[1].split(), lines[2].split()
    assert off[:5] == ["push", "off", "2", "100", "310.0"] and off[6] == "4.00" and len(off) == 7
    assert on[:7] == ["push", "on", "2", "100", "30.0", "96", "0.30"] and on[7] == "10.33"
