"""One real-preset deployment with P at TP 2 (GPUs 0 and 1) and D at TP 1 beside it on GPU 1:
serve a few prompts, print TTFT and tokens next to local's (TP changes the numerics, so
tokens are compared, not asserted)."""
from __future__ import annotations

import random
import sys
import time

from tools.launch import launched


def main() -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (16, 1024, 4096)]
    out = {}
    for label, flags in (("push P tp2 -> D tp1", ("--mode", "push", "--prefill-tp", "2", "--device", "cuda:0",
                                                   "--decode-device", "cuda:1")),
                         ("local tp1", ("--mode", "local", "--device", "cuda:0"))):
        t0 = time.monotonic()
        with launched(*flags, "--model", "qwen3-8b", "--num-blocks", "4096", start_timeout_s=240) as d:
            up = time.monotonic() - t0
            rows = []
            for p in prompts:
                body = d.complete(p, 16)
                tl = body["pushkv"]["timeline"]
                rows.append((len(p), (tl["router.first_token"] - tl["router.arrival"]) * 1e3,
                             body["choices"][0]["token_ids"]))
        out[label] = rows
        print(f"{label}: ready in {up:.0f}s", flush=True)
        for n, ttft, toks in rows:
            print(f"  {n:>5} tokens: TTFT {ttft:7.1f} ms  {toks}", flush=True)
    a, b = out.values()
    same = sum(x[2] == y[2] for x, y in zip(a, b))
    print(f"prompts with tokens equal to local: {same}/{len(prompts)}; first tokens equal: "
          f"{sum(x[2][0] == y[2][0] for x, y in zip(a, b))}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
