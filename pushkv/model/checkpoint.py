"""Local Hugging Face checkpoints in safetensors, or pytorch_model.bin (the architectures of pushkv.model.arch).

Tensors are read lazily and sliced on read, so a tensor-parallel rank only pulls
its own rows/columns out of the files.
"""
from __future__ import annotations

import json
import math
import os
import zipfile
from typing import Any, Optional

import torch
from safetensors import safe_open

from pushkv.config import ModelConfig, MoeRouting, SamplingDefaults, json_object
from pushkv.model import generation
from pushkv.model.arch import Family, check_supported, deepseek_routing, family_of, num_experts_of
from pushkv.model.fp8 import SCALE_SUFFIX, dequantize, fp8_blocks_of, scale_span
from pushkv.model.generation import sampling_defaults_of
from pushkv.model.rope import derived_max_len_of, max_position_of, rope_of

HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
GEOMETRY = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "qk_norm", "tie_embeddings", "qkv_bias", "num_experts",
            "experts_per_token", "architecture")


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def with_overrides(hf: dict, overrides: str) -> dict:
    """config.json's fields with vLLM's ``--hf-overrides`` (a JSON object) over them, each replacing the field of
    its name. RoPE's are read in either form transformers writes: ``rope_theta`` replaces the base in
    ``rope_parameters`` too, and ``rope_scaling`` takes the place of a ``rope_parameters`` scaling (the base kept),
    so the override is what is served. ``quantization_config`` is refused: the weights are read as they were
    written."""
    if not overrides:
        return hf
    where = "--hf-overrides"
    given = json_object(overrides, where, "config.json fields")
    if "quantization_config" in given:
        raise ValueError(f"{where}: quantization_config cannot be overridden: the weights are read as written")
    out = {**hf, **given}
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in given or "rope_scaling" in given) and "rope_parameters" \
            not in given:
        nested = params if not params or not all(isinstance(v, dict) for v in params.values()) else None
        if nested is None:
            raise ValueError(f"{where}: this config's RoPE is set per layer type (rope_parameters): override "
                             "rope_parameters itself")
        theta = given.get("rope_theta", nested.get("rope_theta"))
        out["rope_parameters"] = {**({} if "rope_scaling" in given else nested),
                                  **(given.get("rope_scaling") or {}),
                                  **({"rope_theta": theta} if theta is not None else {})}
        out.pop("rope_scaling", None)
        if "rope_type" not in out["rope_parameters"] and "type" not in out["rope_parameters"]:
            out["rope_parameters"]["rope_type"] = "default"
    return out


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


def _checked(hf: dict, family: Family) -> dict:
    """config.json with the sizes a model cannot be built without checked (a positive integer each, refused by name
    otherwise), and where it leaves them out ``max_position_embeddings`` and the RoPE base the family's transformers
    defaults (what transformers and vLLM run with)."""
    keys = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
            family.moe.inter_key if family.moe else "intermediate_size"]
    given = {"max_position_embeddings": family.max_positions, **hf}
    params = hf.get("rope_parameters")
    nested = isinstance(params, dict) and any(k == "rope_theta" or isinstance(v, dict) for k, v in params.items())
    if hf.get("rope_theta") is None and not nested:
        given["rope_theta"] = family.rope_theta
    for key in [*keys, "max_position_embeddings"]:
        v = given.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            fix = (" (the model's longest sequence: --hf-overrides '{\"max_position_embeddings\": N}' gives it)"
                   if key == "max_position_embeddings" else "")
            raise ValueError(f"{key} {'missing' if key not in given else json.dumps(v)}: a positive integer is "
                             f"needed{fix}")
    eps = given.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps {json.dumps(eps)}: a number between 0 and 1 is needed")
    return given


