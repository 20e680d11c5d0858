"""pushkv layout-report: P/D layouts that differ (block sizes, TP sizes, hybrid
attention, MLA-style latent), each run as a real deployment and checked.

For each layout: greedy tokens through P/D against ``local`` mode run with P's
TP size (so the KV is produced by the same per-rank computation; D decodes with
its own TP), the KV bytes of every head compared between P's and D's pools
after each transfer, WRITE descriptors per transfer against blocks, and WRITE
GB/s. Descriptors for a fragmented pool come from the same mapping with block
tables taken from a fragmented allocator; ``--nixl`` also times those WRITEs
over real NIXL between two processes.

The test matrix (tests/e2e/test_layouts_e2e.py) runs the same code on short prompts.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from pushkv.config import SHM_DIR, DeploymentConfig, InstanceConfig, preset, shm_name
from pushkv.kv import layout as L
from pushkv.kv.pool import attach_pool
from pushkv.messages import PoolHandle
from pushkv.protocol.mapping import map_transfer
from pushkv.protocol.tp import consumers_for, head_overlap, producer_of, producers_for, rank_heads
from tools.fragment import fragmented_table


@dataclass(frozen=True)
class Combo:
    name: str
    model: str
    p_tp: int
    d_tp: int
    p_bs: int = 16
    d_bs: int = 16
    mode: str = "push"  # push | pull (background READ)
    note: str = ""
    ci: bool = True  # in the test matrix (CI time budget); the report runs every combo

    def flags(self, num_blocks: int) -> tuple[str, ...]:
        f = ("--mode", self.mode, "--model", self.model, "--load-format", "dummy", "--num-blocks", str(num_blocks),
             "--prefill-tp", str(self.p_tp), "--decode-tp", str(self.d_tp),
             "--prefill-block-size", str(self.p_bs), "--decode-block-size", str(self.d_bs),
             # the KV check reads the blocks an idle pool hands out first (0..n-1); the prefix cache
             # would keep earlier requests' blocks and hand out others
             "--no-prefix-cache")
        # one WRITE per transfer: the report counts a whole transfer's descriptors (streamed parts
        # would add theirs; tests/e2e/test_stream_e2e.py checks layer streaming in these layouts)
        return f + (("--pull-read", "background") if self.mode == "pull" else ("--push-stream", "off"))

    def config(self, num_blocks: int) -> DeploymentConfig:
        """The deployment config these flags give (for layout arithmetic, no processes)."""
        return DeploymentConfig(
            mode=self.mode, push_stream="off", model=preset(self.model),
            prefill=InstanceConfig(role="prefill", tp=self.p_tp, block_size=self.p_bs, num_blocks=num_blocks),
            decode=InstanceConfig(role="decode", tp=self.d_tp, block_size=self.d_bs, num_blocks=num_blocks))

    @property
    def reference(self) -> tuple[str, int]:
        """The local run whose KV P reproduces exactly: same model, P's TP size."""
        return self.model, self.p_tp


MATRIX = [
    Combo("small p16/d32", "small", 1, 1, 16, 32, note="block sizes"),
    Combo("small p32/d16", "small", 1, 1, 32, 16, note="block sizes"),
    Combo("small tp1->2", "small", 1, 2, note="tp_P < tp_D"),
    Combo("small tp2->1", "small", 2, 1, note="tp_P > tp_D"),
    Combo("small tp2->2 p32/d16", "small", 2, 2, 32, 16, note="tp_P = tp_D, block sizes", ci=False),
    Combo("small tp2->4", "small", 2, 4, note="tp_P < tp_D"),
    Combo("tiny tp4->2 p16/d32", "tiny", 4, 2, 16, 32, note="tp_P > tp_D; 4 P ranks > 2 KV heads"),
    Combo("tiny tp1->4", "tiny", 1, 4, note="4 D ranks > 2 KV heads: P rank 0 writes each head to 2 D ranks",
          ci=False),
    Combo("hybrid p16/d16", "hybrid", 1, 1, note="sliding-window layers: window blocks only"),
    Combo("hybrid tp1->2 p16/d32", "hybrid", 1, 2, 16, 32, note="window + tp + block sizes"),
    Combo("mla tp2->1", "mla", 2, 1, note="latent replicated; P rank 1 writes nothing", ci=False),
    Combo("mla tp2->2 p16/d32", "mla", 2, 2, 16, 32, note="P rank 0 writes the latent to both D ranks"),
    Combo("small tp2->1 p16/d32 pull", "small", 2, 1, 16, 32, mode="pull", note="D READs"),
]

