"""vLLM's LoRA flags (--enable-lora, --lora-modules, --max-loras, --max-lora-rank) as the user's LoraConfig, each
adapter resolved and checked against the model at launch (``model/lora_files.py``); a ``--config`` file's
``model.lora`` is read as the flags that say it (``lora_flags``). Called by ``config_flags.user_config``."""
from __future__ import annotations

import json
from typing import Any, Mapping, cast, get_args

import msgspec

from pushkv.config import LoraConfig, LoraModule, ModelConfig, json_object
from pushkv.kinds import MaxLoraRank


def lora_modules(given: list[str]) -> list[LoraModule]:
    """vLLM's --lora-modules: each NAME=PATH, or a JSON object with name, path and (optionally) base_model_name and
    is_3d_lora_weight (vLLM's MoE expert layout: taken, the experts' adapters being refused by lora_files anyway); an
    empty item is skipped, as vLLM's LoRAParserAction skips it."""
    out = []
    for item in given:
        if not item:
            continue
        if item.lstrip().startswith("{"):
            obj = json_object(item, "--lora-modules", "name, path and base_model_name")
            unknown = set(obj) - {"name", "path", "base_model_name", "is_3d_lora_weight"}
            if unknown or not all(isinstance(obj.get(k), str) and obj.get(k) for k in ("name", "path")):
                raise ValueError(f"--lora-modules {item}: a JSON object of name, path (strings) and base_model_name"
                                 + (f", not {sorted(unknown)}" if unknown else ""))
            out.append(LoraModule(obj["name"], obj["path"], str(obj.get("base_model_name") or "")))
            continue
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: NAME=PATH, or a JSON object with name and path")
        out.append(LoraModule(name, path))
    return out


def lora_flags(lora: LoraConfig) -> dict[str, Any]:
    """A config file's LoraConfig as the flags that say it (each adapter in the JSON form, its path as given)."""
    return {"enable_lora": True, "max_loras": lora.max_loras, "max_lora_rank": lora.max_rank,
            "lora_modules": [json.dumps({"name": m.name, "path": m.given or m.path,
                                         **({"base_model_name": m.base_model_name} if m.base_model_name else {})})
                             for m in lora.modules]}


def lora_config(flags: Mapping[str, Any], model: ModelConfig, served: list[str]) -> LoraConfig:
    """vLLM's --enable-lora, --lora-modules, --max-loras and --max-lora-rank as a LoraConfig, each adapter's path
    resolved (a Hub id through huggingface_hub) and its files checked against the model now (lora_files.py)."""
    f = flags.get
    given = f("lora_modules") or []
    enabled = bool(f("enable_lora"))
    if not enabled:
        for flag in ("lora_modules", "max_loras", "max_lora_rank"):
            if f(flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
        return LoraConfig()
    given_loras, given_rank = f("max_loras"), f("max_lora_rank")
    max_loras = 1 if given_loras is None else int(given_loras)
    max_rank = 16 if given_rank is None else int(given_rank)
    if max_loras < 1:
        raise ValueError(f"--max-loras {max_loras}: at least 1")
    ranks = get_args(MaxLoraRank)
    if max_rank not in ranks:  # vLLM's LoRAConfig takes these ranks only (its argparse choices)
        raise ValueError(f"--max-lora-rank: invalid choice: {max_rank} (choose from {', '.join(map(str, ranks))})")
    cpu_loras = f("vllm_max_cpu_loras")  # no effect here, but vLLM's LoRAConfig refuses it below --max-loras
    if cpu_loras is not None and int(cpu_loras) < max_loras:
        raise ValueError(f"--max-cpu-loras ({cpu_loras}) must be >= --max-loras ({max_loras}), as vLLM's")
    from pushkv.model.lora_files import resolve_adapter

    modules: list[LoraModule] = []
    for mod in lora_modules(given):
        if mod.name in served or any(mod.name == other.name for other in modules):
            raise ValueError(f"--lora-modules {mod.name}: the name is given twice, or is the served model's")
        if mod.base_model_name and mod.base_model_name not in served:
            raise ValueError(f"--lora-modules {mod.name}: base_model_name {mod.base_model_name!r} is not served "
                             f"(served: {served})")
        path = resolve_adapter(mod.name, mod.path, model, max_rank, f("download_dir"))
        modules.append(msgspec.structs.replace(mod, path=path, given=mod.path))
    return LoraConfig(True, tuple(modules), max_loras, cast(MaxLoraRank, max_rank))
