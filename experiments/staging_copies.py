"""How many copies P's staging issues for one prompt, and what issuing them costs on the CPU
(``--staging pushkv``, ``writer/prefill.py``'s ``_stage_out`` over ``writer/staging.StagingArea``).

For a model preset's pool (TP 1, ``--num-blocks``, blocks of ``--block-size`` tokens, cut into
``--groups`` layer groups as ``--push-stream layer`` cuts it) and a prompt of ``--tokens``, it plans
each WRITE's copy with the writer's own ``_stage_out`` and times, per WRITE, the planning (slot
mapping and ``block_pairs``) and the issue of its copies by ``StagingArea._copy``, each copy cut to
``ISSUE_BYTES`` so that the CPU times the per-copy path (slicing, ``copy_``), not the bytes (on a GPU
each is one ``cudaMemcpyAsync`` more, a few microseconds). Schedules: ``groups`` (one part per
layer group, then the last WRITE), ``two`` (two parts, as measured on the H200: group 0, then groups
1-3, the last WRITE the rest), ``off`` (one WRITE at prefill end); pools ``fresh`` (the request's
blocks and slots one run each, as a fresh pool hands them out) and ``scattered`` (every other block:
a pool fragmented as badly as it can be).

    python -m experiments.staging_copies --model qwen3-8b --tokens 16384 --groups 9
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from types import SimpleNamespace

import torch

from pushkv.config import preset
from pushkv.kv import layout as L
from pushkv.writer.prefill import PrefillWriter
from pushkv.writer.staging import StagingArea

ISSUE_BYTES = 64


class IssueOnly(StagingArea):
    """The real area, whose copies move ``ISSUE_BYTES`` each: the count and the per-copy CPU path
    stay, the bytes (what a copy engine moves on a GPU, asynchronously) go."""

    def copy_out(self, pairs):
        self.issued = len(pairs)
        t0 = time.perf_counter()
        out = super().copy_out([(po, so, min(n, ISSUE_BYTES)) for po, so, n in pairs])
        self.issue_s = time.perf_counter() - t0
        return out


def schedule(name: str, groups: int, tokens: int, unit: int) -> list[list[tuple[int, int, int]]]:
    """Each WRITE's ``(group, first token, end token)`` spans (the rendezvous' shape: the last group's
    final unit waits for the last WRITE)."""
    held = (tokens - 1) // unit * unit
    if name == "off":
        return [[(-1, 0, tokens)]]
    if name == "groups":
        parts = [[(g, 0, tokens if g < groups - 1 else held)] for g in range(groups)]
        return parts + [[(groups - 1, held, tokens)]]
    if name == "two":
        return [[(0, 0, tokens)], [(g, 0, tokens) for g in (1, 2, 3)], [(g, 0, tokens) for g in range(4, groups)]]
    raise ValueError(name)


def run(args) -> dict:
    lay = L.layout_for(preset(args.model), 1, 0, args.num_blocks, args.block_size, layer_split=args.groups)
    groups = len(L.layer_groups(lay))
    n_blocks = L.blocks_for(args.tokens, args.block_size)
    pool = torch.empty(L.pool_bytes(lay), dtype=torch.uint8)  # never touched but for the issued bytes
    area = IssueOnly(pool, "cpu", lay, min(args.num_blocks, n_blocks * 2))
    fake = SimpleNamespace(area=area, layout=lay, counters=Counter(), _stamp=lambda *a: None)
    out: dict = {"model": args.model, "tokens": args.tokens, "blocks": n_blocks, "groups": groups,
                 "block_bytes": L.block_bytes(lay), "regions": len(area.pool_grid.base), "runs": []}
    for pool_kind in ("fresh", "scattered"):
        blocks = list(range(n_blocks)) if pool_kind == "fresh" else list(range(0, 2 * n_blocks, 2))
        if blocks[-1] >= args.num_blocks:
            continue
        slots = list(range(n_blocks))
        for sched in ("off", "groups", "two"):
            writes = []
            for spans in schedule(sched, groups, args.tokens, args.block_size):
                src = [(blocks, None, t1 - t0, None if g < 0 else (g,)) for g, t0, t1 in spans]
                # the part's spans start at their first token: the writer cuts the tables there
                src = [(b[t0 // args.block_size:], d, n, gs) for (b, d, n, gs), (_, t0, _) in zip(src, spans)]
                need = sorted({b for s, _, n, _ in src for b in s[:L.blocks_for(n, args.block_size)]})
                reps = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    PrefillWriter._stage_out(fake, ("t", 0), 1, src, slots[:len(need)])  # type: ignore[arg-type]
                    reps.append((time.perf_counter() - t0, area.issue_s, area.issued))
                total, issue, copies = (statistics.median(r[i] for r in reps) for i in range(3))
                writes.append({"copies": int(copies), "plan_ms": round((total - issue) * 1e3, 3),
                               "issue_ms": round(issue * 1e3, 3),
                               "issue_us_per_copy": round(issue / max(1, copies) * 1e6, 2)})
            row = {"pool": pool_kind, "schedule": sched, "writes": writes,
                   "copies": sum(w["copies"] for w in writes),
                   "cpu_ms": round(sum(w["plan_ms"] + w["issue_ms"] for w in writes), 3)}
            out["runs"].append(row)
            print(f"{pool_kind:>9} {sched:>6}: {len(writes):>2} WRITEs, {row['copies']:>5} copies, "
                  f"CPU {row['cpu_ms']:8.3f} ms (per WRITE: copies {[w['copies'] for w in writes]}, "
                  f"plan ms {[w['plan_ms'] for w in writes]}, issue ms {[w['issue_ms'] for w in writes]})",
                  flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--groups", type=int, default=9)
    ap.add_argument("--num-blocks", type=int, default=3072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    out = run(args)
    print(f"{out['model']}: {out['tokens']} tokens = {out['blocks']} blocks of {out['block_bytes']} B, "
          f"{out['groups']} layer groups, {out['regions']} regions")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
