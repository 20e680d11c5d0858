"""How fast can a one-token MoE step read its 8 experts' gate/up weights? The shipped grouped kernel against other
forms of the same product, each alone over several layers in a CUDA graph (every call reads its own layer's
experts from HBM, not the last call's from L2), at Qwen3-30B-A3B's shapes (128 experts, 8 a token, hidden 2048,
intermediate 768, bf16, random weights).

- ``grouped``: ``triton_moe.gate_up_product`` with the one-token tile it ships (``tiles_for(1)``): ``tl.dot`` tiles
  of ``bn`` gate and ``bn`` up rows by a ``bk`` chunk of K, pipelined over stages;
- ``rows_R``: ``triton_moe.gate_up_rows`` (shipped since this probe's first run): each program ``R`` gate rows and
  their ``R`` up rows, whole (K at once), as the dense GEMVs (``kernels/triton_gemv.py``) read theirs: every load a
  run of whole 4 KB rows;
- ``read_P``: no product, a read of the same bytes only: each expert's gate/up block (6.3 MB, contiguous) in ``P``
  contiguous shares, what the HBM gives this access at best.

Prints microseconds a layer and the bytes rate of each, and the copy rate of the same run (read + write of 1 GiB),
and checks each form's product against the grouped kernel's.

    python3 -m experiments.expert_stream_probe --out DIR
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(W, Experts, Out, stride_e, share, P: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    # program p: share p % P of expert p // P's contiguous block, read UNROLL x BLOCK elements at a time
    p = tl.program_id(0)
    e = tl.load(Experts + p // P).to(tl.int64)
    base = W + e * stride_e + (p % P).to(tl.int64) * share
    offs = tl.arange(0, UNROLL)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    acc = tl.zeros((UNROLL, BLOCK), tl.float32)
    for i in range(0, share, UNROLL * BLOCK):
        acc += tl.load(base + i + offs).to(tl.float32)
    tl.store(Out + p, tl.sum(tl.sum(acc, 1), 0))


def main(argv=None) -> int:
    from experiments.moe_decode_probe import graph_us
    from pushkv.model.kernels import triton_moe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    E, k, d, inter = 128, 8, 2048, 768
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [((torch.rand(E, 2 * inter, d, generator=g, device=dev) - 0.5) * 0.1).to(torch.bfloat16)
          for _ in range(args.layers)]
    hs = [torch.randn(1, d, generator=g, device=dev).to(torch.bfloat16) for _ in range(args.layers)]
    routers = [torch.randn(E, d, generator=g, device=dev).to(torch.bfloat16) for _ in range(args.layers)]
    tiles = triton_moe.tiles_for(1)
    routed = [triton_moe.group_logits(torch.nn.functional.linear(h, r), k, True, tiles.bm) for h, r in zip(hs, routers)]
    experts = [rt[1].flatten().to(torch.int32).contiguous() for rt in routed]
    nbytes = k * 2 * inter * d * 2
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    copy_us = graph_us(lambda: big.clone(), args.reps)
    copy_rate = 2 * big.numel() * 2 / copy_us / 1e3
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: copy {copy_rate:.0f} GB/s (read + write); shipped tile {tiles}", flush=True)
    L = args.layers

    def grouped():
        return [triton_moe.gate_up_product(hs[i], ws[i], routed[i][2], routed[i][3], k, tiles) for i in range(L)]

    # the product's rows both forms write: each block's first (one token, one slot a block)
    firsts = [(rt[3] >= 0).nonzero().flatten() * tiles.bm for rt in routed]
    want = [act[f].float() for act, f in zip(grouped(), firsts)]
    forms = {"grouped": grouped}
    for R, warps in ((1, 4), (2, 4), (2, 8), (4, 8), (8, 8), (16, 8)):
        def rows(R=R, warps=warps):
            triton_moe.ROWS, triton_moe.ROWS_WARPS = R, warps
            return [triton_moe.gate_up_rows(hs[i], ws[i], routed[i][2], routed[i][3], k, tiles.bm) for i in range(L)]
        forms[f"rows_{R}_w{warps}"] = rows
    outs = torch.empty(k * 1024, dtype=torch.float32, device=dev)
    per = 2 * inter * d
    for P, block, unroll, warps in ((12, 1024, 4, 4), (24, 1024, 4, 4), (48, 1024, 4, 4), (48, 2048, 2, 8),
                                    (96, 1024, 2, 4)):
        share = per // P
        if share % (block * unroll):
            continue
        def read(P=P, block=block, unroll=unroll, warps=warps, share=share):
            for i in range(L):
                _read_kernel[(k * P,)](ws[i], experts[i], outs, ws[i].stride(0), share, P=P, BLOCK=block,
                                       UNROLL=unroll, num_warps=warps)
        forms[f"read_{P}x{block}x{unroll}_w{warps}"] = read
    rows = []
    for label, fn in forms.items():
        us = graph_us(fn, args.reps) / L
        err = None
        if label.startswith("rows"):
            got = fn()
            err = max(float((got[i][firsts[i]].float() - want[i]).abs().max()) for i in range(L))
        rows.append(dict(form=label, us=round(us, 2), GBps=round(nbytes / us / 1e3, 1),
                         of_copy=round(nbytes / us / 1e3 / copy_rate, 3), max_diff=err))
        print(f"{label:>24} {us:8.2f} us a layer {nbytes / us / 1e3:8.1f} GB/s ({nbytes / us / 1e3 / copy_rate:.1%} "
              f"of copy)  max diff {err}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "expert_stream.json"), "w") as f:
        json.dump(dict(device=name, copy_GBps=round(copy_rate, 1), bytes_a_layer=nbytes, tile=list(tiles),
                       forms=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
