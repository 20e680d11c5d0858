"""Chats without max_tokens on a small pool: how many run at once, the KV use the gauge reads, the preemptions and
the wall time, from one local or push deployment of the small preset on the CPU.

    python3 -m experiments.preempt_concurrency MODE NUM_BLOCKS MAX_MODEL_LEN CHATS [early]

Each chat has no max_tokens (the router gives it the room left to --max-model-len); with ``early`` each may stop at
a few common ids (as a chat that ends long before its room), else it ignores EOS and fills its room. The local
instance's (or D's) vllm:num_requests_running and vllm:kv_cache_usage_perc are scraped every 50 ms meanwhile. One
JSON line out."""
from __future__ import annotations

import json
import sys
import tempfile
import threading

from experiments.gauge_sampling import sampled, scraper
from tools.launch import launched

SCRAPE_S = 0.05


def main(argv: list[str]) -> None:
    mode, nblocks, maxlen, n = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    early = len(argv) > 4 and argv[4] == "early"
    extra = {"stop_token_ids": list(range(97, 123, 3))} if early else {"ignore_eos": True}
    tmp = tempfile.mkdtemp()
    flags = ("--mode", mode, "--model", "small", "--num-blocks", str(nblocks), "--max-model-len", str(maxlen))
    with launched(*flags, log_path=tmp + "/up.log", registry=tmp + "/reg") as dep:
        inst = next(i for i in dep.cfg.instances() if i.role in ("local", "decode"))
        url = f"http://{dep.cfg.metrics_host()}:{inst.metrics_port}/metrics"

        scrape = scraper(url)
        lens: list[int] = []

        def one(i: int) -> None:
            msg = {"role": "user", "content": f"chat {i} " * (1 + i % 5)}
            status, body = dep.post("/v1/chat/completions", {"messages": [msg], **extra})
            assert status == 200, body
            lens.append(body["usage"]["completion_tokens"])

        chats = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        wall, reads = sampled(chats, scrape, SCRAPE_S)
        s = scrape()
    running = [r["vllm:num_requests_running"] for r in reads]
    usage = [r["vllm:kv_cache_usage_perc"] for r in reads]
    print(json.dumps({"mode": mode, "num_blocks": nblocks, "max_model_len": maxlen, "chats": n, "early": early,
                      "wall_s": round(wall, 2), "max_running": max(running),
                      "mean_running": round(sum(running) / len(running), 2),
                      "mean_kv_usage": round(sum(usage) / len(usage), 3),
                      "preemptions": s.get("vllm:num_preemptions_total", "n/a"),
                      "generated": s.get("vllm:generation_tokens_total"), "output_lens": sorted(lens)}))


if __name__ == "__main__":
    main(sys.argv[1:])