STAT_KEYS = ("kv_bytes", "kv_descs", "kv_blocks", "kv_transfer_us")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# --------------------------------------------------------------------------- pools
def pool_path(dep_id: str, role: str, rank: int) -> str:
    """The writer's live pool segment (named per writer incarnation)."""
    base = os.path.join(SHM_DIR, shm_name(dep_id, role, rank))
    found = [p for p in glob.glob(base) + glob.glob(base + "-*") if not p.endswith(".init")]
    if len(found) != 1:
        raise RuntimeError(f"expected one pool segment for {role} rank {rank}, found {found}")
    return found[0]


def attach(cfg: DeploymentConfig, role: str, rank: int):
    lay = L.instance_layout(cfg, cfg.instance(role), rank)
    handle = PoolHandle("shm", pool_path(cfg.deployment_id, role, rank), L.pool_bytes(lay), cfg.model.dtype,
                        L.pool_shape(lay))
    return attach_pool(handle, lay), lay


def seq_rows(views, lay, table, n: int) -> torch.Tensor:
    """A sequence's first n tokens: [layers, planes, local heads, n, dim], position order.
    ``table`` names logical blocks; the views are per physical sub-block."""
    subs = L.expand_table(lay, table)[:L.blocks_for(n, L.unit(lay))]
    idx = torch.tensor(subs)
    out = []
    for v in views:
        b = v[idx]  # [nb, planes, heads, sub, dim] or [nb, planes, groups, group heads, sub, dim]
        if b.dim() == 6:
            b = b.flatten(2, 3)
        out.append(b.permute(1, 2, 0, 3, 4).reshape(b.shape[1], b.shape[2], -1, b.shape[4])[:, :, :n])
    return torch.stack(out)


def kv_mismatches(cfg: DeploymentConfig, n: int, p_table, d_table) -> tuple[list[str], int]:
    """Compare every D rank's head rows with its producer's, per (layer, head): the tokens a
    decode reads (all for full-attention layers, the window's for window layers). Also every
    P replica of a head against its producer. Returns (mismatches, heads x layers compared)."""
    model = cfg.model
    total = model.cache_kv_heads
    p_tp, d_tp = cfg.prefill.tp, cfg.decode.tp
    lo = max(0, n - model.sliding_window) if model.sliding_window else 0
    windowed = set(model.window_layers) if model.sliding_window else set()
    pools = []
    try:
        p_rows, p_lays = {}, {}
        for r in range(p_tp):
            pool, lay = attach(cfg, "prefill", r)
            pools.append(pool)
            p_rows[r], p_lays[r] = seq_rows(L.layer_views(pool.tensor, lay), lay, p_table, n), lay
        bad, compared = [], 0

        def same(a, b, layer) -> bool:
            if layer in windowed:
                a, b = a[..., lo:, :], b[..., lo:, :]
            return torch.equal(a, b)

        for g in range(total):
            src = producer_of(g, p_tp, total)
            ref = p_rows[src][:, :, g - p_lays[src].head_start]
            if not ref.abs().sum():
                bad.append(f"head {g}: producer P rank {src} holds zeros")
            for r in range(p_tp):  # replicas compute the same bytes
                s, c = rank_heads(p_tp, r, total)
                if r != src and s <= g < s + c:
                    got = p_rows[r][:, :, g - s]
                    bad += [f"P replica rank {r} head {g} layer {l} differs from rank {src}"
                            for l in range(model.num_layers) if not same(got[l], ref[l], l)]
        for d in range(d_tp):
            pool, lay = attach(cfg, "decode", d)
            pools.append(pool)
            rows = seq_rows(L.layer_views(pool.tensor, lay), lay, d_table, n)
            for i in range(lay.kv_heads):
                g = lay.head_start + i
                src = producer_of(g, p_tp, total)
                ref = p_rows[src][:, :, g - p_lays[src].head_start]
                for layer in range(model.num_layers):
                    compared += 1
                    if not same(rows[layer, :, i], ref[layer], layer):
                        bad.append(f"D rank {d} head {g} layer {layer}: bytes differ from P rank {src}")
        return bad, compared
    finally:
        for p in pools:
            p.close()


# ------------------------------------------------------------------------ requests
def delta(before: dict, after: dict, keys=STAT_KEYS) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def rank_counters(stats, name: str, tp: int) -> list[int]:
    return [stats.counters.get(f"writer.{r}.{name}", 0) for r in range(tp)]


