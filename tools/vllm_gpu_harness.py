"""Prove the vLLM connector's core without vLLM: P and D processes hold KV caches in vLLM's
layouts, each with its real pushkv writer (real NIXL over UCX), and P streams every layer group
to D as it writes the layers.

    python -m tools.vllm_gpu_harness --out DIR               # one GPU (P and D share cuda:0)
    python -m tools.vllm_gpu_harness --device cpu --quick --out DIR

On a GPU each side's KV cache is allocated as vLLM's GPU worker allocates it, through the
connector's hook (``with ws.alloc:``): by default (``--cuda-memory writer``) the writer allocates
it and the side maps it by CUDA IPC; ``--cuda-memory vllm`` is the fallback (the side allocates,
the writer imports it by CUDA IPC), kept to compare.

1. For every layout (``pushkv/vllm/regions.py`` LAYOUTS, NHD and HND where both exist): P fills
   each layer of a request's blocks from a kernel, marks each layer group stored (an inter-process
   CUDA event on the GPU) and D checks its bytes head by head -> PASS/FAIL per layout.
2. An 8k prompt's KV in qwen3-8b's shape (36 layers, 8 KV heads, head_dim 128, bf16, block 16):
   layer-streamed against one whole WRITE; the tail from the last layer stored to D holding every
   byte; one layer group's WRITE (the whole WRITE's time / groups); the ratio tail / that.

Writes ``results.json`` and ``summary.txt`` under ``--out``. Imports no vLLM: this is the
connector's worker half (``worker_side.py``) and writer, driven as vLLM's scheduler would.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

import torch

from pushkv.vllm import params as P
from pushkv.vllm import wire as w
from pushkv.vllm.scheduler_side import StepMeta
from pushkv.vllm.worker_side import WorkerSide

CASES = {  # harness case -> the layout's name in regions.LAYOUTS (the views: kv_views)
    "flash_attn_nhd": "flash_attn", "flash_attn_hnd": "flash_attn",
    "flashinfer_nhd": "flashinfer", "flashinfer_hnd": "flashinfer",
    "pages_hnd": "pages", "pages_nhd": "pages", "mla": "mla",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DONE_S = 60.0


def kv_views(buf: torch.Tensor, case: str, layers: int, blocks: int, bs: int, heads: int, hd: int,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM-shaped per-layer views of ``buf`` (layer-major, as vLLM's layer-compact layouts)."""
    t = buf.view(dtype)
    if case == "flash_attn_nhd":
        full = t.view(layers, 2, blocks, bs, heads, hd)
    elif case == "flash_attn_hnd":
        full = t.view(layers, 2, blocks, heads, bs, hd).permute(0, 1, 2, 4, 3, 5)
    elif case == "flashinfer_nhd":
        full = t.view(layers, blocks, 2, bs, heads, hd)
    elif case == "flashinfer_hnd":
        full = t.view(layers, blocks, 2, heads, bs, hd).permute(0, 1, 2, 4, 3, 5)
    elif case == "pages_hnd":  # vLLM 0.32's [B, H, N, C], LBHNC
        full = t.view(layers, blocks, heads, bs, 2 * hd)
    elif case == "pages_nhd":  # LBNHC
        full = t.view(layers, blocks, bs, heads, 2 * hd).permute(0, 1, 3, 2, 4)
    elif case == "mla":
        full = t.view(layers, blocks, bs, hd)
    else:
        raise ValueError(case)
    return {f"model.layers.{i}.self_attn.attn": full[i] for i in range(layers)}


def cache_bytes(case: str, layers: int, blocks: int, bs: int, heads: int, hd: int, dtype: torch.dtype) -> int:
    per = bs * hd if case == "mla" else 2 * bs * heads * hd
    return layers * blocks * per * torch.tensor([], dtype=dtype).element_size()


def block_of(view: torch.Tensor, case: str, b: int) -> torch.Tensor:
    return view[:, b] if case.startswith("flash_attn") else view[b]


def head_of(blk: torch.Tensor, case: str, h: int) -> torch.Tensor:
    """Head ``h`` of one block's KV (K and V of every token; MLA's one latent page)."""
    if case == "mla":
        return blk
    if case.startswith("pages"):
        return blk[h]
    return blk[..., h, :]  # K and V of the head, every token


def pattern(case: str, view: torch.Tensor, layer: int, blocks: list[int], seed: int) -> torch.Tensor:
    """The request's KV of one layer, as P's kernel writes it (D regenerates it to check)."""
    g = torch.Generator(device=view.device).manual_seed(seed * 1000 + layer)
    shape = (len(blocks),) + tuple(block_of(view, case, 0).shape)
    bits = torch.randint(-2**15, 2**15, shape, generator=g, device=view.device, dtype=torch.int32)
    nbits = view.element_size() * 8
    ints = bits.to(torch.int16) if nbits == 16 else bits
    return ints.view(view.dtype) if nbits in (16, 32) else ints.to(view.dtype)


