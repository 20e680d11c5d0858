"""Why a layer mark reached P's writer late when the worker's own thread waited for it (issue 27,
lone 16k over TCP): one process runs a qwen3-8b (random weights) prefill of --tokens tokens; after
each layer group it records a timed event, and a thread of the process waits for each in turn, as
the worker's mark sender did before marks carried inter-process events (pushkv/worker/marks.py).
Every --every s while the prefill runs it dumps every thread's Python stack (faulthandler's
watchdog: a C thread, so it sees a thread that holds the interpreter lock).

    python3 experiments/marks_probe.py --out DIR [--tokens 16384] [--temperature 1.0]

Prints each group: when the forward passed it, when the device finished it (the event's GPU timing
from the step's first launch) and when the waiting thread saw that; DIR/stacks.txt holds the dumps.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import queue
import threading
import time

import torch

from pushkv import messages as m
from pushkv.config import preset
from pushkv.model.build import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--groups", type=int, default=9)
    ap.add_argument("--temperature", type=float, default=1.0, help="the request's (stream_bench sends the default 1)")
    ap.add_argument("--every", type=float, default=0.1)
    ap.add_argument("--model", default="qwen3-8b", help="a preset (the CPU smoke: small)")
    ap.add_argument("--device", default="cuda:0", help="a CUDA device (the events are CUDA's)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = preset(args.model)
    model = build_model(cfg, device=args.device, max_num_seqs=8)
    u = 16
    nb = -(-args.tokens // u) + 1
    lay = model.kv_layout(nb, u)
    pool = torch.zeros(nb, lay.num_layers, 2, lay.kv_heads, u, lay.head_dim, dtype=model.dtype, device=args.device)
    per = -(-lay.num_layers // args.groups)
    groups = [tuple(range(i, min(i + per, lay.num_layers))) for i in range(0, lay.num_layers, per)]
    ends = {g[-1]: i for i, g in enumerate(groups)}
    seen: dict[int, tuple[float, float, float]] = {}
    q: "queue.SimpleQueue" = queue.SimpleQueue()

    def waiter() -> None:  # the old mark sender: wait for each group's event, then note when
        while (item := q.get()) is not None:
            g, start, ev, recorded = item
            ev.synchronize()
            seen[g] = (recorded, start[1] + start[0].elapsed_time(ev) / 1e3, time.time())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()

    def hook():
        start = (torch.cuda.Event(enable_timing=True), time.time())
        start[0].record()

        def on_layer(layer: int) -> None:
            if layer in ends:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                q.put((ends[layer], start, ev, time.time()))
        return on_layer

    sp = m.SamplingParams(temperature=args.temperature) if args.temperature else None

    def seq(n: int, sid: int) -> m.SeqWork:
        return m.SeqWork(sid, tuple((7 * i + sid) % cfg.vocab_size for i in range(n)), 0, tuple(range(-(-n // u))),
                         sampling=sp)

    for n in (min(1024, args.tokens), args.tokens):  # warm both shapes
        model.execute_sampled([seq(n, 1)], pool)
    torch.cuda.synchronize()
    with open(os.path.join(args.out, "stacks.txt"), "w") as f:
        t0 = time.time()
        faulthandler.dump_traceback_later(args.every, repeat=True, file=f)
        out = model.execute_sampled([seq(args.tokens, 2)], pool, hook())
        t_end = time.time()
        faulthandler.cancel_dump_traceback_later()
    q.put(None)
    thread.join(10)
    print(f"prefill of {args.tokens} tokens: {(t_end - t0) * 1e3:.1f} ms, token {out.tokens}, temperature "
          f"{args.temperature}")
    print("group  recorded      gpu     seen  (ms after the step's start)")
    for g in sorted(seen):
        print(f"{g:5d} " + " ".join(f"{(t - t0) * 1e3:8.1f}" for t in seen[g]))


if __name__ == "__main__":
    main()