def measured(dep, combo: Combo, toks: list[int], max_tokens: int, check_kv: bool = True) -> dict:
    """One request on idle pools: tokens, transfer stats, per-rank notifications, KV check."""
    dep.wait_pools_free()  # every block free: the allocator hands out 0..n-1 on both sides
    side = "prefill" if combo.mode == "push" else "decode"  # who measured the transfer
    p0, d0 = dep.stats("prefill"), dep.stats("decode")
    out = dep.tokens(toks, max_tokens)
    dep.wait_pools_free()
    p1, d1 = dep.stats("prefill"), dep.stats("decode")
    kv = delta((p0 if side == "prefill" else d0).counters, (p1 if side == "prefill" else d1).counters)
    n = len(toks)
    row = {
        "tokens": out, "prompt_tokens": n, "kv_bytes": kv["kv_bytes"], "descs": kv["kv_descs"],
        "blocks": delta(p0.counters, p1.counters)["kv_blocks"], "write_us": kv["kv_transfer_us"],
        "write_posts": [a - b for a, b in zip(rank_counters(p1, "write_posts", combo.p_tp),
                                              rank_counters(p0, "write_posts", combo.p_tp))],
        "notifs": [a - b for a, b in zip(rank_counters(d1, "write_done_received", combo.d_tp),
                                         rank_counters(d0, "write_done_received", combo.d_tp))],
    }
    row["gbps"] = row["kv_bytes"] / row["write_us"] / 1e3 if row["write_us"] else float("nan")
    if check_kv:
        p_table = range(L.blocks_for(n, combo.p_bs))
        d_table = range(L.blocks_for(n + max_tokens, combo.d_bs))
        row["kv_mismatches"], row["kv_compared"] = kv_mismatches(dep.cfg, n, p_table, d_table)
    return row


def expected_notifs(combo: Combo) -> tuple[list[int], list[int]]:
    """(WRITE posts per P rank, completions per D rank) for one push transfer."""
    total = preset(combo.model).cache_kv_heads
    posts = [len(consumers_for(p, combo.p_tp, combo.d_tp, total)) for p in range(combo.p_tp)]
    notifs = [len(producers_for(d, combo.d_tp, combo.p_tp, total)) for d in range(combo.d_tp)]
    return posts, notifs


def mapped_descs(combo: Combo, n: int, fragmented: bool, num_blocks: int) -> tuple[int, int, int]:
    """(descriptors, bytes, P blocks) of one n-token transfer, summed over every rank pair."""
    model = preset(combo.model)
    total = model.cache_kv_heads
    nbp, nbd = L.blocks_for(n, combo.p_bs), L.blocks_for(n, combo.d_bs)
    if fragmented:  # free runs of 2 blocks on P, 3 on D: neither side nor their alignment helps
        num_blocks = max(num_blocks, 6 * max(nbp, nbd) + 8)
        pt, dt = fragmented_table(num_blocks, 2, nbp), fragmented_table(num_blocks, 3, nbd)
    else:
        pt, dt = list(range(nbp)), list(range(nbd))
    cfg = combo.config(num_blocks)
    descs = nbytes = 0
    for d in range(combo.d_tp):
        dst = L.instance_layout(cfg, cfg.decode, d)
        for p in producers_for(d, combo.d_tp, combo.p_tp, total):
            src = L.instance_layout(cfg, cfg.prefill, p)
            heads = head_overlap(p, combo.p_tp, d, combo.d_tp, total)
            regions = map_transfer(src, pt, dst, dt, n, heads)
            descs += len(regions)
            nbytes += sum(r[2] for r in regions)
    return descs, nbytes, nbp


