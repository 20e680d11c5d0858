"""A checkpoint's default sampling: generation_config.json's fields as vLLM takes them (``--generation-config auto``),
and vLLM's ``--override-generation-config`` over them. Pure: no torch, so the launcher reads them for a preset too."""
from __future__ import annotations

import math
import os

import msgspec

from pushkv.config import SamplingDefaults, json_object
from pushkv.limits import MAX_PENALTY, MAX_REPETITION_PENALTY

# --generation-config's words: the checkpoint's file, or none of it (vLLM's "vllm"; "none", pushkv's older spelling);
# anything else names a directory holding a generation_config.json
NAMED = ("auto", "vllm", "none")


def uses_defaults(source: str) -> bool:
    """Whether --generation-config ``source`` gives sampling defaults (the checkpoint's, or a directory's)."""
    return source not in ("vllm", "none")


def folder_config(source: str) -> dict:
    """``--generation-config DIR``: DIR's generation_config.json, as vLLM reads it there (its sampling defaults, its
    max_new_tokens a bound on every request, its EOS ids stopped on); refused, naming it, where DIR has none (vLLM
    would take nothing from it, and a mistyped path is the likelier cause)."""
    where = os.path.join(source, "generation_config.json")
    if not os.path.isfile(where):
        why = "no such directory" if not os.path.isdir(source) else "it holds no generation_config.json"
        raise ValueError(f"--generation-config {source}: {why} (auto: the checkpoint's; vllm: none of it; or a "
                         "directory holding a generation_config.json)")
    with open(where) as f:
        return dict(json_object(f.read(), where, "generation settings"))  # (a copy: json_object's are cached)


def folder_defaults(source: str, gen: dict) -> SamplingDefaults:
    """A --generation-config DIR's sampling defaults; its max_new_tokens bounds every request, as vLLM's does."""
    d = sampling_defaults_of(gen, where=os.path.join(source, "generation_config.json"))
    return msgspec.structs.replace(d, max_tokens_cap=d.max_tokens)


# generation_config.json field: (SamplingDefaults field, type, range check, range text): what vLLM takes from it
DEFAULT_FIELDS = {
    "temperature": ("temperature", float, lambda v: 0 <= v <= 100, "[0, 100]"),
    "top_p": ("top_p", float, lambda v: 0 < v <= 1, "(0, 1]"),
    "top_k": ("top_k", int, lambda v: v >= -1, ">= -1 (-1, 0: off)"),
    "min_p": ("min_p", float, lambda v: 0 <= v <= 1, "[0, 1]"),
    "max_new_tokens": ("max_tokens", int, lambda v: v >= 1, ">= 1"),
    "repetition_penalty": ("repetition_penalty", float, lambda v: 0 < v <= MAX_REPETITION_PENALTY,
                           f"(0, {MAX_REPETITION_PENALTY:g}]"),
    "presence_penalty": ("presence_penalty", float, lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
                         f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
    "frequency_penalty": ("frequency_penalty", float, lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
                          f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
}
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # applied by greedy draws too
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # the penalty none at all


def sampling_defaults_of(gen: dict, path: str = "", where: str = "") -> SamplingDefaults:
    """The sampling defaults a checkpoint's generation_config.json sets. ``do_sample: false``
    means greedy (as transformers' generate), whatever temperature or top_p it also names."""
    where = where or f"{path}/generation_config.json"
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
    if gen.get("do_sample") is False:  # greedy; transformers' greedy still applies a repetition penalty
        out = {k: v for k, v in out.items() if k == "max_tokens" or k in PENALTIES}
    for key, neutral in NEUTRAL.items():
        if out.get(key) == neutral:
            out.pop(key)
    return SamplingDefaults(**out)


def overridden_defaults(base: SamplingDefaults, override: str, folder: bool = False) -> SamplingDefaults:
    """vLLM's ``--override-generation-config``: a JSON object of generation_config.json's sampling fields, each
    replacing ``base``'s (the checkpoint's, a directory's, or none); ``top_k`` -1 or 0 turns a default top_k off. Its
    max_new_tokens bounds every request, as vLLM's (``folder``: --generation-config DIR, whose bound is the merged
    max_new_tokens). A field vLLM does not take from generation_config.json, or a value out of range, is refused
    naming it."""
    where = "--override-generation-config"
    given = json_object(override, where, "sampling fields")
    unknown = sorted(set(given) - set(DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not a sampling field it sets (it takes "
                         f"{', '.join(DEFAULT_FIELDS)})")
    named = {k: v for k, v in given.items() if v is not None}
    fields = msgspec.structs.asdict(sampling_defaults_of(named, where=where))
    if given.get("top_k") in (-1, 0):
        fields["top_k"] = 0  # off, whatever the checkpoint says
    for key, neutral in NEUTRAL.items():  # a penalty given as none at all turns the checkpoint's off
        if key in named and named[key] == neutral:
            fields[key] = float(neutral)
    out = msgspec.structs.replace(base, **{k: v for k, v in fields.items() if v is not None})
    if folder or fields.get("max_tokens") is not None:
        out = msgspec.structs.replace(out, max_tokens_cap=out.max_tokens)
    return out
