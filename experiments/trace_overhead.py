"""TTFT with tracing off, on (no tap) and on with pushkv tap attached.

``python -m experiments.trace_overhead --mode push --rounds 30`` (a line of progress on stderr as each round ends)

Three deployments run side by side and each round sends the same prompt to
each of them in a shuffled order, so whatever else loads the machine hits
all three alike (paired samples). Sequential requests of 256 and 1024
tokens, then bursts of 8 concurrent 256-token requests. TTFT is the
router's own: arrival -> first token, from the response's ``pushkv.timeline``.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Callable, TextIO

import numpy as np

from tools.launch import launched

VARIANTS = ("off", "trace", "trace+tap")


def ttft_s(dep, prompt: list[int], max_tokens: int = 8) -> float:
    tl = dep.complete(prompt, max_tokens)["pushkv"]["timeline"]
    return tl["router.first_token"] - tl["router.arrival"]


def run_rounds(deps: dict, rounds: int, rng: random.Random, ttft: Callable = ttft_s, progress: TextIO = sys.stderr
               ) -> tuple[dict, dict]:
    """``rounds`` rounds over the deployments of ``deps`` (one per variant): the sequential TTFTs by (variant, prompt
    length) and the bursts' by variant; a line of progress for each round on ``progress``, as it ends (a run takes
    minutes before its table)."""
    seq: dict = {(v, n): [] for v in VARIANTS for n in (256, 1024)}
    burst: dict = {v: [] for v in VARIANTS}
    start = time.monotonic()
    for r in range(rounds):
        for n in (256, 1024):
            p = [rng.randrange(256) for _ in range(n)]
            for v in rng.sample(VARIANTS, len(VARIANTS)):
                seq[(v, n)].append(ttft(deps[v], p))
        ps = [[rng.randrange(256) for _ in range(256)] for _ in range(8)]
        for v in rng.sample(VARIANTS, len(VARIANTS)):
            out: list = [None] * 8
            ts = [threading.Thread(target=lambda i=i, v=v, out=out, ps=ps: out.__setitem__(i, ttft(deps[v], ps[i], 16)))
                  for i in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            burst[v].extend(out)
        medians = "  ".join(f"{v} {np.median(seq[(v, 256)]) * 1e3:.2f}" for v in VARIANTS)
        print(f"round {r + 1}/{rounds} ({time.monotonic() - start:.0f} s): sequential 256-token TTFT median ms so far: "
              f"{medians}", file=progress, flush=True)
    return seq, burst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="trace_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="push", choices=("push", "pull"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default="small")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    with ExitStack() as st:
        deps, regs = {}, {}
        for v in VARIANTS:
            regs[v] = st.enter_context(tempfile.TemporaryDirectory(prefix="pushkv-registry-"))
            flags = ["--mode", args.mode, "--model", args.model, "--num-blocks", "2048"]
            deps[v] = st.enter_context(launched(*flags, *(["--trace"] if v != "off" else []), registry=regs[v]))
        env = dict(os.environ, PUSHKV_REGISTRY_DIR=regs["trace+tap"])
        tap = subprocess.Popen([sys.executable, "-m", "tools.trace.tap", "-q"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        st.callback(lambda: (tap.terminate(), tap.wait(30)))
        for line in tap.stderr:  # attached once events flow
            if line.startswith("receiving"):
                break
        for v in VARIANTS:  # warm-up
            for n in (256, 1024):
                ttft_s(deps[v], [rng.randrange(256) for _ in range(n)])
        seq, burst = run_rounds(deps, args.rounds, rng)
    print(f"mode={args.mode} rounds={args.rounds} model={args.model}  TTFT ms (router arrival -> first token)")
    rows = [(f"sequential {n:4d} tokens", {v: seq[(v, n)] for v in VARIANTS}) for n in (256, 1024)]
    rows.append(("burst of 8 x 256 tokens", burst))
    for label, by_v in rows:
        base = np.array(by_v["off"]) * 1e3
        for v in VARIANTS:
            a = np.array(by_v[v]) * 1e3
            print(f"  {label:24s} {v:10s} median {np.median(a):8.2f}  mean {a.mean():8.2f}  p90 "
                  f"{np.percentile(a, 90):8.2f}  paired diff vs off: median {np.median(a - base):+7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
