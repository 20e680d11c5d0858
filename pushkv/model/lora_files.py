"""A LoRA adapter's files, as PEFT saves them and vLLM's ``--lora-modules`` takes them, read and checked against
the model before any process starts. Pure: JSON and the safetensors header, no torch (the launcher runs it).

An adapter directory holds ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``use_rslora``...)
and ``adapter_model.safetensors``, whose tensors are named
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]).
pushkv serves adapters on the attention's q, k, v and o projections and a dense MLP's gate, up and down; whatever
else an adapter holds (an MoE layer's experts or router, the embeddings, the LM head, ``modules_to_save``, DoRA's
magnitudes, biases, per-module ranks) is refused by name.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Optional

from pushkv.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may carry, with the block each sits in
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_HEADER_MAX = 64 << 20  # a safetensors header past this is no adapter's


class AdapterNotFound(ValueError):
    """No adapter at the path: no such directory or Hub repo, or no adapter_config.json in it (vLLM's
    LoRAAdapterNotFoundError, a 404 from /v1/load_lora_adapter)."""


@dataclass(frozen=True)
class AdapterInfo:
    """What serving needs of one adapter: where it is, its rank and scale, and its tensors' names by
    (layer, module, "A" | "B")."""

    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r)), folded into B at load
    tensors: dict[tuple[int, str, str], str]

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m, _ in self.tensors)


def safetensors_shapes(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype, from the file's header alone (ValueError if it is no safetensors file)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header's length)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_MAX:
            raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path}: not a safetensors file (its header is no JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is no JSON object)")
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def _in_out(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """A projection's input and output widths in the whole model."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return {"q_proj": (d, cfg.num_heads * hd), "k_proj": (d, cfg.num_kv_heads * hd),
            "v_proj": (d, cfg.num_kv_heads * hd), "o_proj": (cfg.num_heads * hd, d),
            "gate_proj": (d, mlp_width(cfg)), "up_proj": (d, mlp_width(cfg)),
            "down_proj": (mlp_width(cfg), d)}[module]


def mlp_width(cfg: ModelConfig) -> int:
    """A dense layer's MLP width (an MoE model's dense first layers have their own)."""
    return cfg.dense_intermediate_size if cfg.is_moe else cfg.intermediate_size


