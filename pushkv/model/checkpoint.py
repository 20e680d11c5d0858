"""Local Hugging Face checkpoints (LlamaForCausalLM, Qwen3ForCausalLM) in safetensors.

Tensors are read lazily and sliced on read, so a tensor-parallel rank only pulls
its own rows/columns out of the files.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional

import torch
from safetensors import safe_open

from pushkv.config import ModelConfig, SamplingDefaults

log = logging.getLogger(__name__)

ARCHITECTURES = {"LlamaForCausalLM": False, "Qwen3ForCausalLM": True}  # -> qk_norm
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
GEOMETRY = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "qk_norm", "tie_embeddings")


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def _window_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    types = hf.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = hf.get("max_window_layers", 0)
        return tuple(range(first, num_layers))
    return ()


ROPE_TYPES = ("default",)  # rotary embeddings implemented; scaled variants (linear, llama3, yarn...) are not
ROPE_THETA_DEFAULT = 10000.0  # what transformers assumes when a config names none


def rope_theta_of(hf: dict) -> float:
    """RoPE base of an HF config, in either form transformers writes: ``rope_theta`` at
    the top level (transformers 4) or ``rope_parameters: {rope_theta, rope_type}``
    (transformers 5). A ``rope_type`` other than ``default`` (in ``rope_parameters`` or
    the older ``rope_scaling``) is refused by name: its frequencies differ from plain RoPE."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters {params!r} is not a mapping")
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) > 1:
            raise ValueError(f"RoPE parameters that differ by layer type are not supported: {params}")
        params = next(iter(params.values()))
    for where, p in (("rope_parameters", params), ("rope_scaling", hf.get("rope_scaling") or {})):
        kind = p.get("rope_type", p.get("type")) if isinstance(p, dict) else p
        if kind not in (None, *ROPE_TYPES):
            raise ValueError(f"{where}: rope_type {kind!r} is not implemented (implemented: "
                             f"{', '.join(ROPE_TYPES)}); its frequencies differ from plain RoPE")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope_parameters: partial_rotary_factor {params['partial_rotary_factor']} "
                         "is not implemented (rotary embedding over the whole head only)")
    top, nested = hf.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json names two RoPE bases: rope_theta {top} and "
                         f"rope_parameters.rope_theta {nested}")
    theta = nested if nested is not None else top
    return ROPE_THETA_DEFAULT if theta is None else float(theta)


GENERATION_CONFIG = ("auto", "none")  # --generation-config: the file's sampling defaults, or pushkv's


def _read_generation_config(path: str) -> dict:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return {}
    with open(gen_path) as f:
        gen = json.load(f)
    if not isinstance(gen, dict):
        raise ValueError(f"{gen_path} is not a JSON object")
    return gen


