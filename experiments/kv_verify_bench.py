"""What --kv-verify costs: the checksum kernels alone, and TTFT with verification off, sampled
and full.

Kernels: one rank's pool of the model's geometry holding a prompt of ``--length`` tokens
(random bytes), and the time of one request's sums as the worker computes them (P after
its prefill step, D before its first decode step: the same call), torch and, on CUDA, the
Triton kernel; median of ``--reps`` after a warm-up, to the host (``tolist``); and D's whole
check of one rank (the sums, then ``checksum.verify`` on the device as the worker runs it, and
the host reference ``compare`` for comparison).

TTFT (``--ttft``): one deployment per mode (``pushkv up --kv-verify MODE`` + ``--up-args``),
lone prompts of ``--length`` tokens, median TTFT and D's ``kv_verify_start -> kv_verified``.

    python -m experiments.kv_verify_bench --device cuda --model qwen3-8b --length 8192 \\
        --ttft --up-args "--device cuda --model qwen3-8b --num-blocks 2048"
    python -m experiments.kv_verify_bench --device cpu --model small --length 2048
    python -m experiments.kv_verify_bench --host-only --model qwen3-8b --length 8192
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time


def kernel_times(model_name: str, length: int, block_size: int, device: str, reps: int, groups: int = 1) -> list[dict]:
    import torch

    from pushkv.config import preset
    from pushkv.kv import checksum as C
    from pushkv.kv import layout as L

    model = preset(model_name)
    blocks = L.blocks_for(length, block_size) + 4
    lay = L.layout_for(model, 1, 0, blocks, block_size, layer_split=groups)
    pool = torch.empty(L.pool_bytes(lay) // lay.dtype_bytes, dtype=getattr(torch, model.dtype), device=device)
    pool.view(torch.int16 if lay.dtype_bytes == 2 else torch.int32).random_(-30000, 30000)
    views = L.layer_views(pool, lay)
    table = list(range(blocks))
    random.Random(0).shuffle(table)
    impls = {"torch": C.unit_sums}
    if device != "cpu":
        from pushkv.model.kernels import triton_checksum

        impls["triton"] = triton_checksum.unit_sums
    rows = []
    kv_mib = length * model.kv_bytes_per_token() / 2**20
    for mode in ("sample", "full"):
        units = C.plan_units(mode, length, block_size, salt=1)
        for name, fn in impls.items():
            try:
                ref = C.unit_sums(views, lay, table, length, units, block_size)
                same = bool((fn(views, lay, table, length, units, block_size) == ref).all())  # warm-up, and checked
            except Exception as e:  # say so and go on: the workers fall back to torch the same way
                rows.append({"mode": mode, "impl": name, "error": f"{type(e).__name__}: {e}"})
                continue
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(views, lay, table, length, units, block_size).tolist()
                ts.append(time.perf_counter() - t0)
            ms = statistics.median(ts) * 1e3
            # D's whole check of one rank: the sums, then P's compared with them on the device
            # (checksum.verify, what the worker runs) or on the host (compare, its reference)
            exp = C.to_wire(lay, ref, units, block_size, length)
            checks = {"check": lambda: C.verify(lay, exp, fn(views, lay, table, length, units, block_size)),
                      "host_check": lambda: C.compare(lay, exp, C.to_wire(
                          lay, fn(views, lay, table, length, units, block_size), units, block_size, length))}
            check_ms = {}
            for what, check in checks.items():
                assert check()[0] == "", what
                cs = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    check()
                    cs.append(time.perf_counter() - t0)
                check_ms[what + "_ms"] = round(statistics.median(cs) * 1e3, 3)
            read = kv_mib * len(units) / C.n_units(length, block_size)
            rows.append({"mode": mode, "impl": name, "equal_torch": same, "ms": round(ms, 3), **check_ms,
                         "units": len(units), "kv_read_mib": round(read, 1),
                         "gb_s": round(read * 2**20 / 1e9 / (ms / 1e3), 1)})
    return rows


def host_costs(model_name: str, length: int, block_size: int, groups: int, reps: int) -> dict:
    """What the checksums cost beside the kernels, on this host: P's sums to the wire, one
    hop's decode and encode of a message carrying them (each of StepDone, SendKV, WriteDone,
    KVReceived and VerifyKV pays it), and D's comparison of one rank's sums with P's, on the
    sums' device (``verify``, here CPU tensors) and with the host reference (``compare``).
    ``full``'s sums of one request; random sums, no pool."""
    import msgspec
    import torch

    from pushkv import messages as m
    from pushkv.config import preset
    from pushkv.kv import checksum as C
    from pushkv.kv import layout as L

    model = preset(model_name)
    lay = L.layout_for(model, 1, 0, L.blocks_for(length, block_size), block_size, layer_split=groups)
    units = C.plan_units("full", length, block_size)
    sums = torch.randint(-2**62, 2**62, (len(L.layer_groups(lay)), len(units), lay.kv_heads), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(0))
    exp = C.to_wire(lay, sums, units, block_size, length)
    wire = m.encode(m.VerifyKV("t", 0, tuple(range(len(units))), exp))
    dec = msgspec.msgpack.Decoder(m.VerifyKV)

    def ms(f) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts) * 1e3, 3)

    return {"sums": sums.numel(), "message_bytes": len(wire), "to_wire_ms": ms(lambda: C.to_wire(
        lay, sums, units, block_size, length)), "decode_ms": ms(lambda: dec.decode(wire)),
            "encode_ms": ms(lambda: m.encode(dec.decode(wire))), "verify_ms": ms(lambda: C.verify(lay, exp, sums)),
            "compare_ms": ms(lambda: C.compare(lay, exp, C.to_wire(lay, sums, units, block_size, length)))}


