"""RoPE frequencies: plain, and the scaled schemes checkpoints carry (``linear``, ``dynamic``,
Llama 3's ``llama3``, ``yarn``), read from config.json and turned into one cos/sin table.

Every engine path (per-sequence, batched, the fused kernels, the dense reference) takes its
table from :func:`cos_sin`, so a scheme is written once.

``dynamic`` (NTK) as transformers runs it: a forward over a sequence of length S (its last new
position + 1) rotates its new tokens with a base grown for S once S passes the pretraining context
(``max_position_embeddings``), and the keys it caches keep that rotation. A decode token at position
p is therefore rotated for length p + 1 (row p of :func:`cos_sin`'s table), while a prompt's tokens
take the whole prompt's length, however the prompt is chunked (:func:`dynamic_spans` names the rows
the table does not hold).
"""
from __future__ import annotations

import json
import math
from typing import Iterable

import torch

from pushkv.config import RopeScaling
from pushkv.kinds import RopeType

ROPE_THETA_DEFAULT = 10000.0  # what transformers assumes when a config names none
ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


def _params(hf: dict) -> dict:
    """The one RoPE parameter mapping of a config, in either form transformers writes: the
    top-level ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5),
    possibly per layer type (refused when the layer types differ)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters {params!r} is not a mapping")
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) > 1:
            raise ValueError(f"RoPE parameters that differ by layer type are not supported: {params}")
        params = next(iter(params.values()))
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling {scaling!r} is not a mapping")
    kinds = {where: p.get("rope_type", p.get("type")) for where, p in
             (("rope_parameters", params), ("rope_scaling", scaling))}
    if kinds["rope_parameters"] not in (None, "default") and kinds["rope_scaling"] not in (None, "default") \
            and kinds["rope_parameters"] != kinds["rope_scaling"]:
        raise ValueError(f"config.json names two RoPE types: rope_parameters {kinds['rope_parameters']!r} "
                         f"and rope_scaling {kinds['rope_scaling']!r}")
    # rope_parameters' own scheme wins; a transformers-4 rope_scaling fills in a plain one
    merged = {**params, **scaling} if kinds["rope_parameters"] in (None, "default") else dict(params)
    kind = merged.get("rope_type", merged.get("type")) or "default"
    if kind not in ROPE_TYPES:
        where = "rope_scaling" if kinds["rope_scaling"] == kind else "rope_parameters"
        raise ValueError(f"{where}: rope_type {kind!r} is not implemented (implemented: "
                         f"{', '.join(ROPE_TYPES)}); its frequencies differ from these")
    merged["rope_type"] = kind
    return merged


def rope_of(hf: dict) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of an HF config; what pushkv does not build is refused by name."""
    params = _params(hf)
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"rope_parameters: partial_rotary_factor "
                         f"{params.get('partial_rotary_factor', hf.get('partial_rotary_factor'))} "
                         "is not implemented (rotary embedding over the whole head only)")
    top, nested = hf.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json names two RoPE bases: rope_theta {top} and "
                         f"rope_parameters.rope_theta {nested}")
    theta = nested if nested is not None else top
    theta = ROPE_THETA_DEFAULT if theta is None else float(theta)
    kind = params["rope_type"]
    if kind == "default":
        return theta, RopeScaling()
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings") or 0)
    if kind == "yarn" and not original:
        original = int(hf.get("max_position_embeddings") or 0)
    if kind == "dynamic":  # transformers grows the base past max_position_embeddings, whatever else is named
        original = int(hf.get("max_position_embeddings") or 0)
    if factor is None and kind == "yarn" and original:  # DeepSeek-V3 style: the ratio of the contexts
        factor = hf["max_position_embeddings"] / original
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1:
        raise ValueError(f"rope_parameters: rope_type {kind!r} needs a factor >= 1, got {factor!r}")
    if kind in ("llama3", "yarn", "dynamic") and original <= 0:
        needs = "max_position_embeddings" if kind == "dynamic" else "original_max_position_embeddings"
        raise ValueError(f"rope_parameters: rope_type {kind!r} needs {needs}")
    out = dict(rope_type=kind, factor=float(factor), original_max_position=original if kind != "linear" else 0)
    if kind == "llama3":
        out.update(low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)))
        if not out["high_freq_factor"] > out["low_freq_factor"]:
            raise ValueError(f"rope_parameters: llama3 high_freq_factor {out['high_freq_factor']} must exceed "
                             f"low_freq_factor {out['low_freq_factor']}")
    if kind == "yarn":
        att = params.get("attention_factor")
        if att is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            att = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                   else _mscale(factor))
        out.update(beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                   attention_factor=float(att), truncate=bool(params.get("truncate", True)))
    return theta, RopeScaling(**out)


def max_position_of(hf: dict, rs: RopeScaling) -> int:
    """The longest sequence the model serves, as vLLM derives its max_model_len: ``max_position_embeddings``,
    stretched by the factor of a linear or dynamic scaling, and for YaRN the pretraining context times the factor
    (Qwen2.5's 32k with YaRN 4: 128k); llama3's scaling is already in max_position_embeddings."""
    n = int(hf.get("max_position_embeddings", 32768))
    if rs.rope_type in ("linear", "dynamic"):
        return int(n * rs.factor)
    if rs.rope_type == "yarn":
        return int((rs.original_max_position or n) * rs.factor)
    return n