def write_layer(case: str, view: torch.Tensor, layer: int, blocks: list[int], seed: int) -> None:
    vals = pattern(case, view, layer, blocks, seed)
    for i, b in enumerate(blocks):
        block_of(view, case, b).copy_(vals[i])


# -- the two processes --------------------------------------------------------------------------
def _settings(engine: str, groups: int, cuda_memory: P.CudaMemory = "writer") -> P.Settings:
    return P.Settings(engine, 1, "", 0, 20.0, 30.0, 5.0, stream_groups=groups, cuda_memory=cuda_memory)


def _wait(ws: WorkerSide, rid: str, kind: str) -> tuple[bool, float]:
    """Until the writer reports ``rid`` (sent / received); (ok, when)."""
    deadline = time.monotonic() + DONE_S
    while time.monotonic() < deadline:
        ws.bind(StepMeta(idle=True, pending=True))
        sent, recvd, failed = ws.transfer_results()
        if rid in (sent if kind == "sent" else recvd):
            return rid not in failed, time.monotonic()
    raise TimeoutError(f"request {rid} not {kind} within {DONE_S:.0f}s")


def _side(role: str, conn, device: str) -> None:
    """One instance's worker: its KV cache, its writer, and what the harness tells it to do."""
    ws: Any = None  # a WorkerSide once opened
    views: Any = None  # its KV cache: vLLM's per-layer views of buf
    buf: Any = None
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            op, a = cmd
            if op == "open":
                if ws is not None:  # the old cache first: it may be the old writer's memory
                    views = buf = None
                    ws.shutdown()
                settings = _settings(a["engine"], a["groups"], a["cuda_memory"])
                ws = WorkerSide(settings, 0, role, (a["heads"], a["heads"], "harness"))
                dtype = DTYPES[a["dtype"]]
                n = cache_bytes(a["case"], a["layers"], a["blocks"], a["bs"], a["heads"], a["hd"], dtype)
                with ws.alloc:
                    buf = torch.zeros(n, dtype=torch.int8, device=device)
                views = kv_views(buf, a["case"], a["layers"], a["blocks"], a["bs"], a["heads"], a["hd"], dtype)
                ws.register_kv_caches(views, a["bs"], CASES[a["case"]])
                case, names = a["case"], list(views)
                conn.send(("ok", {"writer_owns_kv": ws.writer_owns_kv}))
            elif op == "expect":  # D: the blocks are reserved; register them with P
                ws.cmd.send(_enc(w.ExpectBlocks(a["rid"], a["tid"], tuple(a["blocks"]), a["tokens"], a["source"],
                                                50.0)))
                conn.send(("ok", None))
            elif op == "prefill":  # P: every layer written from a kernel, each group marked as stored
                blocks, sync = a["blocks"], device.startswith("cuda")
                ws.bind(StepMeta(idle=False, streams={a["rid"]: (a["tid"], blocks, a["tokens"])}))
                work = _work(device, a.get("layer_flops", 0))
                t_first = time.monotonic()
                for li, name in enumerate(names):
                    work()
                    write_layer(case, views[name], li, blocks, a["seed"])
                    ws.save_layer(name)
                if sync:
                    torch.cuda.synchronize()
                t_stored = time.monotonic()
                ws.cmd.send(_enc(w.SendBlocks(a["rid"], a["tid"], tuple(blocks), a["tokens"])))
                # and the step's metadata hands the request over, as vLLM's scheduler does when it finishes
                ws.bind(StepMeta(idle=True, pending=True, sends={a["rid"]: a["tid"]}))
                ok, t_sent = _wait(ws, a["rid"], "sent")
                conn.send(("ok", {"t_first": t_first, "t_stored": t_stored, "t_sent": t_sent, "ok": ok,
                                  **ws.last_transfer}))
            elif op == "received":  # D: wait for the KV, then check it head by head
                ok, t_recv = _wait(ws, a["rid"], "recv")
                bad = _check(case, views, names, a["p_blocks"], a["blocks"], a["heads"], a["seed"]) if ok else -1
                conn.send(("ok", {"t_recv": t_recv, "ok": ok, "bad_heads": bad}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if ws is not None:
            views = buf = None
            ws.shutdown()


def _enc(msg) -> bytes:
    from pushkv import messages as m

    return m.encode(msg)


def _work(device: str, flops: float):
    """A layer's stand-in compute (a matmul of about ``flops``) before it stores its KV."""
    if not flops or not device.startswith("cuda"):
        return lambda: None
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = max(1, int(flops / (2 * n ** 3)))

    def run():
        for _ in range(reps):
            torch.mm(a, a)
    return run


def _check(case, views, names, p_blocks, d_blocks, heads, seed) -> int:
    """Heads of D's blocks that differ from what P wrote (every layer, block and head)."""
    bad = 0
    for li, name in enumerate(names):
        v = views[name]
        want = pattern(case, v, li, p_blocks, seed)
        for i, b in enumerate(d_blocks):
            for h in range(1 if case == "mla" else heads):
                exp, got = head_of(want[i], case, h), head_of(block_of(v, case, b), case, h)
                if not torch.equal(got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)):
                    bad += 1
    return bad


# -- the harness ------------------------------------------------------------------------------
class Pair:
    def __init__(self, device: str):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = {}, {}
        for role in ("prefill", "decode"):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_side, args=(role, theirs, device), name=f"harness-{role}", daemon=True)
            p.start()
            self.conns[role], self.procs[role] = mine, p

    def ask(self, role: str, op: str, **a):
        self.conns[role].send((op, a))
        return self.answer(role, op)

    def answer(self, role: str, op: str):
        if not self.conns[role].poll(DONE_S + 30):
            raise TimeoutError(f"{role} did not answer {op}")
        kind, out = self.conns[role].recv()
        if kind == "error":
            raise RuntimeError(f"{role} {op}: {out}")
        return out

    def close(self) -> None:
        for c in self.conns.values():
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def transfer(pair: Pair, geo: dict, n_tokens: int, p_blocks: list[int], d_blocks: list[int], seed: int,
             flops: float = 0) -> dict:
    rid = tid = uuid.uuid4().hex[:12]
    source = _settings(geo["p_engine"], 0).source()
    pair.ask("decode", "expect", rid=rid, tid=tid, blocks=d_blocks, tokens=n_tokens, source=source)
    p = pair.ask("prefill", "prefill", rid=rid, tid=tid, blocks=p_blocks, tokens=n_tokens, seed=seed,
                 layer_flops=flops)
    d = pair.ask("decode", "received", rid=rid, p_blocks=p_blocks, blocks=d_blocks, heads=geo["heads"], seed=seed)
    return {"tail_s": d["t_recv"] - p["t_stored"], "prefill_s": p["t_stored"] - p["t_first"],
            "write_s": p.get("write_s", 0.0), "nbytes": p.get("nbytes", 0), "ok": p["ok"] and d["ok"],
            "bad_heads": d["bad_heads"]}