def model_config_from_hf(path: str, generation_config: str = "auto", hf_overrides: str = "",
                         **overrides) -> ModelConfig:
    """ModelConfig of a local HF checkpoint directory; overrides replace any field
    (e.g. dtype="float32" to run a bf16 checkpoint in float32). Its EOS ids come from
    config.json and generation_config.json; its sampling defaults from the second, unless
    ``generation_config`` is "vllm" or "none", or from a directory's generation_config.json that it names, its EOS
    ids too (vLLM's ``--generation-config``: model/generation.py). ``hf_overrides``: vLLM's ``--hf-overrides``,
    config.json's fields read over the file's (``with_overrides``)."""
    hf = with_overrides(_read_config(path), hf_overrides)
    folder = generation_config not in generation.NAMED
    gen = generation.folder_config(generation_config) if folder else _read_generation_config(path)
    try:
        arch, family = family_of(hf)
        check_supported(hf, arch, family)
        hf = _checked(hf, family)
        rope_theta, rope_scaling = rope_of(hf)
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}") from None
    heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in HF_DTYPES:
        raise ValueError(f"{path}/config.json: dtype {dtype!r} is not supported (supported: {', '.join(HF_DTYPES)})")
    eos = eos_ids_of(hf, gen, hf["vocab_size"], path)
    windows = family.windows(hf, num_layers)
    moe = family.moe
    fields = dict(
        name=os.path.basename(os.path.normpath(path)),
        num_layers=num_layers,
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf[moe.inter_key] if moe else hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position=max_position_of(hf, rope_scaling),
        derived_max_len=derived_max_len_of(hf, rope_scaling),
        rope_theta=rope_theta,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        dtype=HF_DTYPES[dtype],
        qk_norm=family.qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        checkpoint=os.path.abspath(path),
        eos_token_id=eos[0] if eos else -1,
        sliding_window=int(hf.get("sliding_window") or 0) if windows else 0,
        window_layers=windows,
        eos_token_ids=eos,
        sampling_defaults=(generation.folder_defaults(generation_config, gen) if folder
                           else sampling_defaults_of(gen, path) if generation.uses_defaults(generation_config)
                           else SamplingDefaults()),
        architecture=arch,
        hf_overrides=hf_overrides,
        qkv_bias=family.qkv_bias,
        rope_scaling=rope_scaling,
        num_experts=num_experts_of(hf) if moe else 0,
        experts_per_token=int(hf["num_experts_per_tok"]) if moe else 0,
        norm_topk_prob=bool(hf.get(moe.norm_topk_key, False)) if moe and moe.norm_topk_key else True,
    )
    if family.mla:
        fields.update(deepseek_fields(hf, arch, rope_scaling))
    elif moe is not None and moe.shared_gate:  # Qwen2-MoE: one gated shared expert; its q/k/v bias as configured
        fields.update(shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0), shared_gate=True,
                      qkv_bias=bool(hf.get("qkv_bias", True)))
    fields.update(overrides)
    return ModelConfig(**fields)


def deepseek_fields(hf: dict, arch: str, rope_scaling) -> dict:
    """A DeepSeek-V2/V3 config's fields beyond the shared ones: MLA (its latent, RoPE and query widths, the query
    LoRA, the softmax scale with YaRN's mscale), and its MoE (the routing, the shared experts, the dense first
    layers)."""
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scoring, method = deepseek_routing(hf, arch)
    scale = (nope + rope) ** -0.5
    raw = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor, all_dim = float(raw.get("factor") or 1.0), raw.get("mscale_all_dim")
    if rope_scaling.rope_type != "default" and all_dim and factor > 1:  # YaRN's mscale, squared, on the softmax
        scale *= (0.1 * float(all_dim) * math.log(factor) + 1.0) ** 2
    groups = 1 if method == "greedy" else int(hf.get("n_group") or 1)
    routing = MoeRouting(scoring="sigmoid" if scoring == "sigmoid" else "softmax", groups=groups,
                         topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
                         group_score="top2" if method == "noaux_tc" else "max", bias=method == "noaux_tc",
                         scale=float(hf.get("routed_scaling_factor") or 1.0))
    return dict(
        head_dim=nope, num_kv_heads=1, kv_lora_rank=int(hf["kv_lora_rank"]), qk_rope_dim=rope,
        q_lora_rank=int(hf.get("q_lora_rank") or 0), attn_scale=scale,
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)), routing=routing,
        shared_intermediate_size=int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"]),
        dense_layers=int(hf.get("first_k_dense_replace") or 0), dense_intermediate_size=int(hf["intermediate_size"]),
    )


def fp8_blocks_in(path: str) -> Optional[tuple[int, int]]:
    """The scale blocks of a checkpoint directory's block-scaled fp8 weights (pushkv/model/fp8.py), or None."""
    return fp8_blocks_of(_read_config(path)) if os.path.exists(os.path.join(path, "config.json")) else None


