"""pushkv sweep: modes x QPS x input lengths, one deployment per mode.

For each mode it starts ``pushkv up --mode ... --port P`` as a subprocess
(tools.launch), waits until it prints READY, runs ``pushkv bench`` for every (QPS,
input length) cell, then stops the deployment with SIGINT. The default grid
is small enough for a 2-core CPU box in well under 15 minutes; ``--full``
is the 1k-16k x 1/2/4/8 QPS grid. Mode "push" is push with ``--push-stream off``
(one WRITE when prefill ends); the streamed modes (push-layer, push-chunk) run only
when ``--modes`` names them. With ``PUSHKV_API_KEY`` set, the deployments it starts
ask for that key and its bench runs send it. Exit status 1 when a deployment did not
start or any request failed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from tools import bench
from tools.launch import launched

# label -> `pushkv up` arguments
MODES: dict[str, list[str]] = {
    # one WRITE at prefill end: the unstreamed baseline. "push" is its old name (results and plots keep
    # it); mode_flags says so when it is used, since `pushkv up --mode push` streams per layer group
    "push-off": ["--mode", "push", "--push-stream", "off"],
    "push": ["--mode", "push", "--push-stream", "off"],
    "push-chunk": ["--mode", "push", "--push-stream", "chunk"],  # with --prefill-chunk in the up args
    "push-layer": ["--mode", "push", "--push-stream", "layer"],  # each layer group's KV as it is stored
    # the same, GPU memory staged by UCX's cuda_copy lane rather than pushkv's host mirror (--staging)
    "push-layer-ucx-staging": ["--mode", "push", "--push-stream", "layer", "--staging", "transport"],
    "pull-inline": ["--mode", "pull", "--pull-read", "inline"],
    "pull-background": ["--mode", "pull", "--pull-read", "background"],
    "pull-write": ["--mode", "pull", "--pull-read", "write"],
    "local": ["--mode", "local"],
}
_SAID: set[str] = set()


def mode_flags(mode: str) -> list[str]:
    """`pushkv up` flags of a bench mode; mode "push" (push-off's old name) says once what it is."""
    if mode == "push" and mode not in _SAID:
        _SAID.add(mode)
        print("mode 'push' is push with --push-stream off (one WRITE when prefill ends), as 'push-off'; "
              "'push-layer' is what `pushkv up --mode push` runs", file=sys.stderr)
    return list(MODES[mode])


SMALL = {"modes": ["push", "pull-inline", "pull-background", "pull-write"], "qps": [1.0, 2.0], "inputs": [256, 1024],
         "num_prompts": 8, "output_len": 32}
FULL = {"modes": ["push", "pull-inline", "pull-background", "pull-write", "local"], "qps": [1.0, 2.0, 4.0, 8.0],
        "inputs": [1024, 2048, 4096, 8192, 16384], "num_prompts": 50, "output_len": 128}
HEALTH_TIMEOUT_S = 300.0


def grid(args) -> list[tuple[str, float, int]]:
    return [(m, q, i) for m in args.modes for q in args.qps for i in args.inputs]


def cell_seed(args, qps: float, input_len: int, it: int) -> int:
    """The prompts' seed of one (QPS, input, iteration) run: its own for every run of a mode, so that no run sends
    prompts an earlier run of the same deployment sent (its prefix cache would hold them: a TTFT without prefill and
    a transfer of one block), and the same for every mode, so that the modes see the same prompts cell by cell."""
    cells = [(q, i) for q in args.qps for i in args.inputs]
    return args.seed + cells.index((qps, input_len)) * args.iters + it


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv sweep", description=__doc__.split("\n\n")[0],
                                 epilog="A deployment with an API key: set PUSHKV_API_KEY (its pushkv up takes it as "
                                        "--api-key, and the bench sends it; OPENAI_API_KEY is sent where it is unset). "
                                        "Exit status: 1 when a deployment did not start or any request failed")
    small = f"{' and '.join(map(str, SMALL['inputs']))} tokens x {'/'.join(map(bench.fmt_qps, SMALL['qps']))} QPS"
    ap.add_argument("--full", action="store_true",
                    help=f"the 1k-16k inputs x 1/2/4/8 QPS grid over modes {', '.join(FULL['modes'])} (the default "
                         f"grid: {small} over {', '.join(SMALL['modes'])}); 'push' is --push-stream off")
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES),
                    help="these modes instead (push-layer: what pushkv up --mode push runs)")
    ap.add_argument("--qps", nargs="+", type=float)
    ap.add_argument("--inputs", nargs="+", type=int, help="input lengths")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--up-args", default="", help="extra `pushkv up` arguments, one shell string")
    ap.add_argument("--health-timeout", type=float, default=HEALTH_TIMEOUT_S)
    args = ap.parse_args(argv)
    base = FULL if args.full else SMALL
    args.modes = args.modes or base["modes"]
    args.qps = args.qps or base["qps"]
    args.inputs = args.inputs or base["inputs"]
    args.num_prompts = args.num_prompts or base["num_prompts"]
    args.output_len = args.output_len or base["output_len"]
    return args


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    os.makedirs(args.result_dir, exist_ok=True)
    cells = grid(args)
    failures = 0
    bar = tqdm(total=len(cells) * args.iters, desc="sweep", unit="run")
    for mode in args.modes:
        try:
            bar.set_postfix_str(f"{mode}: starting")
            with launched(*mode_flags(mode), *shlex.split(args.up_args), port=args.port,
                          log_path=os.path.join(args.result_dir, f"{mode}_deployment.log"),
                          start_timeout_s=args.health_timeout) as dep:
                failures += _run_mode(args, mode, dep.url, cells, bar)
        except (RuntimeError, TimeoutError) as e:
            tqdm.write(f"{mode}: {e}")
            failures += 1
    bar.close()
    return 1 if failures else 0


def bench_args(args, mode: str, url: str, qps: float, inp: int, it: int) -> argparse.Namespace:
    """`pushkv bench`'s arguments for one run of the grid."""
    return bench.parse_args([
        "--url", url, "--mode", mode, "--qps", str(qps),
        "--num-prompts", str(args.num_prompts), "--input-len", str(inp),
        "--output-len", str(args.output_len), "--warmup", str(args.warmup),
        "--seed", str(cell_seed(args, qps, inp, it)), "--result-dir", args.result_dir,
        "--iter", str(it), "--no-progress",
    ])


def _run_mode(args, mode: str, url: str, cells, bar) -> int:
    """Every (QPS, input) cell of one mode against one running deployment; failed requests."""
    from tqdm import tqdm

    failures = 0
    for _, qps, inp in [c for c in cells if c[0] == mode]:
        for it in range(args.iters):
            bar.set_postfix_str(f"{mode} qps={bench.fmt_qps(qps)} in={inp} iter={it}")
            b = bench_args(args, mode, url, qps, inp, it)
            path, s = bench.run(b)
            failures += s["failed"]
            blk = f"  D block-s med {s['median_reserved_block_s']:.3f}" if "median_reserved_block_s" in s else ""
            tqdm.write(f"{os.path.basename(path)}: ttft {s['median_ttft_ms']:.1f} ms  "
                       f"tpot {s['median_tpot_ms']:.1f} ms  failed {s['failed']}{blk}")
            bar.update(1)
    return failures


if __name__ == "__main__":
    sys.exit(main())
