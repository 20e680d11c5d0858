"""N concurrent completions at once against a deployment, and what each got: how many of each
HTTP status, how many 429s carried ``Retry-After``, the slowest answer, and the first few error
messages. Without ``--url`` it starts a deployment of its own, under defaults apart from the flags
given after ``--`` (``pushkv up --mode push --model small``), and checks that both pools are free
after the burst.

    python -m tools.burst [--requests 400] [--prompt-tokens 200] [--max-tokens 16] [--url URL] [-- up flags]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse
from collections import Counter
from typing import Optional


def _one(url: str, body: bytes, timeout_s: float) -> tuple[int, Optional[str], str]:
    """(status, Retry-After or None, the error message or "")."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        msg = ""
        if r.status != 200:
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:200].decode(errors="replace")
        return r.status, r.getheader("Retry-After"), msg
    except OSError as e:  # no answer at all: the connection failed or timed out
        return 0, None, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def burst(url: str, requests: int, prompt_tokens: int, max_tokens: int, timeout_s: float = 300.0,
          seed: int = 0, vocab: int = 256) -> dict:
    """Send ``requests`` completions at once (one thread each) and wait for every answer."""
    rng = random.Random(seed)
    bodies = [json.dumps({"prompt": [rng.randrange(vocab) for _ in range(prompt_tokens)],
                          "max_tokens": max_tokens}).encode() for _ in range(requests)]
    results: list = [None] * requests
    start = threading.Barrier(requests + 1)
    took = [0.0] * requests

    def run(i: int) -> None:
        start.wait()
        t = time.monotonic()
        results[i] = _one(url, bodies[i], timeout_s)
        took[i] = time.monotonic() - t

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(requests)]
    for t in ts:
        t.start()
    t0 = time.monotonic()
    start.wait()
    for t in ts:
        t.join(timeout_s + 30)
    statuses = Counter(r[0] if r else -1 for r in results)
    return {
        "requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "status": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500 or k <= 0),
        "retry_after_429": sum(1 for r in results if r and r[0] == 429 and r[1]),
        "slowest_s": round(max(took), 2), "elapsed_s": round(time.monotonic() - t0, 2),
        "errors": sorted({r[2] for r in results if r and r[2]})[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--url", default="", help="a running deployment (default: start one)")
    ap.add_argument("up", nargs="*", help="pushkv up flags for the deployment started here (after --)")
    args = ap.parse_args()
    if args.url:
        out = burst(args.url, args.requests, args.prompt_tokens, args.max_tokens, args.timeout)
    else:
        from pushkv.launch import launched
        flags = args.up or ["--mode", "push", "--model", "small"]
        with launched(*flags) as dep:
            out = burst(dep.url, args.requests, args.prompt_tokens, args.max_tokens, args.timeout)
            st = dep.wait_pools_free(60)
            out["flags"] = flags
            out["pools_free"] = True
            out["late_allocations"] = st["prefill"].counters.get("late_allocations", 0)
            out["renewed_at_p"] = sum(v for s in st.values() for k, v in s.counters.items()
                                      if k.startswith("writer.") and k.endswith(".renewed"))
            out["expired_at_p"] = sum(v for s in st.values() for k, v in s.counters.items()
                                      if k.startswith("writer.") and k.endswith(".expired_prefill"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
