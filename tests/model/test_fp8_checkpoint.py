"""Block-scaled FP8 checkpoints (pushkv/model/fp8.py), as DeepSeek and Qwen ship them: config.json's
quantization_config is read and anything but block-scaled e4m3 with dynamic activations is refused by field and
value; a weight's slice, whole or a TP rank's (rows or columns, on or off a block's edge), is its float8 values
times its block's scale; and a tiny checkpoint written by transformers and quantized as the FP8 releases are
gives the float32 tokens transformers gives loading that same FP8 checkpoint (it dequantizes on the CPU), dense
and MoE, in both engines."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from pushkv.model import build_model
from pushkv.model.checkpoint import CheckpointSource, model_config_from_hf
from pushkv.model.fp8 import dequantize, fp8_blocks_of, scale_span
from pushkv.model.tokenizer import get_tokenizer
from tests.model.test_architectures import CASES, NEW
from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint
from tests.model.test_model import new_pool, paged_generate

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# the projections the FP8 releases quantize (the router and the LM head, embeddings and norms stay as they are)
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
E4M3_MAX = 448.0


def naive(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element times its block's scale, one element at a time (the definition)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = q[i, j].float() * scale[i // block[0], j // block[1]].float()
    return out


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale a block): each block's largest magnitude maps to e4m3's 448."""
    br, bc = block
    R, C = w.shape
    sr, sc = -(-R // br), -(-C // bc)
    padded = torch.zeros(sr * br, sc * bc, dtype=torch.float32)
    padded[:R, :C] = w.float()
    blocks = padded.reshape(sr, br, sc, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(sr * br, sc * bc)[:R, :C]
    return q.contiguous(), scale


def quantize_checkpoint(path: str, block: tuple[int, int]) -> int:
    """Rewrite a checkpoint's projection weights as float8_e4m3fn with one float32 scale a block and say so in
    config.json, as the FP8 releases are; the number of weights quantized."""
    f = os.path.join(path, "model.safetensors")
    sd, out, n = load_file(f), {}, 0
    for name, w in sd.items():
        if QUANTIZED.search(name):
            out[name], out[name + "_scale_inv"] = quantize(w, block)
            n += 1
        else:
            out[name] = w
    save_file(out, f, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
        hf = json.load(fh)
    hf["quantization_config"] = dict(FP8, weight_block_size=list(block))
    with open(cfg_path, "w") as fh:
        json.dump(hf, fh, indent=1)
    return n


@pytest.mark.unit
@pytest.mark.parametrize("q, needle", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    (dict(FP8, fmt="e5m2"), "fmt 'e5m2'"),
    (dict(FP8, activation_scheme="static"), "activation_scheme 'static'"),
    ({k: v for k, v in FP8.items() if k != "weight_block_size"}, "weight_block_size None"),
    (dict(FP8, weight_block_size=[128]), r"weight_block_size \[128\]"),
    (dict(FP8, weight_block_size=[0, 128]), r"weight_block_size \[0, 128\]"),
    ("fp8", "quantization_config: 'fp8'"),
])
def test_other_quantizations_are_refused_by_field_and_value(q, needle):
    with pytest.raises(ValueError, match=needle):
        fp8_blocks_of({"quantization_config": q})


@pytest.mark.unit
def test_block_scaled_fp8_is_read():
    assert fp8_blocks_of({"quantization_config": FP8}) == (128, 128)
    assert fp8_blocks_of({"quantization_config": dict(FP8, weight_block_size=[64, 32])}) == (64, 32)
    assert fp8_blocks_of({}) is None and fp8_blocks_of({"quantization_config": None}) is None


@pytest.mark.unit
@pytest.mark.parametrize("block", [(16, 16), (8, 24)])
def test_a_slice_on_or_off_the_blocks_edges_is_its_values_times_their_scales(block):
    torch.manual_seed(0)
    w = torch.randn(40, 56) * 0.3  # neither dimension a whole number of blocks
    q, scale = quantize(w, block)
    whole = naive(q, scale, block)
    assert (whole - w).abs().max() < 0.1 * w.abs().max()  # e4m3's rounding, not another weight
    assert torch.equal(dequantize(q, scale, block), whole)
    for (r0, r1), (c0, c1) in [((0, 40), (0, 56)), ((5, 37), (0, 56)), ((0, 40), (9, 50)), ((16, 24), (24, 48)),
                               ((39, 40), (55, 56))]:
        (s0, s1), (t0, t1) = scale_span(r0, r1, block[0]), scale_span(c0, c1, block[1])
        got = dequantize(q[r0:r1, c0:c1], scale[s0:s1, t0:t1], block, r0, c0)
        assert torch.equal(got, whole[r0:r1, c0:c1]), ((r0, r1), (c0, c1))
    with pytest.raises(ValueError, match="does not cover"):
        dequantize(q[:, :], scale[:1], block)


@pytest.mark.unit
def test_the_source_dequantizes_each_tp_slice_and_refuses_fp8_without_scales(tmp_path):
    block = (16, 32)
    torch.manual_seed(1)
    w = torch.randn(48, 96)
    q, scale = quantize(w, block)
    whole = naive(q, scale, block)
    tensors = {"a.weight": q, "a.weight_scale_inv": scale, "norm.weight": torch.ones(48),
               "b.weight": q.clone()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": dict(FP8, weight_block_size=[16, 32])}))
    src = CheckpointSource(str(tmp_path))
    assert src.fp8_blocks == block
    assert torch.equal(src.get("a.weight"), whole)
    for ranks in (2, 3, 4):  # rows (q/k/v, gate/up) and columns (o, down) as TP ranks take them: 24, 16 or 12
        for dim in (0, 1):
            n = whole.shape[dim] // ranks
            for r in range(ranks):
                want = whole[r * n:(r + 1) * n] if dim == 0 else whole[:, r * n:(r + 1) * n]
                assert torch.equal(src.get("a.weight", dim, r * n, (r + 1) * n), want), (ranks, dim, r)
    assert torch.equal(src.get("norm.weight"), torch.ones(48))
    with pytest.raises(ValueError, match="'b.weight' is torch.float8_e4m3fn with no 'b.weight_scale_inv'"):
        src.get("b.weight")


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3_moe", "mixtral"])
def fp8_case(request, tmp_path_factory):
    pytest.importorskip("accelerate")  # transformers loads an fp8 checkpoint only with it
    family, extra, _ = CASES[request.param]
    path = save_hf_checkpoint(str(tmp_path_factory.mktemp("fp8_" + request.param)), family, seed=3, **extra)
    n = quantize_checkpoint(path, (16, 32))
    assert n >= 7 * 2  # every layer's projections
    return path, hf_reference(path, PROMPTS)


@pytest.mark.parametrize("engine", ["per-seq", "batched"])
def test_fp8_checkpoint_tokens_equal_transformers(fp8_case, engine):
    path, want = fp8_case
    cfg = model_config_from_hf(path, engine=engine)
    model, tok = build_model(cfg), get_tokenizer(cfg)
    for prompt, (ids, new) in zip(PROMPTS, want):
        assert tok.encode(prompt) == ids
        got = paged_generate(model, new_pool(model, 8, 16), ids, NEW, tuple(range(8)))
        stop = got.index(3) + 1 if 3 in got else len(got)
        assert got[:stop] == new, prompt


def test_fp8_weights_are_the_scaled_values_not_the_raw_ones(fp8_case):
    """The loaded weights are the float8 values times their scales (raw float8 values would be ~448 / amax times
    larger), and they differ from the unquantized checkpoint's by e4m3's rounding only."""
    path, _ = fp8_case
    src = CheckpointSource(path)
    name = next(n for n in src.weight_map if QUANTIZED.search(n))
    raw = src._file(name).get_tensor(name).float()
    got = src.get(name)
    assert got.abs().max() < raw.abs().max() / 10
    assert not torch.equal(got, raw)


def test_startup_says_the_fp8_weights_are_dequantized(fp8_case):
    from pushkv.config_flags import weights_note

    path, _ = fp8_case
    note = weights_note(model_config_from_hf(path))
    assert note.endswith("; block-scaled fp8 (16x32) dequantized to float32 at load)"), note
