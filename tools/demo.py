"""pushkv-demo: bring up a local P/D deployment (push) on the built-in model,
answer requests through it, check the tokens against a single instance
(local mode), and print what was measured."""
from __future__ import annotations

import argparse
import random
import sys
import time

from tools.launch import launched


def _stage_ms(tl: dict, a: str, b: str) -> str:
    return f"{(tl[b] - tl[a]) * 1e3:8.1f} ms" if a in tl and b in tl else "       n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv-demo", description=__doc__)
    ap.add_argument("--model", default="small", help="a random-weight shape (nothing is downloaded)")
    ap.add_argument("--mode", default="push", choices=["push", "pull"])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[16, 300, 1024])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-check", action="store_true", help="skip the local-mode reference run")
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    ap.add_argument("--decode-device", default=None, help="D on another device (e.g. cuda:1)")
    ap.add_argument("--num-blocks", default="1024")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in args.prompt_len]
    common = ("--model", args.model, "--load-format", "dummy", "--num-blocks", args.num_blocks, "--device", args.device)
    ref = None
    if not args.no_check:
        print("starting the reference: one local instance ...", flush=True)
        with launched("--mode", "local", *common) as dep:
            ref = [dep.tokens(p, args.max_tokens) for p in prompts]
    print(f"starting a {args.mode} deployment (router, P and D scheduler/worker/writer) ...", flush=True)
    t0 = time.monotonic()
    ok = True
    split = ("--decode-device", args.decode_device) if args.decode_device else ()
    with launched("--mode", args.mode, *common, *split) as dep:
        print(f"  ready in {time.monotonic() - t0:.1f}s at {dep.url}")
        body = dep.complete("Hello from pushkv!", 8)
        print(f"  text prompt -> {body['choices'][0]['text']!r} (random weights)")
        print(f"\n{'prompt':>7} {'TTFT':>11} {'prefill':>11} {'P end->KV':>11} {'e2e':>11}  tokens == local")
        for p, i in zip(prompts, range(len(prompts))):
            t = time.monotonic()
            body = dep.complete(p, args.max_tokens)
            e2e = time.monotonic() - t
            tl = body["pushkv"]["timeline"]
            toks = body["choices"][0]["token_ids"]
            same = "n/a" if ref is None else ("yes" if toks == ref[i] else "NO")
            ok &= same != "NO"
            print(f"{len(p):>7} {_stage_ms(tl, 'router.arrival', 'router.first_token')} "
                  f"{_stage_ms(tl, 'prefill.prefill_start', 'prefill.prefill_end')} "
                  f"{_stage_ms(tl, 'prefill.prefill_end', 'decode.kv_received')} {e2e * 1e3:8.1f} ms  {same}")
        st = {r: dep.stats(r) for r in dep.roles()}
        for r, s in st.items():
            print(f"  {r}: {s.free_blocks}/{s.num_blocks} blocks free, counters {dict(sorted(s.counters.items()))}")
    print("\nall tokens equal local mode" if ok else "\nMISMATCH against local mode")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