def open_pair(pair: Pair, case: str, groups: int, cuda_memory: str = "writer", **geo) -> dict:
    tag = uuid.uuid4().hex[:6]
    g = dict(geo, case=case, p_engine=f"hp{tag}", d_engine=f"hd{tag}")
    for role, engine, gr in (("prefill", g["p_engine"], groups), ("decode", g["d_engine"], 0)):
        pair.conns[role].send(("open", dict(engine=engine, groups=gr, case=case, cuda_memory=cuda_memory, **geo)))
    owns = [pair.answer("prefill", "open")["writer_owns_kv"],  # both writers start at once
            pair.answer("decode", "open")["writer_owns_kv"]]
    g["writer_owns_kv"] = all(owns)
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for results.json and summary.txt")
    ap.add_argument("--device", default="cuda:0", help="cuda:N (P and D share it) or cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (the CPU test)")
    ap.add_argument("--groups", type=int, default=4, help="layer groups streamed apart")
    ap.add_argument("--repeats", type=int, default=5, help="transfers per mode in the measure")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens of the measure")
    ap.add_argument("--layer-tflop", type=float, default=3.6,
                    help="stand-in compute per layer on the GPU, TFLOP (qwen3-8b at 8k: ~3.6)")
    ap.add_argument("--cases", default=",".join(CASES), help="layouts to check, comma-separated")
    ap.add_argument("--skip-measure", action="store_true", help="only the layouts' byte checks")
    ap.add_argument("--cuda-memory", choices=P.CUDA_MEMORY, default="writer",
                    help="who allocates a GPU KV cache: the writer (mapped by the side) or the side "
                         "(imported by the writer), as the connector's cuda_memory")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's TERM still writes what was measured
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("no GPU here: use --device cpu", file=sys.stderr)
        return 2
    results: dict = {"device": dev, "torch": torch.__version__, "cuda_memory": args.cuda_memory, "layouts": {},
                     "measure": {}}
    lines = []
    pair = Pair(dev)
    try:
        small = dict(layers=4, blocks=24, bs=16, heads=4, hd=64, dtype="bf16")
        cases = [c for c in args.cases.split(",") if c]
        unknown = set(cases) - set(CASES)
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)} (known: {sorted(CASES)})")
        for case in cases:
            geo = dict(small, hd=576, heads=1) if case == "mla" else small
            try:
                g = open_pair(pair, case, args.groups, args.cuda_memory, **geo)
                r = transfer(pair, g, 5 * 16 - 3, [3, 4, 5, 9, 10], [20, 2, 7, 8, 11], seed=7)
                ok = r["ok"] and r["bad_heads"] == 0
                results["layouts"][case] = {"pass": ok, "writer_owns_kv": g["writer_owns_kv"], **r}
            except Exception as e:
                ok, results["layouts"][case] = False, {"pass": False, "error": str(e)[-2000:]}
            lines.append(f"{case:16s} {'PASS' if ok else 'FAIL'}")
            print(lines[-1], flush=True)
        if args.skip_measure:
            return 0 if all(v.get("pass") for v in results["layouts"].values()) else 1
        geo = dict(layers=36, blocks=0, bs=16, heads=8, hd=128, dtype="bf16")
        tokens, reps = args.prompt, args.repeats
        if args.quick:
            geo, tokens, reps = dict(geo, layers=8, heads=2, hd=64), 512, min(reps, 2)
        nb = -(-tokens // geo["bs"])
        geo["blocks"] = nb + 8
        p_blocks, d_blocks = list(range(8, 8 + nb)), list(range(nb))
        flops = args.layer_tflop * 1e12 if dev.startswith("cuda") else 0
        for mode, groups in (("whole", 0), ("streamed", args.groups)):
            g = open_pair(pair, "flash_attn_hnd", groups, args.cuda_memory, **geo)
            results["writer_owns_kv"] = g["writer_owns_kv"]
            runs = []
            for i in range(reps + 1):  # each shown as it ends: a run cut by a time limit still says what it saw
                runs.append(transfer(pair, g, tokens, p_blocks, d_blocks, seed=11 + i, flops=flops))
                r = runs[-1]
                print(f"  {mode} #{i}: tail {r['tail_s'] * 1e3:.2f} ms, WRITE {r['write_s'] * 1e3:.2f} ms, "
                      f"prefill {r['prefill_s'] * 1e3:.2f} ms, exact {r['ok'] and r['bad_heads'] == 0}", flush=True)
            runs = runs[1:]  # the first warms the path (handshake, registration caches)
            results["measure"][mode] = {"runs": runs,
                                        "tail_ms": statistics.median(r["tail_s"] for r in runs) * 1e3,
                                        "write_ms": statistics.median(r["write_s"] for r in runs) * 1e3,
                                        "prefill_ms": statistics.median(r["prefill_s"] for r in runs) * 1e3,
                                        "exact": all(r["ok"] and r["bad_heads"] == 0 for r in runs)}
        whole, streamed = results["measure"]["whole"], results["measure"]["streamed"]
        group_ms = whole["write_ms"] / args.groups
        ratio = streamed["tail_ms"] / group_ms if group_ms else float("inf")
        results["measure"].update(group_write_ms=group_ms, ratio=ratio, tokens=tokens, geometry=geo,
                                  groups=args.groups, nbytes=whole["runs"][0]["nbytes"])
        gib = whole["runs"][0]["nbytes"] / 2**30
        owner = "the writer's, mapped by the side" if results["writer_owns_kv"] else "the side's"
        lines += [f"measure: {tokens} tokens, {geo['layers']} layers x {geo['heads']} KV heads x {geo['hd']}, "
                  f"{gib:.2f} GiB, {args.groups} groups, KV memory: {owner}",
                  f"whole WRITE    {whole['write_ms']:.2f} ms ({gib / (whole['write_ms'] / 1e3 or 1):.0f} GiB/s), "
                  f"tail {whole['tail_ms']:.2f} ms, exact {whole['exact']}",
                  f"streamed       tail {streamed['tail_ms']:.2f} ms, last WRITE {streamed['write_ms']:.2f} ms, "
                  f"exact {streamed['exact']}",
                  f"one group's WRITE (whole / groups) {group_ms:.2f} ms",
                  f"ratio tail / group WRITE {ratio:.2f} (goal <= 1.2) {'MET' if ratio <= 1.2 else 'NOT MET'}"]
        for ln in lines[-5:]:
            print(ln, flush=True)
    finally:
        pair.close()
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "summary.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.skip_measure:
        return 0 if results["layouts"] and all(v.get("pass") for v in results["layouts"].values()) else 1
    all_pass = bool(results["layouts"]) and all(v.get("pass") for v in results["layouts"].values())
    return 0 if all_pass and results["measure"].get("whole", {}).get("exact") and \
        results["measure"].get("streamed", {}).get("exact") else 1


if __name__ == "__main__":
    sys.exit(main())
