"""pushkv stages: one line per bench result file: TTFT/TPOT medians and the
median of each transfer stage (KEYS, ms from the previous stage), to read a sweep stage by stage."""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

KEYS = ("prefill.prefill_end", "prefill.registration_received", "prefill.write_posted", "prefill.write_done",
        "router.prefill_finished", "router.send_decode", "decode.decode_alloc", "decode.read_posted",
        "decode.read_done", "decode.kv_received", "router.first_token")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", default=["results"], metavar="DIR",
                    help="result directories of pushkv bench / sweep (default: results)")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not os.path.isdir(d):
            print(f"pushkv stages: {d}: no such directory", file=sys.stderr)
            return 2
        for f in sorted(glob.glob(os.path.join(d, "*.json"))):
            r = json.load(open(f))
            if "median_ttft_ms" not in r:
                continue
            st = r.get("stages", {})
            parts = [f"{k.split('.', 1)[1]}={st[k]:.1f}" for k in KEYS if k in st]
            blk = (f" | D block-s med {r['median_reserved_block_s']:.3f} mean {r['mean_reserved_block_s']:.3f}"
                   f" late {r.get('late_allocations', 0)}" if "median_reserved_block_s" in r else "")
            print(f"{os.path.basename(f)}: ttft {r['median_ttft_ms']:.1f} tpot {r['median_tpot_ms']:.1f} | "
                  + " ".join(parts) + blk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
