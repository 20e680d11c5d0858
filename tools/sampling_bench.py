"""Cost of pushkv.model.sampling per step: batch x vocab x sampling mix, on CPU or a GPU.

    pushkv sampling-bench                                # CPU, default grid
    pushkv sampling-bench --device cuda --batch 1 64 256 --vocab 151936

Prints one line per (vocab, batch, mix): median and p90 milliseconds of one
``sample()`` call on ready logits (what a decode step adds to its forward).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pushkv.messages import SamplingParams, SeqWork
from pushkv.model import sampling
from pushkv.model.sampling import sample

MIXES = {
    "greedy": lambda i: None,
    "temperature": lambda i: SamplingParams(temperature=0.8, seed=i),
    "top_k+top_p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i),
    "+logprobs": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, logprobs=5),
    "all": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((5, 1.0),),
                                    logprobs=5),
}


def seqs_for(mix: str, batch: int, history: int) -> list[SeqWork]:
    return [SeqWork(i, (1,), 100, (0,), sampling=MIXES[mix](i), output_index=history,
                    history=tuple(range(history)) if mix == "all" else ()) for i in range(batch)]


def bench(device: str, vocab: int, batch: int, mix: str, reps: int, history: int) -> list[float]:
    logits = torch.randn(batch, vocab, device=device) * 3
    seqs = seqs_for(mix, batch, history)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        sample(logits, seqs)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        sample(logits, seqs)  # returns Python ints: the device work is done
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile(device: str, vocab: int, batch: int, mix: str, reps: int, history: int, top: int = 8) -> None:
    """Where one ``sample()`` call's time goes: host wall time against the device's kernel time
    (torch.profiler), kernels per call, and the costliest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    logits = torch.randn(batch, vocab, device=device) * 3
    seqs = seqs_for(mix, batch, history)
    for _ in range(3):
        sample(logits, seqs)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            sample(logits, seqs)
        wall = (time.perf_counter() - t0) / reps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / reps
    print(f"{vocab:>7} {batch:>5} {mix:<12} wall {wall * 1e3:.3f} ms/call (profiled), "
          f"kernels {len(kernels) / reps:.0f}/call, "
          f"kernel time {gpu_us / 1e3:.3f} ms/call")
    by: dict = {}
    for e in kernels:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.device_time)
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"      {t / reps:>8.1f} us  x{n / reps:<4.1f} {name[:110]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[320, 151936])
    ap.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--history", type=int, default=64, help="output tokens so far (penalties)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a worker uses PUSHKV_THREADS, 1)")
    ap.add_argument("--profile", action="store_true", help="CUDA: host wall time against kernel time, per call")
    ap.add_argument("--sampler", nargs="+", default=[sampling.SAMPLER], choices=["auto", "torch", "triton"],
                    help="which sampler(s), side by side in one run (PUSHKV_SAMPLER)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"device={a.device} threads={a.threads} reps={a.reps} history={a.history}")
    print(f"{'vocab':>7} {'batch':>5} {'mix':<12} {'sampler':<7} {'p50 ms':>8} {'p90 ms':>8} {'us/seq':>8}")
    for vocab in a.vocab:
        for batch in a.batch:
            for mix in a.mix:
                for which in a.sampler:
                    sampling.SAMPLER = which
                    if a.profile:
                        print(f"-- sampler {which}")
                        profile(a.device, vocab, batch, mix, a.reps, a.history)
                        continue
                    before = dict(sampling.KERNEL_ROWS)
                    t = sorted(bench(a.device, vocab, batch, mix, a.reps, a.history))
                    sorted_rows = sampling.KERNEL_ROWS["sorted"] - before["sorted"]
                    p50, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
                    print(f"{vocab:>7} {batch:>5} {mix:<12} {which:<7} {p50:>8.3f} {p90:>8.3f} "
                          f"{p50 * 1e3 / batch:>8.1f}"
                          + (f"  ({sorted_rows} rows left to the sorted path)" if sorted_rows else ""), flush=True)


if __name__ == "__main__":
    main()
