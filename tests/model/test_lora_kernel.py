"""The two-launch Triton LoRA delta (``kernels/triton_lora.add_delta``) equals the torch form (``x A^T``, the mask of
each row's slot, ``y += u B^T``) to rounding: float32 and bf16, 1 to 64 rows, rows of the base model (slot 0) and of
two slots mixed, a K that is no multiple of the chunk and one long enough to be split, output columns that end in a
part tile, rows apart in memory; and a tiny Llama's steps through PEFT's adapters with the kernels on give PEFT's
float32 greedy tokens, each sequence through its own adapter in one step. On the CPU under Triton's interpreter
(TRITON_INTERPRET=1, a child process); on a GPU the kernels themselves."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

SCRIPT = r"""
import os, sys, tempfile
import msgspec
import torch
from pushkv.model import lora
from pushkv.model.kernels import triton_lora
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def torch_form(y, x, a, b, slots, width):
    col = torch.arange(a.shape[0], device=x.device) // width + 1
    mask = (slots[:, None] == col[None, :]).to(x.dtype)
    return y.clone().addmm_(x.mm(a.t()).mul_(mask), b.t())


def exact(y, x, a, b, slots, width):
    col = torch.arange(a.shape[0], device=x.device) // width + 1
    mask = (slots[:, None] == col[None, :]).double()
    u = x.mm(a.t()).double() * mask  # u rounded to the step's dtype, as both forms round it
    return y.double() + u @ b.double().t()


# each against the exact sum of the same rounded inputs: in float32 they agree to its rounding; in bf16 an element of
# u may round one ulp apart (the sums' orders differ) and torch's CPU addmm rounds u B^T before it adds y where the
# kernel rounds once, so the kernel must be as close to the exact sum as torch's form is, element by element within
# a few ulps, and on average no further
for dt in (torch.float32, torch.bfloat16):
    for T, K, width, slots_n, O in ((1, 64, 8, 1, 40), (3, 200, 24, 2, 100), (8, 4096, 48, 2, 96), (40, 96, 16, 3, 70),
                                    (64, 256, 8, 2, 64)):
        N = width * slots_n
        big = torch.randn(T, K + 8, device=dev).to(dt)
        x = big[:, :K]  # rows apart in memory
        a = (torch.randn(N, K, device=dev) / K ** 0.5).to(dt)
        b = torch.randn(O, N, device=dev).to(dt)
        slots = torch.randint(0, slots_n + 1, (T,), device=dev, dtype=torch.int32)
        slots[0] = slots_n  # at least one row through the last slot
        y0 = torch.randn(T, O + 4, device=dev).to(dt)[:, :O]  # the output's rows apart too
        want, ref = torch_form(y0, x, a, b, slots, width).double(), exact(y0, x, a, b, slots, width)
        got = y0.clone()
        assert triton_lora.add_delta(got, x, a, b, slots, width) is got
        err, torch_err = (got.double() - ref).abs(), (want - ref).abs()
        if dt == torch.float32:
            torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)
        else:
            torch.testing.assert_close(got.double(), ref, atol=0.1, rtol=2 ** -6)
            if dev == "cuda":  # Triton's interpreter casts float32 to bf16 by truncation, the GPU to nearest
                assert float(err.mean()) <= 1.5 * float(torch_err.mean()) + 1e-3, (float(err.mean()),
                                                                                   float(torch_err.mean()))
        base_rows = slots == 0
        assert torch.equal(got[base_rows], y0[base_rows]), "a base row took a delta"
# a bank of 6 or 12 slots whose step uses two (and the base model): the partials of the other slots' columns are never
# written by the shrink nor read by the expand (every buffer the kernels get starts as NaN here, so a read of one
# would show), and the result is torch's form
# (two slots to a chunk, four, and a bank past the 61 slots whose use the expand keeps as bits: it then reads every
# chunk's B, and only the rows' own partials still)
for dt, width, n_slots in ((torch.float32, 8, 6), (torch.bfloat16, 4, 12), (torch.float32, 1, 70)):
    T, K, O, N = 5, 256, 48, n_slots * width
    x = torch.randn(T, K, device=dev).to(dt)
    a = (torch.randn(N, K, device=dev) / K ** 0.5).to(dt)
    b = torch.randn(O, N, device=dev).to(dt)
    slots = torch.tensor([2, 0, 5, 2, 0], device=dev, dtype=torch.int32)
    y0 = torch.randn(T, O, device=dev).to(dt)
    real_empty = torch.empty
    torch.empty = lambda *s, **k: real_empty(*s, **k).fill_(float("nan"))
    try:
        got = triton_lora.add_delta(y0.clone(), x, a, b, slots, width)
        part = torch.empty((1, 16, N), dtype=torch.float32, device=dev)
        triton_lora._shrink_kernel[(triton_lora.triton.cdiv(N, triton_lora.BN), 1)](
            x, a, slots, part, T, K, N, width, x.stride(0), K, BT=16, BN=triton_lora.BN, BK=triton_lora.BK,
            IEEE=dt == torch.float32, SKIP=True)
    finally:
        torch.empty = real_empty
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), exact(y0, x, a, b, slots, width), atol=0.1 if dt != torch.float32 else 2e-5,
                               rtol=2 ** -6 if dt != torch.float32 else 2e-5)
    owner = torch.arange(N, device=dev) // width + 1  # each column's slot
    chunk_used = torch.zeros(N, dtype=torch.bool, device=dev)  # the shrink's programs: BN columns each
    for c0 in range(0, N, triton_lora.BN):
        chunk_used[c0:c0 + triton_lora.BN] = bool(((owner[c0:c0 + triton_lora.BN, None] == slots[None, :])).any())
    written = ~part[0, :T].isnan().all(0)
    assert torch.equal(written, chunk_used), (written, chunk_used)
    assert not chunk_used.all()  # some chunk was skipped