# ---------------------------------------------------------------------------- main
def _reference(model: str, tp: int, prompts: dict, max_tokens: int, num_blocks: int) -> dict:
    from tools.launch import launched

    with launched("--mode", "local", "--model", model, "--load-format", "dummy", "-tp", str(tp),
                  "--num-blocks", str(num_blocks)) as dep:
        return {name: dep.tokens(p, max_tokens) for name, p in prompts.items()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv layout-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt tokens")
    ap.add_argument("--reps", type=int, default=3, help="requests per length (median)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--only", nargs="*", help="substrings of layout names to run")
    ap.add_argument("--nixl", action="store_true",
                    help="also time fresh vs fragmented WRITEs over NIXL between two processes")
    ap.add_argument("--nixl-devices", nargs=2, default=["cpu", "cpu"], metavar=("P", "D"),
                    help="pool devices for --nixl (e.g. cuda:0 cuda:1)")
    ap.add_argument("--no-deploy", action="store_true",
                    help="skip the deployments: only mapped descriptors (and --nixl timings)")
    ap.add_argument("--out", default="results/layout_report.json")
    args = ap.parse_args(argv)
    combos = [c for c in MATRIX if not args.only or any(s in c.name for s in args.only)]
    if not combos:  # a mistyped --only ran nothing and said "ok" (an empty table, exit 0)
        ap.error(f"--only {' '.join(args.only)} matches no layout; the layouts: "
                 + ", ".join(repr(c.name) for c in MATRIX))
    num_blocks = max(args.lengths) // 16 + 64
    prompts = {n: prompt(n, seed=n) for n in args.lengths}
    refs: dict = {}
    rows = []
    for c in combos:
        if args.no_deploy:
            rows += [_row(c, n, ok=None, kv_bytes=mapped_descs(c, n, False, num_blocks)[1],
                          descs=mapped_descs(c, n, False, num_blocks)[0], blocks=L.blocks_for(n, c.p_bs),
                          frag_descs=mapped_descs(c, n, True, num_blocks)[0],
                          pairs=sum(len(producers_for(d, c.d_tp, c.p_tp, preset(c.model).cache_kv_heads))
                                    for d in range(c.d_tp)))
                     for n in prompts]
            continue
        try:
            if c.reference not in refs:
                print(f"reference: local {c.model} tp={c.p_tp} ...", flush=True)
                refs[c.reference] = _reference(c.model, c.p_tp, prompts, args.max_tokens, num_blocks)
            print(f"{c.name}: starting ...", flush=True)
            rows += _run_combo(c, refs[c.reference], prompts, args, num_blocks)
        except Exception as e:  # one broken layout must not hide the others' results
            print(f"{c.name}: FAILED: {type(e).__name__}: {e}", flush=True)
            rows += [_row(c, n, error=f"{type(e).__name__}: {e}") for n in prompts]
    if args.nixl:
        from tools.layout_nixl import time_writes

        for r in rows:
            c = next(c for c in combos if c.name == r["layout"])
            r.update(time_writes(c, r["prompt_tokens"], num_blocks, args.reps, tuple(args.nixl_devices)))
    print_table(rows, args.nixl)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "combos": [asdict(c) for c in combos]}, f, indent=1)
    print(f"\n(medians of {args.reps}; written to {args.out})")
    return 0 if all(r["ok"] is not False for r in rows) else 1


def _row(c: Combo, n: int, **kw) -> dict:
    row = {"layout": c.name, "note": c.note, "prompt_tokens": n, "ok": False, "blocks": 0, "descs": 0,
           "kv_bytes": 0, "frag_descs": 0, "gbps": float("nan"), "write_ms": float("nan"), "pairs": 0,
           "kv_compared": 0, "error": ""}
    row.update(kw)
    return row


def _run_combo(c: Combo, ref: dict, prompts: dict, args, num_blocks: int) -> list[dict]:
    from tools.launch import launched

    rows = []
    total = preset(c.model).cache_kv_heads
    with launched(*c.flags(num_blocks)) as dep:
        dep.complete([1, 2, 3], 2)  # warm-up: handshakes, lazy init
        for n, toks in prompts.items():
            runs = [measured(dep, c, toks, args.max_tokens) for _ in range(args.reps)]
            bad = [m for r in runs for m in r["kv_mismatches"]]
            ok = all(r["tokens"] == ref[n] for r in runs) and not bad
            rows.append(_row(
                c, n, ok=ok, blocks=runs[0]["blocks"], descs=runs[0]["descs"], kv_bytes=runs[0]["kv_bytes"],
                frag_descs=mapped_descs(c, n, True, num_blocks)[0],
                gbps=statistics.median(r["gbps"] for r in runs),
                write_ms=statistics.median(r["write_us"] for r in runs) / 1e3,
                pairs=sum(len(producers_for(d, c.d_tp, c.p_tp, total)) for d in range(c.d_tp)),
                kv_compared=runs[0]["kv_compared"],
                error="" if ok else (bad[:1] or ["tokens differ from local"])[0]))
    return rows


def print_table(rows: list[dict], nixl: bool) -> None:
    hdr = (f"{'layout':<27} {'tokens':>6} {'ok':>4} {'MiB':>6} {'blocks':>6} {'pairs':>5} "
           f"{'descs':>6} {'frag':>6} {'WRITE ms':>9} {'GB/s':>6}")
    if nixl:
        hdr += f" | NIXL GB/s (descs): {'fresh':>13} {'fragmented':>13} {'unplanned':>14}"
    print("\n" + hdr)
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r["ok"]]
        line = (f"{r['layout']:<27} {r['prompt_tokens']:>6} {ok:>4} "
                f"{r['kv_bytes'] / 2**20:>6.2f} {r['blocks']:>6} {r['pairs']:>5} {r['descs']:>6} "
                f"{r['frag_descs']:>6} {r['write_ms']:>9.2f} {r['gbps']:>6.2f}")
        if nixl:
            line += "                    " + " ".join(
                f"{r.get(f'nixl_{k}_gbps', float('nan')):>6.2f} ({r.get(f'nixl_{k}_descs', 0):>5})"
                for k in ("fresh", "frag", "unplanned"))
        print(line)
    for r in rows:
        if r.get("error"):
            print(f"  {r['layout']} ({r['prompt_tokens']} tokens): {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
