"""pushkv transfer-report: what one request's KV transfer costs, measured on a
real deployment (or, with --writers-only, between two writer processes alone:
tools/transfer_writers.py). For each prompt length: KV bytes moved, descriptors per
transfer (against blocks), WRITE time and GB/s next to a plain torch copy of
the same number of bytes in this run, and the share of TTFT spent between
P's prefill end and D's KV received."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

from tools.copy_speed import plain_copy_gbps
from tools.launch import launched


def one(dep, n: int, rng: random.Random) -> dict:
    before = dep.stats("prefill").counters
    body = dep.complete([rng.randrange(256) for _ in range(n)], 2)
    after = dep.stats("prefill").counters
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("kv_bytes", "kv_descs", "kv_blocks", "kv_transfer_us")}
    tl = body["pushkv"]["timeline"]
    ttft = tl["router.first_token"] - tl["router.arrival"]
    gap = tl["decode.kv_received"] - tl["prefill.prefill_end"]
    write_s = d["kv_transfer_us"] / 1e6
    return {
        "prompt_tokens": n, "kv_bytes": d["kv_bytes"], "descs": d["kv_descs"], "blocks": d["kv_blocks"],
        "write_ms": write_s * 1e3, "write_gbps": d["kv_bytes"] / write_s / 1e9 if write_s else float("nan"),
        "ttft_ms": ttft * 1e3, "prefill_ms": (tl["prefill.prefill_end"] - tl["prefill.prefill_start"]) * 1e3,
        "prefill_end_to_kv_ms": gap * 1e3, "share_of_ttft": gap / ttft,
    }


def fixed_cost_line(rows: list[dict]) -> str:
    """The WRITE's fixed cost and rate, from the line through its times against bytes. A negative intercept is no
    cost: the times did not grow with the bytes over these lengths (one slow rep, a streamed push's parts), and it
    is said so rather than printed as a cost."""
    from tools.transfer_writers import fit_line

    a, b = fit_line([r["kv_bytes"] for r in rows], [r["write_ms"] / 1e3 for r in rows])
    rate = f"{1 / b / 1e9:.2f} GB/s" if b > 0 else "none (time does not grow with bytes)"
    if a < 0:
        return (f"fixed cost: not resolved at these lengths (the line through WRITE time vs bytes meets 0 bytes at "
                f"{a * 1e6:.0f} us, below their noise; --writers-only times a one-block transfer); slope {rate}")
    return f"fixed cost (intercept of WRITE time vs bytes over these lengths): {a * 1e6:.0f} us; slope {rate}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv transfer-report", description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default="results/transfer_report.json")
    ap.add_argument("--push-stream", choices=("off", "layer", "chunk"), default="off",
                    help="the deployment's push streaming (default off: each request's KV in one WRITE when its "
                         "prefill ends, the transfer this report times; layer: `pushkv up --mode push`'s default, "
                         "whose parts leave during the prefill and are summed)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: pools and models on this device")
    ap.add_argument("--decode-device", default=None, help="D on another GPU (e.g. cuda:1)")
    ap.add_argument("--writers-only", action="store_true",
                    help="time the transfer alone between a P and a D writer process (no model, no "
                         "scheduler): sizes from --sizes-mib plus one block, and the fixed cost")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--post-cost", action="store_true",
                    help="with --writers-only: also time the post path alone, ad-hoc descriptors against "
                         "prepared lists, interleaved (CPU time and wall time per transfer)")
    ap.add_argument("--warm", choices=("auto", "on", "off"), default="auto",
                    help="with --writers-only: the writers' writer_warm (spin while a transfer is expected)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="with --writers-only: wait this long after P has D's registration before SendKV "
                         "(the prefill push overlaps; not in the times measured)")
    ap.add_argument("--busy", action="store_true",
                    help="with --writers-only, CUDA only: a bf16 matmul loop on P's and D's GPUs meanwhile")
    ap.add_argument("--warm-matrix", action="store_true",
                    help="with --writers-only: warm off/on x gap 0/--gap-ms (20 if 0) x devices idle/busy (busy "
                         "on CUDA only), one writer pair and one compact line per configuration")
    args = ap.parse_args(argv)
    if args.writers_only and args.warm_matrix:
        from tools.transfer_writers import warm_matrix

        model = args.model if args.model != "small" else "medium"
        res = warm_matrix(model, args.block_size, args.sizes_mib, args.reps, args.device, args.decode_device,
                          (0.0, args.gap_ms or 20.0))  # devices busy: skipped (said so) on the CPU
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": model, "block_size": args.block_size, "warm_matrix": res}, f, indent=1)
        print(f"(written to {args.out})")
        return 0
    if args.writers_only:
        from tools.transfer_writers import report

        model = args.model if args.model != "small" else "medium"
        if args.busy and not args.device.startswith("cuda"):
            ap.error("--busy keeps GPUs computing: it needs --device cuda...")
        res = report(model, args.block_size, args.sizes_mib, args.reps, args.device, args.decode_device,
                     args.warm, args.gap_ms, args.busy)
        if args.post_cost:
            from tools.transfer_writers import post_cost

            counts = [1] + [r["blocks"] for r in res["rows"] if r["blocks"] > 1]
            res["post_cost"] = post_cost(model, args.block_size, counts, max(args.reps, 11), args.device,
                                         args.decode_device)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": model, "block_size": args.block_size, "writers_only": True, **res}, f, indent=1)
        print(f"(written to {args.out})")
        return 0
    blocks = max(args.lengths) // args.block_size + 64
    rng = random.Random(0)
    rows = []
    print(f"starting a push deployment (--push-stream {args.push_stream}, {args.model}, block size "
          f"{args.block_size}, {blocks} blocks) ...", flush=True)
    extra = ["--device", args.device] + (["--decode-device", args.decode_device] if args.decode_device else [])
    with launched("--mode", "push", "--push-stream", args.push_stream, "--model", args.model, "--load-format",
                  "dummy", "--num-blocks", str(blocks), "--block-size", str(args.block_size), *extra) as dep:
        dep.complete([1, 2, 3], 2)  # warm-up: first handshake, allocator, lazy init
        for n in args.lengths:
            runs = [one(dep, n, rng) for _ in range(args.reps)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["copy_gbps"] = plain_copy_gbps(int(row["kv_bytes"]), device=args.device,
                                               dst_device=args.decode_device or args.device)
            rows.append(row)
            print(f"  {n} tokens done", flush=True)
    hdr = (f"{'prompt':>7} {'KV MiB':>8} {'blocks':>7} {'descs':>6} {'WRITE ms':>9} {'WRITE GB/s':>11} "
           f"{'copy GB/s':>10} {'ratio':>6} {'TTFT ms':>9} {'prefill ms':>11} {'Pend->KV ms':>12} {'share':>6}")
    print("\n" + hdr)
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['kv_bytes'] / 2**20:>8.1f} {r['blocks']:>7.0f} {r['descs']:>6.0f} "
              f"{r['write_ms']:>9.2f} {r['write_gbps']:>11.2f} {r['copy_gbps']:>10.2f} "
              f"{r['write_gbps'] / r['copy_gbps']:>6.2f} {r['ttft_ms']:>9.1f} {r['prefill_ms']:>11.1f} "
              f"{r['prefill_end_to_kv_ms']:>12.2f} {r['share_of_ttft'] * 100:>5.1f}%")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "block_size": args.block_size, "push_stream": args.push_stream, "rows": rows},
                  f, indent=1)
    if len(rows) > 1:
        print(fixed_cost_line(rows))
    print(f"\n(medians of {args.reps}; written to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
