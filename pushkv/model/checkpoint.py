"""Local Hugging Face checkpoints (LlamaForCausalLM, Qwen3ForCausalLM) in safetensors.

Tensors are read lazily and sliced on read, so a tensor-parallel rank only pulls
its own rows/columns out of the files.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors import safe_open

from pushkv.config import ModelConfig

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


def model_config_from_hf(path: str, **overrides) -> ModelConfig:
    """ModelConfig of a local HF checkpoint directory; overrides replace any field
    (e.g. dtype="float32" to run a bf16 checkpoint in float32)."""
    hf = _read_config(path)
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs} in {path}; "
                         f"supported: {sorted(ARCHITECTURES)}")
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {scaling} is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in HF_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}")
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
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
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        dtype=HF_DTYPES[dtype],
        qk_norm=ARCHITECTURES[arch],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        checkpoint=os.path.abspath(path),
        eos_token_id=-1 if eos is None else int(eos),
        sliding_window=int(hf.get("sliding_window") or 0) if windows else 0,
        window_layers=windows,
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