def derived_max_len_of(hf: dict, rs: RopeScaling) -> int:
    """vLLM 0.32's derived max_model_len where it is below :func:`max_position_of`'s (0 where they agree): under
    YaRN, ``max_position_embeddings`` as it stands, which vLLM takes as already stretched (as transformers'
    ``_compute_yarn_parameters`` does) and so does not multiply by the factor; a longer --max-model-len it refuses
    unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    if rs.rope_type != "yarn":
        return 0
    n = int(hf.get("max_position_embeddings", 32768))
    return n if n < max_position_of(hf, rs) else 0


def max_position_text(max_position: int, rs: RopeScaling) -> str:
    """How :func:`max_position_of` came to ``max_position``, in config.json's words (a refusal names it)."""
    if rs.rope_type in ("linear", "dynamic"):
        base = round(max_position / rs.factor)
        return f"max_position_embeddings {base} x its {rs.rope_type} RoPE factor {rs.factor:g}"
    if rs.rope_type == "yarn":
        return (f"its YaRN RoPE's original_max_position_embeddings {round(max_position / rs.factor)} x factor "
                f"{rs.factor:g}")
    return f"max_position_embeddings {max_position}"


def _mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 ln(s) + 1 for a stretch s > 1 (the paper's sqrt(1/t))."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def dynamic_theta(theta: float, dim: int, rs: RopeScaling, length: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's base for sequences of these lengths (float64, any shape): theta up to the
    pretraining context M, then theta * (factor * S / M - (factor - 1)) ** (dim / (dim - 2))."""
    ctx = rs.original_max_position
    s = length.to(torch.float64).clamp(min=ctx)
    return theta * (rs.factor * s / ctx - (rs.factor - 1)) ** (dim / (dim - 2))


def inv_freq(theta: float, dim: int, rs: RopeScaling, length: int = 0) -> torch.Tensor:
    """float64 [dim / 2]: each rotated pair's angle per position (dynamic: in a sequence of
    ``length`` tokens; up to the pretraining context, plain RoPE's)."""
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if rs.rope_type == "dynamic":
        return 1.0 / dynamic_theta(theta, dim, rs, torch.tensor(float(length))) ** exps
    base = 1.0 / theta ** exps
    if rs.rope_type == "linear":  # positions stretched by factor: every frequency slowed alike
        return base / rs.factor
    if rs.rope_type == "llama3":
        # Wavelengths longer than the pretraining context / low_freq_factor are slowed by factor,
        # shorter than context / high_freq_factor kept; those between blend the two linearly in
        # context / wavelength.
        wavelen = 2 * math.pi / base
        ctx = rs.original_max_position
        blend = (ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mixed = (1 - blend) * base / rs.factor + blend * base
        out = torch.where(wavelen > ctx / rs.low_freq_factor, base / rs.factor, mixed)
        return torch.where(wavelen < ctx / rs.high_freq_factor, base, out)
    if rs.rope_type == "yarn":
        # Dims that turn fewer than beta_slow times over the pretraining context are interpolated
        # (slowed by factor), more than beta_fast times extrapolated (kept), a linear ramp between.
        def dim_of(turns: float) -> float:
            return dim * math.log(rs.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
        if rs.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # a zero-width ramp would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp
        return base / rs.factor * (1 - keep) + base * keep
    return base


def cos_sin(theta: float, dim: int, rs: RopeScaling, positions: int,
            device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, dim] (rotate-half layout: each angle twice), in dtype on device.
    Dynamic: row p as a decode step at p rotates it, in a sequence of p + 1 tokens."""
    pos = torch.arange(positions, dtype=torch.float64)
    return _cos_sin(theta, dim, rs, pos, pos + 1, device, dtype)


def cos_sin_rows(theta: float, dim: int, rs: RopeScaling, start: int, stop: int, length: int,
                 device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [stop - start, dim] of positions [start, stop) in a sequence of ``length`` tokens."""
    pos = torch.arange(start, stop, dtype=torch.float64)
    return _cos_sin(theta, dim, rs, pos, torch.full_like(pos, float(length)), device, dtype)


def _cos_sin(theta, dim, rs, pos: torch.Tensor, length: torch.Tensor, device, dtype):
    if rs.rope_type == "dynamic":
        exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        ang = pos[:, None] / dynamic_theta(theta, dim, rs, length)[:, None] ** exps[None, :]
    else:
        ang = torch.outer(pos, inv_freq(theta, dim, rs))
    ang = torch.cat((ang, ang), dim=-1)
    scale = rs.attention_factor if rs.rope_type == "yarn" else 1.0
    return (ang.cos() * scale).to(device, dtype), (ang.sin() * scale).to(device, dtype)


def seq_spans(seqs) -> list[tuple[int, int, int]]:
    """(start position, count, RoPE length) of each of a step's SeqWork, in order."""
    return [(s.start_pos, len(s.token_ids), max(s.rope_len, s.start_pos + len(s.token_ids))) for s in seqs]


def dynamic_spans(rs: RopeScaling, seqs: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """The rows a step must rotate for a length other than their own position + 1 (where
    :func:`cos_sin`'s table has them): (first row, start position, count, length) for each
    (start position, count, length) of the step's sequences, packed in order, whose length
    passes the pretraining context. Empty unless RoPE is dynamic."""
    if rs.rope_type != "dynamic":
        return []
    out, row = [], 0
    for start, n, length in seqs:
        if length > rs.original_max_position and start + 1 < length:
            out.append((row, start, n, length))
        row += n
    return out