def ttft(mode: str, up_args: list[str], length: int, reps: int, vocab: int) -> dict:
    from tools.launch import launched

    rng = random.Random(1)
    out = {"kv_verify": mode, "ttft_ms": [], "verify_ms": []}
    with launched("--kv-verify", mode, *up_args, start_timeout_s=600) as dep:
        for i in range(reps + 1):
            prompt = [rng.randrange(vocab) for _ in range(length)]
            t0 = time.perf_counter()
            body = dep.complete(prompt, 2, stream=False)
            if i == 0:
                continue  # warm-up
            tl = body["pushkv"]["timeline"]
            first = tl.get("router.first_token") or tl.get("decode.first_token")
            out["ttft_ms"].append((first - tl["router.arrival"]) * 1e3 if first else (time.perf_counter() - t0) * 1e3)
            if "decode.kv_verified" in tl:
                out["verify_ms"].append((tl["decode.kv_verified"] - tl["decode.kv_verify_start"]) * 1e3)
    for k in ("ttft_ms", "verify_ms"):
        out[k + "_p50"] = round(statistics.median(out[k]), 2) if out[k] else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kv_verify_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ttft", action="store_true", help="also TTFT per --kv-verify mode (starts deployments)")
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--up-args", default="--model small", help="`pushkv up` arguments of the TTFT deployments")
    ap.add_argument("--vocab", type=int, default=250)
    ap.add_argument("--out", default="", help="JSON file for every figure")
    ap.add_argument("--host-only", action="store_true", help="only the costs beside the kernels (no pool)")
    ap.add_argument("--groups", type=int, default=4, help="layer groups of the sums (layer-streamed push's pools)")
    a = ap.parse_args(argv)
    host = host_costs(a.model, a.length, a.block_size, a.groups, a.reps)
    print(f"{a.model} {a.length} tokens, full: {host['sums']} sums, {host['message_bytes']} B a message; P to the "
          f"wire {host['to_wire_ms']} ms; a hop decodes in {host['decode_ms']} ms, encodes in {host['encode_ms']} ms; "
          f"D compares on the sums' device in {host['verify_ms']} ms (host reference {host['compare_ms']} ms)")
    if a.host_only:
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"host": host}, f, indent=1)
        return
    res = {"host": host, "kernels": kernel_times(a.model, a.length, a.block_size, a.device, a.reps,
                                                           a.groups)}
    print(f"{a.model} {a.length} tokens, block {a.block_size}, {a.device}: one rank's sums of one request")
    for r in res["kernels"]:
        if "error" in r:
            print(f"  {r['mode']:6} {r['impl']:6} failed: {r['error']}")
            continue
        print(f"  {r['mode']:6} {r['impl']:6} {r['ms']:9.3f} ms  {r['units']:5} units  "
              f"{r['kv_read_mib']:8.1f} MiB read  {r['gb_s']:7.1f} GB/s  equal to torch: {r['equal_torch']}  "
              f"D's check {r['check_ms']:.3f} ms (on the host: {r['host_check_ms']:.3f} ms)")
    if a.ttft:
        res["ttft"] = [ttft(m, shlex.split(a.up_args), a.length, a.ttft_reps, a.vocab) for m in ("off", "sample", "full")]
        base = res["ttft"][0]["ttft_ms_p50"]
        for t in res["ttft"]:
            extra = f" ({(t['ttft_ms_p50'] / base - 1) * 100:+.1f} %)" if base else ""
            print(f"  kv-verify {t['kv_verify']:6} TTFT p50 {t['ttft_ms_p50']} ms{extra}, "
                  f"D's verify p50 {t['verify_ms_p50']} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
