"""Block-scaled FP8 checkpoints, as DeepSeek and Qwen ship them (``Qwen/Qwen3-30B-A3B-FP8``):
config.json says ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``, and each quantized weight ``W`` [rows, cols] (float8_e4m3fn) sits beside
``W_scale_inv`` [ceil(rows / 128), ceil(cols / 128)] (float32), one scale a block: the weight is ``W * scale``.

pushkv dequantizes at load, as transformers does where it has no FP8 kernels: each slice a rank takes is
multiplied out in float32 and then cast to the model's dtype, so the weights take the model dtype's memory (a
bf16 copy, twice the FP8 bytes) and the tokens are those of the dequantized model. Anything else named by a
``quantization_config`` is refused by field and value before a process starts.
"""
from __future__ import annotations

from typing import Optional

import torch

SCALE_SUFFIX = "_scale_inv"  # the scale tensor's name: the weight's name and this


def fp8_blocks_of(hf: dict) -> Optional[tuple[int, int]]:
    """The (rows, cols) of a scale block where config.json asks for block-scaled FP8 weights, None where it asks
    for no quantization; a ValueError naming the field and value for any other quantization."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config: {q!r} is not supported")
    method = q.get("quant_method", q.get("format"))
    if method != "fp8":
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported: pushkv loads float32, "
                         "bfloat16 and float16 weights, and block-scaled fp8 (quant_method 'fp8' with "
                         "weight_block_size), which it dequantizes at load")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config: activation_scheme {scheme!r} is not supported (only 'dynamic': "
                         "the weights are dequantized and the activations stay in the model's dtype)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config: weight_block_size {block!r} is not supported (two positive "
                         "integers; per-tensor and per-channel fp8 are not built)")
    # weights the checkpoint left unquantized (its ignored_layers / modules_to_not_convert: the router, the LM head)
    # ship with no scale and load as they are
    return int(block[0]), int(block[1])


def scale_span(start: int, end: int, block: int) -> tuple[int, int]:
    """The scale rows (or columns) that cover elements [start, end) of a blocked dimension."""
    return start // block, -(-end // block)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int = 0,
               col0: int = 0) -> torch.Tensor:
    """float32 ``q * scale`` of a 2-D slice ``q`` of a block-scaled weight whose first element is the weight's
    (row0, col0); ``scale``: the scale rows and columns that cover the slice (``scale_span``)."""
    if q.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"fp8 weight {tuple(q.shape)} and scale {tuple(scale.shape)}: 2-D tensors expected")
    br, bc = block
    r_off, c_off = row0 % br, col0 % bc  # the slice's place within its first block
    rows, cols = q.shape
    s = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    if s.shape[0] < r_off + rows or s.shape[1] < c_off + cols:
        raise ValueError(f"fp8 scale {tuple(scale.shape)} does not cover a weight slice {tuple(q.shape)} at "
                         f"({row0}, {col0}) in blocks of {block}")
    return q.float() * s[r_off:r_off + rows, c_off:c_off + cols]