def _config(path: str, name: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            conf = json.load(f)
    except FileNotFoundError:
        raise AdapterNotFound(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT adapter "
                              "directory)") from None
    except ValueError as e:
        raise ValueError(f"LoRA adapter {name!r}: {file} is not JSON: {e}") from None
    except OSError as e:  # unreadable (its permissions, a directory of that name)
        raise ValueError(f"LoRA adapter {name!r}: {file} cannot be read: {e.strerror or e}") from None
    if not isinstance(conf, dict):
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    return conf


def _refusal(conf: dict, max_rank: int) -> str:
    """Why an adapter_config.json asks for what is not served ("" if nothing)."""
    peft_type = str(conf.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        return f"peft_type {conf.get('peft_type')!r}: only LORA adapters are served"
    r = conf.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        return f"r {r!r}: a positive integer rank"
    if r > max_rank:
        return f"r {r} is past --max-lora-rank {max_rank}: raise --max-lora-rank"
    alpha = conf.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        return f"lora_alpha {alpha!r}: a number"
    for field, why in (("use_dora", "DoRA's magnitudes are not built"),
                       ("modules_to_save", "whole modules saved beside the adapter are not served"),
                       ("rank_pattern", "a rank per module is not built"),
                       ("alpha_pattern", "an alpha per module is not built"),
                       ("fan_in_fan_out", "transposed (Conv1D) weights are no projection served here"),
                       ("use_qalora", "QA-LoRA is not built")):
        if conf.get(field):
            return f"{field} {conf[field]!r}: {why}"
    if conf.get("bias", "none") not in ("none", None):
        return f"bias {conf['bias']!r}: adapters with biases are not served (bias 'none')"
    return ""


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> AdapterInfo:
    """``path``'s adapter, checked against the model: ValueError naming the adapter and the field, tensor or
    shape that is not served, before anything loads."""
    if cfg.is_mla:
        raise ValueError(f"LoRA adapter {name!r}: adapters on MLA attention ({cfg.architecture or cfg.name}) are not "
                         "built")
    conf = _config(path, name)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(path, f))]
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}"
                         + (f" ({other[0]}: pushkv reads safetensors only)" if other else ""))
    try:
        shapes = safetensors_shapes(file)
    except OSError as e:
        raise ValueError(f"LoRA adapter {name!r}: {file} cannot be read: {e.strerror or e}") from None
    places = {key: _place(name, key, cfg) for key in shapes}  # what it adapts, refused first: the clearest reason
    why = _refusal(conf, max_rank)
    if why:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {why}")
    r = int(conf["r"])
    alpha = float(conf.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    tensors: dict[tuple[int, str, str], str] = {}
    for key, (shape, dtype) in shapes.items():
        layer, module, ab = places[key]
        tensors[(layer, module, ab)] = key
        fan_in, fan_out = _in_out(cfg, module)
        want = (r, fan_in) if ab == "A" else (fan_out, r)
        if shape != want:
            raise ValueError(f"LoRA adapter {name!r}: {key} is {list(shape)}, where this model and r {r} make "
                             f"{list(want)}")
        if dtype not in ("F32", "F16", "BF16"):
            raise ValueError(f"LoRA adapter {name!r}: {key} is {dtype}; F32, F16 or BF16 are read")
    if not tensors:
        raise ValueError(f"LoRA adapter {name!r}: {file} holds no LoRA tensor")
    for layer, module, ab in list(tensors):
        pair = "B" if ab == "A" else "A"
        if (layer, module, pair) not in tensors:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {module} has lora_{ab} without lora_{pair}")
    return AdapterInfo(name, path, r, scale, tensors)


def resolve_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, cache_dir: Optional[str] = None,
                    flag: str = "--lora-modules") -> str:
    """The adapter's local directory (a Hub id resolved as --model's is, its adapter files only), checked against the
    model (``read_adapter``); ValueError naming ``flag`` and what is wrong (AdapterNotFound where no adapter is
    there)."""
    from pushkv.model.hub import resolve

    if os.path.exists(path) and not os.path.isdir(path):  # something is there, and it is no adapter (vLLM: a 500)
        raise ValueError(f"LoRA adapter {name!r}: {path} is a file, not an adapter directory")
    try:
        local = resolve(path, files=[CONFIG_FILE, WEIGHTS_FILE], cache_dir=cache_dir, flags=(flag, "--revision"))
    except ValueError as e:
        raise AdapterNotFound(str(e)) from None
    read_adapter(name, local, cfg, max_rank)
    return local


def _place(name: str, key: str, cfg: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of an adapter tensor's name, or ValueError naming what it adapts."""
    m = _KEY.fullmatch(key)
    if ".experts." in key or re.search(r"\.mlp\.(gate|shared_expert_gate)\.lora_", key):
        raise ValueError(f"LoRA adapter {name!r}: {key}: adapters on an MoE layer's experts or router are not built "
                         "(attention adapters are served on MoE models)")
    if m is None or m.group(3) not in MODULES or MODULES[m.group(3)] != m.group(2):
        raise ValueError(f"LoRA adapter {name!r}: {key}: only the attention's q/k/v/o_proj and a dense MLP's "
                         "gate/up/down_proj adapters are served")
    layer, module = int(m.group(1)), m.group(3)
    if layer >= cfg.num_layers:
        raise ValueError(f"LoRA adapter {name!r}: {key}: the model has {cfg.num_layers} layers")
    if module in ("gate_proj", "up_proj", "down_proj") and cfg.is_moe and layer >= cfg.dense_layers:
        raise ValueError(f"LoRA adapter {name!r}: {key}: layer {layer}'s MLP is a mixture of experts; adapters on "
                         "experts are not built (attention adapters are served on MoE models)")
    return layer, module, m.group(4)