# the weight files a checkpoint directory may hold, in the order vLLM's ``--load-format auto`` prefers them: an index
# of shards, or one file; safetensors first, else PyTorch's pickled state dicts
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def weight_map_of(path: str) -> dict[str, str]:
    """Tensor name -> the file of ``path`` that holds it: safetensors where there are any, else
    ``pytorch_model.bin`` (vLLM falls back to it too). FileNotFoundError naming the files looked for."""
    for index, single in WEIGHT_FILES:
        if os.path.exists(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted(f for f in set(weight_map.values()) if not os.path.exists(os.path.join(path, f)))
            if missing:  # (each worker would stop at the first tensor it reads from one, the deployment up)
                raise FileNotFoundError(f"{path}: {index} names {len(missing)} file(s) that are not there "
                                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an "
                                        "interrupted download? Fetch the checkpoint again")
            return weight_map
        if os.path.exists(os.path.join(path, single)):
            if single.endswith(".bin"):
                return {k: single for k in _bin(os.path.join(path, single))}
            with safe_open(os.path.join(path, single), framework="pt") as f:
                return {k: single for k in f.keys()}
    names = " or ".join(n for pair in WEIGHT_FILES for n in pair)
    raise FileNotFoundError(f"{path}: no weights: none of {names}")


def _bin(file: str) -> dict[str, torch.Tensor]:
    """A pytorch_model*.bin state dict through torch's weights-only unpickler (tensors and plain containers, no code,
    as vLLM loads it): mapped rather than read (a rank slices what it keeps) where it is of torch.save's zip format;
    one of the legacy format (torch before 1.6, or ``_use_new_zipfile_serialization=False``), which torch cannot map,
    read whole, as vLLM reads every .bin."""
    return torch.load(file, map_location="cpu", mmap=zipfile.is_zipfile(file), weights_only=True)


class _BinSlices:
    """A tensor of a .bin file behind safetensors' slice interface (get_slice's ``get_shape`` and ``[...]``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def get_slice(self, name: str) -> "_BinSlice":
        return _BinSlice(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _BinSlice:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.t[index].clone()  # (a copy: the mapped file's pages are not kept alive by the model)


class CheckpointSource:
    """WeightSource over a checkpoint directory's weight files (``weight_map_of``): safetensors, one or sharded, or
    pytorch_model.bin, one or sharded."""

    def __init__(self, path: str):
        self.path = path
        self.weight_map = weight_map_of(path)
        self._files: dict = {}
        self.fp8_blocks = fp8_blocks_in(path)  # block-scaled fp8 weights, dequantized as each slice is taken

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            file = os.path.join(self.path, fname)
            self._files[fname] = _BinSlices(_bin(file)) if fname.endswith(".bin") else safe_open(file, framework="pt")
        return self._files[fname]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dim: int = 0, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements [start, end) along ``dim`` (0 or 1) of a tensor; a block-scaled fp8 weight's multiplied out
        by its scales (float32)."""
        sl = self._file(name).get_slice(name)
        shape = sl.get_shape()
        end = shape[dim] if end is None else end
        t = sl[start:end] if dim == 0 else sl[:, start:end]
        scale_name = name + SCALE_SUFFIX
        if self.fp8_blocks is not None and scale_name in self.weight_map:
            if len(shape) != 2:
                raise ValueError(f"{self.path}: weight {name!r} of shape {shape} has a block scale: 2-D expected")
            (r0, r1), (c0, c1) = ((start, end), (0, shape[1])) if dim == 0 else ((0, shape[0]), (start, end))
            (sr0, sr1), (sc0, sc1) = (scale_span(r0, r1, self.fp8_blocks[0]), scale_span(c0, c1, self.fp8_blocks[1]))
            scale = self._file(scale_name).get_slice(scale_name)[sr0:sr1, sc0:sc1]
            try:
                return dequantize(t, scale, self.fp8_blocks, r0, c0)
            except ValueError as e:
                raise ValueError(f"{self.path}: weight {name!r}: {e}") from None
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{self.path}: weight {name!r} is {t.dtype} with no {scale_name!r} beside it "
                             "(block-scaled fp8 needs config.json's quantization_config and a scale a weight)")
        return t


def checkpoint_source(cfg: ModelConfig) -> CheckpointSource:
    """The weights of cfg.checkpoint, after checking cfg's geometry matches it."""
    if cfg.checkpoint is None:
        raise ValueError("the model config names no checkpoint")
    hf = model_config_from_hf(cfg.checkpoint, hf_overrides=cfg.hf_overrides)
    bad = [f"{k}: config {getattr(cfg, k)} vs checkpoint {getattr(hf, k)}"
           for k in GEOMETRY if getattr(cfg, k) != getattr(hf, k)]
    if bad:
        raise ValueError(f"config does not match checkpoint {cfg.checkpoint} "
                         f"(build it with model_config_from_hf): " + "; ".join(bad))
    return CheckpointSource(cfg.checkpoint)