def _token_ids(v: Any, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` as transformers writes it: absent, an int, or a list of ints."""
    if v is None:
        return ()
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return tuple(v)
    raise ValueError(f"{where}: eos_token_id {v!r} is neither a token id nor a list of them")


def eos_ids_of(hf: dict, gen: dict, vocab_size: int, path: str = "") -> tuple[int, ...]:
    """Every EOS id, config.json's first and then generation_config.json's (vLLM stops on both;
    transformers' generate on the second file's where it exists, else the first's)."""
    ids = _token_ids(hf.get("eos_token_id"), f"{path}/config.json")
    ids += _token_ids(gen.get("eos_token_id"), f"{path}/generation_config.json")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{path}: EOS token id {outside[0]} outside the vocabulary [0, {vocab_size})")
    return tuple(dict.fromkeys(ids))


# generation_config.json field: (SamplingDefaults field, type, range check, range text); what
# pushkv can sample with (vLLM takes the same, and repetition_penalty, which pushkv does not have)
DEFAULT_FIELDS = {
    "temperature": ("temperature", float, lambda v: 0 <= v <= 100, "[0, 100]"),
    "top_p": ("top_p", float, lambda v: 0 < v <= 1, "(0, 1]"),
    "top_k": ("top_k", int, lambda v: v >= -1, ">= -1 (-1, 0: off)"),
    "min_p": ("min_p", float, lambda v: 0 <= v <= 1, "[0, 1]"),
    "max_new_tokens": ("max_tokens", int, lambda v: v >= 1, ">= 1"),
}


def sampling_defaults_of(gen: dict, path: str = "") -> SamplingDefaults:
    """The sampling defaults a checkpoint's generation_config.json sets. ``do_sample: false``
    means greedy (as transformers' generate), whatever temperature or top_p it also names."""
    where = f"{path}/generation_config.json"
    out: dict = {}
    for key, (name, typ, ok, text) in DEFAULT_FIELDS.items():
        v = gen.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
            raise ValueError(f"{where}: {key} must be {'an integer' if typ is int else 'a number'}, got {v!r}")
        if (isinstance(v, float) and not math.isfinite(v)) or not ok(v):
            raise ValueError(f"{where}: {key} must be {text}, got {v} (or serve with --generation-config none)")
        out[name] = typ(v)
    if out.get("top_k") in (-1, 0):
        out.pop("top_k")
    if gen.get("do_sample") is False:
        out = {k: v for k, v in out.items() if k == "max_tokens"}
    rp = gen.get("repetition_penalty")
    if isinstance(rp, (int, float)) and rp != 1:
        log.warning("%s: repetition_penalty %s is not applied (pushkv has presence/frequency_penalty only)",
                    where, rp)
    return SamplingDefaults(**out)


def model_config_from_hf(path: str, generation_config: str = "auto", **overrides) -> ModelConfig:
    """ModelConfig of a local HF checkpoint directory; overrides replace any field
    (e.g. dtype="float32" to run a bf16 checkpoint in float32). Its EOS ids come from
    config.json and generation_config.json; its sampling defaults from the second, unless
    ``generation_config`` is "none" (vLLM's ``--generation-config``)."""
    if generation_config not in GENERATION_CONFIG:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG}, got {generation_config!r}")
    hf = _read_config(path)
    gen = _read_generation_config(path)
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs} in {path}; "
                         f"supported: {sorted(ARCHITECTURES)}")
    try:
        rope_theta = rope_theta_of(hf)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in HF_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}")
    eos = eos_ids_of(hf, gen, hf["vocab_size"], path)
    windows = _window_layers(hf, num_layers)
    fields = dict(
        name=os.path.basename(os.path.normpath(path)),
        num_layers=num_layers,
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position=hf.get("max_position_embeddings", 32768),
        rope_theta=rope_theta,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        dtype=HF_DTYPES[dtype],
        qk_norm=ARCHITECTURES[arch],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        checkpoint=os.path.abspath(path),
        eos_token_id=eos[0] if eos else -1,
        sliding_window=int(hf.get("sliding_window") or 0) if windows else 0,
        window_layers=windows,
        eos_token_ids=eos,
        sampling_defaults=sampling_defaults_of(gen, path) if generation_config == "auto" else SamplingDefaults(),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


class SafetensorsSource:
    """WeightSource over model.safetensors or a sharded model.safetensors.index.json."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path = path
        self.weight_map = weight_map
        self._files: dict = {}

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = safe_open(os.path.join(self.path, fname), framework="pt")
        return self._files[fname]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dim: int = 0, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        sl = self._file(name).get_slice(name)
        size = sl.get_shape()[dim]
        end = size if end is None else end
        if dim == 0:
            return sl[start:end]
        return sl[:, start:end]


def checkpoint_source(cfg: ModelConfig) -> SafetensorsSource:
    """The weights of cfg.checkpoint, after checking cfg's geometry matches it."""
    hf = model_config_from_hf(cfg.checkpoint)
    bad = [f"{k}: config {getattr(cfg, k)} vs checkpoint {getattr(hf, k)}"
           for k in GEOMETRY if getattr(cfg, k) != getattr(hf, k)]
    if bad:
        raise ValueError(f"config does not match checkpoint {cfg.checkpoint} "
                         f"(build it with model_config_from_hf): " + "; ".join(bad))
    return SafetensorsSource(cfg.checkpoint)
