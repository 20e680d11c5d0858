"""Chunked prefills on a tight pool: how many requests run at once on the instance that prefills, their TTFT there,
the preemptions and the wall time, from one local or P/D deployment of the tiny model (--load-format dummy) on the
CPU.

    python3 -m experiments.chunk_alloc MODE NUM_BLOCKS PROMPTS PROMPT_LEN CHUNK [MAX_TOKENS [BUDGET]]

MODE: local, pull, or push (--push-stream off); in P/D the pool of NUM_BLOCKS is P's and D's holds them all. Every
prompt at once (distinct random tokens, max_tokens MAX_TOKENS, default 8, greedy; BUDGET: --max-batch-tokens, default
pushkv's 8192; vLLM's --enable-chunked-prefill makes it the chunk); the prefilling instance's
vllm:num_requests_running scraped every 20 ms meanwhile, and its vllm:time_to_first_token_seconds (queue + prefill:
what admission changes) read at the end. One JSON line out. Runs on a tree from before the chunk-by-chunk allocation
too (its own copy of this file), which has no prefills_in_step_max counter."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading

from experiments.gauge_sampling import sampled, scraper
from tools.launch import launched
from tools.layout_report import prompt

SCRAPE_S = 0.02


def main(argv: list[str]) -> None:
    mode, nblocks, n, length, chunk = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    max_tokens = int(argv[5]) if len(argv) > 5 else 8
    budget = int(argv[6]) if len(argv) > 6 else 0
    tmp = tempfile.mkdtemp()
    flags = ["--mode", mode, "--model", "tiny", "--load-format", "dummy", "--prefill-chunk", str(chunk)]
    flags += ["--max-batch-tokens", str(budget)] if budget else []
    if mode == "local":
        flags += ["--num-blocks", str(nblocks)]
    else:
        conf = os.path.join(tmp, "pools.json")
        with open(conf, "w") as f:
            json.dump({"prefill": {"num_blocks": nblocks}, "decode": {"num_blocks": 4 * n * (length // 16 + 2)}}, f)
        flags += ["--config", conf] + (["--push-stream", "off"] if mode == "push" else [])
    prompts = [prompt(length, 1000 + i) for i in range(n)]
    with launched(*flags, log_path=tmp + "/up.log", registry=tmp + "/reg") as dep:
        role = "local" if mode == "local" else "prefill"
        inst = dep.cfg.instance(role)
        url = f"http://{dep.cfg.metrics_host()}:{inst.metrics_port}/metrics"

        scrape = scraper(url)
        dep.tokens(prompt(8, 7), 2)  # warm the engine; its TTFT is taken off below
        base = scrape()
        load = [threading.Thread(target=dep.tokens, args=(p, max_tokens)) for p in prompts]
        wall, reads = sampled(load, scrape, SCRAPE_S)
        s = scrape()
        st = dep.wait_pools_free()
    running = [r["vllm:num_requests_running"] for r in reads]
    ttft = s["vllm:time_to_first_token_seconds_sum"] - base["vllm:time_to_first_token_seconds_sum"]
    count = s["vllm:time_to_first_token_seconds_count"] - base["vllm:time_to_first_token_seconds_count"]
    print(json.dumps({"mode": mode, "num_blocks": nblocks, "prompts": n, "prompt_len": length, "chunk": chunk,
                      "budget": budget or 8192, "max_tokens": max_tokens, "wall_s": round(wall, 2),
                      "max_running": max(running),
                      "mean_running": round(sum(running) / len(running), 2),
                      "mean_ttft_ms": round(1000 * ttft / count, 1) if count else None,
                      "preemptions": st[role].counters.get("preemptions", 0),
                      "prefills_in_step_max": st[role].counters.get("prefills_in_step_max", "n/a")}))


if __name__ == "__main__":
    main(sys.argv[1:])