assert triton_lora.splits_for(1, 4096, 48) == 16 and triton_lora.splits_for(64, 4096, 48) == 4
assert triton_lora.splits_for(1, 64, 48) == 1  # K of less than two chunks: no split

# a tiny Llama through PEFT's adapters, the deltas through the kernels: PEFT's float32 tokens
from pushkv.config import LoraConfig, LoraModule
from pushkv.model import build_model
from pushkv.model.checkpoint import model_config_from_hf
from tests.model.test_hf_reference import save_hf_checkpoint
from tests.model.test_lora import NAMES, PROMPTS, run_pairs
from tests.model.test_model import new_pool
from tests.support.lora_adapters import ADAPTERS, peft_reference, save_adapter
root = tempfile.mkdtemp()
base = save_hf_checkpoint(os.path.join(root, "base"), "llama", seed=3)
paths = {n: save_adapter(base, os.path.join(root, n), seed=i, **f) for i, (n, f) in enumerate(ADAPTERS.items())}
want = {n: peft_reference(base, paths.get(n), PROMPTS) for n in NAMES}
cfg = model_config_from_hf(base, engine="batched")
cfg = msgspec.structs.replace(cfg, lora=LoraConfig(True, tuple(LoraModule(n, p) for n, p in paths.items()), max_loras=2))
model = build_model(cfg, device=dev)
calls = []
real = triton_lora.add_delta
triton_lora.add_delta = lambda *a: calls.append(1) or real(*a)
lora.KERNELS = True
pairs = [(ids, slot) for slot in range(len(NAMES)) for ids in PROMPTS]
pool = new_pool(model, 2 * len(pairs), 16).to(dev)
for (ids, slot), got in zip(pairs, run_pairs(model, pairs, pool)):
    assert got == want[NAMES[slot]][PROMPTS.index(ids)], (NAMES[slot], ids)
assert calls, "no delta went through the kernels"
print("ok", dev, len(calls))
"""


@pytest.mark.unit
def test_the_kernels_delta_equals_torchs_and_gives_pefts_tokens():
    run_kernel_script(SCRIPT, timeout_s=600)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("bt", [16, 64])
def test_the_kernels_compile_for_an_h100(dtype, bt):
    """Both kernels compiled for sm_90 by Triton's own compiler and its bundled ptxas, on the CPU (no GPU): what the
    interpreter above does not check. Each skipping the slots no row uses and not; the expand with the rows' slots
    kept as bits and without."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pushkv.model.kernels import triton_lora as tl_

    ieee = dtype == "fp32"
    ints = ("T", "K", "N", "W", "O", "stride_x", "stride_y", "KS")
    ptrs = {"X": dtype, "A": dtype, "B": dtype, "Y": dtype, "Slots": "i32", "P": "fp32"}

    def compile_one(fn, consts):
        sig = {p.name: "constexpr" if p.is_constexpr else "i32" if p.name in ints else f"*{ptrs[p.name]}"
               for p in fn.params}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3))

    for skip in (True, False):  # a bank of many slots (those no row uses skipped), and of one
        shrink = compile_one(tl_._shrink_kernel, dict(BT=bt, BN=tl_.BN, BK=tl_.BK, IEEE=ieee, SKIP=skip))
        assert shrink.asm["cubin"]
    for skip, bits in ((True, True), (True, False), (False, False)):
        expand = compile_one(tl_._expand_kernel, dict(SPLITS=4, BT=bt, BN=tl_.BN, BO=tl_.BO, IEEE=ieee, SKIP=skip,
                                                      BITS=bits))
        assert expand.asm["cubin"]
