"""The user's config: what ``pushkv up``'s flags and ``--config`` file say, as a DeploymentConfig.

Two configs, kept apart: the *user's* (built here: the mode, model, shapes and switches asked
for, every field left unsaid at its default) and the *planned* one the launcher derives from it
(``supervisor.plan.plan_deployment``: ids, the run dir, ports and endpoints, each instance's copy
and devices), which is what every child process reads. A user's config never holds a planned
field unless a config file pins it (``config.PLANNED_FIELDS``). The argument parser stays in
``processes/cli.py``; this module reads the parsed flags as a mapping (``vars(args)``), so a
test can give the flags it means and leave the rest out.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional, get_args

import msgspec

from pushkv import envs, otlp, tls, uds, vllm_serve
from pushkv import log_config as log_config_mod
from pushkv.config import (
    PRESETS,
    TRACE_AUTO,
    DeploymentConfig,
    InstanceConfig,
    ModelConfig,
    config_from_builtins,
    json_object,
    preset,
)
from pushkv.cuda_driver import capability as gpu_capability
from pushkv.cuda_driver import device_count
from pushkv.kinds import ToolCallParser
from pushkv.lora_flags import lora_config, lora_flags
from pushkv.model import generation
from pushkv.protocol import kv_events

# the flags that override a preset's (or a checkpoint's) geometry, each named as its ModelConfig field
GEOMETRY = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
            "vocab_size", "dtype", "seed")


def load_config_file(path: str) -> DeploymentConfig:
    """A JSON or TOML file of DeploymentConfig fields; ``"model": "tiny"`` names a preset, and an
    instance table may leave out its ``role``."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(raw.decode())
    else:
        data = json.loads(raw)
    if isinstance(data.get("model"), str):
        data["model"] = msgspec.to_builtins(preset(data["model"]))
    for role in ("prefill", "decode", "local"):
        if isinstance(data.get(role), dict):
            data[role].setdefault("role", role)
    return config_from_builtins(data)


def _replace(obj, **changes):
    """``obj`` with the changes that were given (None: the flag was not)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    return msgspec.structs.replace(obj, **changes) if changes else obj


def _preset_named(name: Optional[str]) -> bool:
    """``--model NAME`` names a random-weight shape: a preset, unless a directory of that name is here."""
    return bool(name) and name in PRESETS and not os.path.isdir(str(name))


def model_name(flags: Mapping[str, Any]) -> Optional[str]:
    """--model, or ``pushkv up MODEL`` as ``vllm serve MODEL`` takes it; the two must agree."""
    name, tag = flags.get("model"), flags.get("model_tag")
    if name and tag and name != tag:
        raise ValueError(f"the model is given twice: {tag!r} and --model {name!r}")
    return name or tag


def hf_overrides(flags: Mapping[str, Any]) -> str:
    """vLLM's --hf-overrides with --rope-scaling and --rope-theta folded in, as one JSON object ("": none)."""
    out = json_object(flags["hf_overrides"], "--hf-overrides", "config.json fields") if flags.get("hf_overrides") \
        else {}
    for flag, key in (("rope_scaling", "rope_scaling"), ("rope_theta", "rope_theta")):
        v = flags.get(flag)
        if v is None:
            continue
        if flag == "rope_scaling":
            v = json_object(v, "--rope-scaling", "RoPE scaling fields")
        if key in out and out[key] != v:
            raise ValueError(f"--{flag.replace('_', '-')} disagrees with --hf-overrides' {key}")
        out[key] = v
    return json.dumps(out) if out else ""


def auto_dtype(checkpoint: str, capability: Optional[tuple[int, int]]) -> str:
    """vLLM's --dtype auto on a GPU of ``capability`` (``_resolve_auto_dtype``: the platform's dtypes, bfloat16 from
    compute capability 8.0, float16 from 6.0): a float32 checkpoint runs in the first the GPU has, a checkpoint in
    one the GPU has keeps it, another (bfloat16 before Ampere) takes the first. ``capability`` None: not known,
    taken as Ampere's or later."""
    major, minor = capability or (8, 0)
    supported = (["bfloat16"] if (major, minor) >= (8, 0) else []) + (["float16"] if major >= 6 else []) + ["float32"]
    if checkpoint == "float32":
        return supported[0]
    return checkpoint if checkpoint in supported else supported[0]


def _model(flags: Mapping[str, Any], base: ModelConfig, on_cuda: bool = False, weights: bool = True,
           capability: Optional[tuple[int, int]] = None) -> ModelConfig:
    """The model the flags name; ``on_cuda``: an instance runs on a GPU (--dtype auto's choice there, by its
    ``capability``: ``auto_dtype``); ``weights``: this host loads them (not a router host, which reads the config
    and the tokenizer only)."""
    name, dummy = model_name(flags), flags.get("load_format") == "dummy"
    geometry = {k: flags.get(k) for k in GEOMETRY}
    if geometry["dtype"] == "auto":  # vLLM's --dtype auto: the checkpoint's (a preset's own)
        geometry["dtype"] = None
    if geometry["dtype"] in ("half", "float"):  # vLLM's names for them
        geometry["dtype"] = {"half": "float16", "float": "float32"}[geometry["dtype"]]
    path = flags.get("checkpoint")  # deprecated spelling of --model DIR
    if path and name and os.path.abspath(str(name)) != os.path.abspath(str(path)):
        raise ValueError(f"--model {name} and --checkpoint {path} name two models: give --model {path} alone (the "
                         "checkpoint's config.json is its shape)")
    if name and not path and not _preset_named(name):
        from pushkv.model.hub import SERVE_FILES, SHAPE_FILES, resolve

        patterns = SHAPE_FILES if dummy else SERVE_FILES if flags.get("load_format") == "safetensors" else None
        path = resolve(name, flags.get("revision"), patterns, cache_dir=flags.get("download_dir"))
    elif flags.get("revision"):
        raise ValueError(f"--revision {flags['revision']!r} needs --model to name a Hugging Face repo id")
    if path:  # the checkpoint's config.json is the geometry; flags may still override
        from pushkv.model.checkpoint import model_config_from_hf

        given = {k: v for k, v in geometry.items() if v is not None}
        if name and not flags.get("checkpoint") and not os.path.isdir(name):  # a repo id: its name, not the cache's
            given.setdefault("name", name)
        model = model_config_from_hf(path, flags.get("generation_config") or "auto", hf_overrides(flags), **given)
        if on_cuda and "dtype" not in given:
            # vLLM's --dtype auto on a GPU: a float32 checkpoint runs in bfloat16 (half the memory and bandwidth),
            # in float16 before Ampere, as a bfloat16 checkpoint does there; --dtype float32 keeps it
            model = msgspec.structs.replace(model, dtype=auto_dtype(model.dtype, capability))
        quantization = flags.get("vllm_quantization")
        if quantization and quantization.lower() == "fp8":
            from pushkv.model.checkpoint import fp8_blocks_in

            if not fp8_blocks_in(path):
                raise ValueError(f"--quantization {quantization}: {name} is not a block-scaled fp8 checkpoint, and "
                                 "quantizing one at load is not built (serve an fp8 release, or leave the flag out)")
        if dummy:  # vLLM's dummy load: the checkpoint's shape and tokenizer, random weights
            model = msgspec.structs.replace(model, checkpoint=None, tokenizer=model.checkpoint)
        elif weights:  # weights that are not there are refused now, not in every worker once the pools are up
            from pushkv.model.checkpoint import weight_map_of

            try:
                files = set(weight_map_of(path).values())
            except FileNotFoundError as e:
                raise ValueError(f"--model {name or path}: {e} (--load-format dummy serves its shape with random "
                                 "weights)") from None
            if flags.get("load_format") == "safetensors" and not any(f.endswith(".safetensors") for f in files):
                raise ValueError(f"--load-format safetensors: --model {name or path} has no safetensors, only "
                                 f"{min(files)} (--load-format auto reads it, as vLLM's)")
    else:
        if hf_overrides(flags):
            raise ValueError("--hf-overrides, --rope-scaling and --rope-theta read over a checkpoint's config.json: "
                             "give --model a checkpoint (a preset's shape is set by its flags)")
        model = _replace(preset(name) if name else base, **geometry)
    if flags.get("tokenizer") or flags.get("tokenizer_revision"):
        from pushkv.model.hub import TOKENIZER_FILES, resolve

        # vLLM's: the tokenizer (default: --model's) at --tokenizer-revision, else at its default revision
        source = flags.get("tokenizer") or name
        if not source or (not flags.get("tokenizer") and (path is None or _preset_named(source))):
            raise ValueError(f"--tokenizer-revision {flags['tokenizer_revision']!r} needs --tokenizer or --model to "
                             "name a Hugging Face repo id")
        model = msgspec.structs.replace(model, tokenizer=resolve(
            source, flags.get("tokenizer_revision"), TOKENIZER_FILES, cache_dir=flags.get("download_dir"),
            flags=("--tokenizer", "--tokenizer-revision")))
    source = flags.get("generation_config") or "auto"
    folder = source not in generation.NAMED
    if folder and not path:  # a shape: the directory's sampling defaults (its EOS ids are a tokenizer's business)
        model = msgspec.structs.replace(model, sampling_defaults=generation.folder_defaults(
            source, generation.folder_config(source)))
    if flags.get("override_generation_config"):
        model = msgspec.structs.replace(model, sampling_defaults=generation.overridden_defaults(
            model.sampling_defaults, flags["override_generation_config"], folder))
    invariant = flags.get("batch_invariant")
    return _replace(model, engine=flags.get("engine"), random_init=flags.get("random_init"),
                    deterministic=None if invariant is None else invariant == "on",
                    cuda_graphs=False if flags.get("enforce_eager") else None)


def check_tokenizer(model: ModelConfig, flag: str) -> None:
    """The router reads the model's tokenizer from a tokenizer.json (the ``tokenizers`` library's); a directory
    without one (a SentencePiece tokenizer.model only, or no tokenizer at all) is refused now, where the router would
    die with a traceback once every worker had loaded its weights."""
    where = model.tokenizer or model.checkpoint
    if not where or os.path.exists(os.path.join(where, "tokenizer.json")):
        return
    held = ", ".join(f for f in ("tokenizer.model", "vocab.json", "tokenizer_config.json")
                     if os.path.exists(os.path.join(where, f)))
    raise ValueError(f"{flag} {where}: no tokenizer.json{f' (it holds {held})' if held else ''}: "
                     "pushkv reads a fast tokenizer's tokenizer.json; give --tokenizer a directory or repo id that "
                     "has one (the base model's, for a fine-tune), or --skip-tokenizer-init to take token-id prompts")


def check_max_model_len(max_len: Optional[int], model: ModelConfig, where: str = "--max-model-len") -> None:
    """ValueError unless ``max_len`` (None: unsaid) fits ``model``: within its longest sequence, and, past vLLM 0.32's
    derived length (YaRN's max_position_embeddings), only with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. ``where``: the flag
    or the config file's field that said it, as the refusal names it."""
    if max_len is None:
        return
    from pushkv.model.rope import max_position_text

    if not 1 <= max_len <= model.max_position:
        raise ValueError(f"{where} {max_len} must be in [1, {model.max_position}]: the model's longest "
                         f"sequence ({max_position_text(model.max_position, model.rope_scaling)})")
    derived = model.derived_max_len  # vLLM 0.32's, below the YaRN length: longer only with its env var
    if derived and max_len > derived and not envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN:
        raise ValueError(f"{where} {max_len} is greater than the derived max_model_len "
                         f"(max_position_embeddings={derived} in the model's config.json, which vLLM does not stretch "
                         f"by YaRN's factor); as vLLM's, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to serve up "
                         f"to {model.max_position} ({max_position_text(model.max_position, model.rope_scaling)})")


def deprecations(flags: Mapping[str, Any]) -> list[str]:
    """One line per old spelling the flags use (each still works), saying the new one."""
    out = []
    if flags.get("checkpoint"):
        out.append(f"--checkpoint is deprecated: use --model {flags['checkpoint']}")
    if flags.get("tp") is not None:
        out.append(f"--tp is deprecated: use -tp/--tensor-parallel-size {flags['tp']} (every side; "
                   "--prefill-tp/--decode-tp override it)")
    name = flags.get("model") or flags.get("model_tag")
    if flags.get("load_format") != "dummy" and not flags.get("checkpoint") and not flags.get("config") \
            and (_preset_named(name) or not name):
        shape = name or PRESETS["small"].name
        out.append(f"{'--model ' + shape if name else 'no --model'} serves random weights; that this needs no "
                   f"--load-format dummy is deprecated: use --model {shape} --load-format dummy")
    return out


# transfer flags that only one mode reads ("" : every mode that moves KV)
_MODE_FLAGS = {"pull_read": "pull", "push_stream": "push", "push_stream_groups": "push", "kv_verify": "",
               "link_window": "", "link_window_mib": "", "link_order": "", "writer_post_thread": ""}


def unused_by_mode(flags: Mapping[str, Any], mode: str) -> list[str]:
    """One line per transfer flag given that the deployment's mode never reads (``--mode push --pull-read write``
    started as push, the flag dropped without a word)."""
    out = []
    for key, reads in _MODE_FLAGS.items():
        if flags.get(key) is None or (mode != "local" and reads in ("", mode)):
            continue
        out.append(f"--{key.replace('_', '-')} has no effect with --mode {mode}"
                   + (f" (only --mode {reads} reads it)" if reads else " (no KV moves between instances)"))
    return out


def weights_note(model: ModelConfig) -> str:
    """What ``pushkv up`` says at startup about where the weights come from."""
    if model.checkpoint:
        from pushkv.model.checkpoint import fp8_blocks_in

        blocks = fp8_blocks_in(model.checkpoint)
        fp8 = f"; block-scaled fp8 ({blocks[0]}x{blocks[1]}) dequantized to {model.dtype} at load" if blocks else ""
        return f"weights: {model.checkpoint} ({model.architecture}, {model.dtype}{fp8})"
    return (f"RANDOM weights (--load-format dummy): the {model.name!r} shape, seed {model.seed}, {model.dtype}; "
            "its tokens mean nothing")


def chat_template_text(given: str, where: str = "--chat-template") -> str:
    """``--chat-template`` (or a ``--config`` file's chat_template: ``where`` names it), as vLLM takes it: a file's
    path, or the Jinja template itself; compiled here, so a broken one is refused before anything starts."""
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            source = f.read()
    elif "{{" in given or "{%" in given:
        source = given
    else:
        raise ValueError(f"{where} {given!r}: no such file, and not a Jinja template either")
    from pushkv.router.chat import ChatTemplate

    # ValueError if it does not compile, naming the flag's template (a short one itself), or the file's field
    ChatTemplate(source, name=where if where != "--chat-template" or len(given) >= 80 else given)
    return source


def log_config_of(flag: Optional[str]) -> Optional[str]:
    """--log-config-file's dictConfig text, else VLLM_LOGGING_CONFIG_PATH's (as vLLM's: the flag's default); None:
    pushkv's own logging."""
    if flag:
        return log_config_mod.read(flag)
    if envs.VLLM_LOGGING_CONFIG_PATH:
        return log_config_mod.read(envs.VLLM_LOGGING_CONFIG_PATH, "VLLM_LOGGING_CONFIG_PATH")
    return None


def tool_parser(flags: Mapping[str, Any]) -> Optional[str]:
    """--tool-call-parser, as vLLM takes it beside --enable-auto-tool-choice (which alone is refused)."""
    parser = flags.get("tool_call_parser")
    if flags.get("enable_auto_tool_choice") and not parser:
        named = ", ".join(p for p in get_args(ToolCallParser) if p)
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({named}) to parse the calls")
    return parser


def default_device(flags: Mapping[str, Any], gpus: Callable[[], tuple[int, str]]) -> Optional[str]:
    """vLLM's device default: CUDA where the driver shows a GPU, else the CPU; None when a flag or
    a --config file says where (theirs stands)."""
    if flags.get("config") or any(flags.get(k) for k in ("device", "prefill_device", "decode_device")):
        return None
    return "cuda" if gpus()[0] > 0 else None


def _pool_sizes(cfg: DeploymentConfig, flags: Mapping[str, Any]) -> DeploymentConfig:
    """CUDA instances without --num-blocks (and without a --config file's say) get their pool sized
    from --gpu-memory-utilization at launch (num_blocks 0); that flag on a deployment with no CUDA
    instance is refused (a cpu pool is --num-blocks)."""
    insts = {"local": cfg.local} if cfg.mode == "local" else {"prefill": cfg.prefill, "decode": cfg.decode}
    if flags.get("gpu_memory_utilization") is not None and not any(i.device.startswith("cuda")
                                                                   for i in insts.values()):
        raise ValueError(f"--gpu-memory-utilization sizes KV pools on CUDA; every instance here is on "
                         f"{', '.join(sorted({i.device for i in insts.values()}))}, whose pool is --num-blocks "
                         f"(default {InstanceConfig(role='local').num_blocks}): drop the flag, or give --device cuda")
    if flags.get("num_blocks") is not None or flags.get("config"):
        return cfg
    return _replace(cfg, **{role: _replace(i, num_blocks=0 if i.device.startswith("cuda") else None)
                            for role, i in insts.items()})


def user_config(flags: Mapping[str, Any], gpus: Callable[[], tuple[int, str]] = device_count,
                capability: Callable[[], Optional[tuple[int, int]]] = gpu_capability) -> DeploymentConfig:
    """The user's config from ``pushkv up``'s parsed flags (``vars(args)``; a flag missing or None
    was not given): the ``--config`` file's, or the defaults, with every given flag on top.
    ``gpus`` counts this host's GPUs (the device's default); ``capability`` is the first one's compute capability
    (--dtype auto's choice, as vLLM's: None where unknown)."""
    path = flags.get("config")
    cfg = load_config_file(path) if path else DeploymentConfig()
    # vllm serve's spellings; --enable-chunked-prefill's chunk, where no flag says, is a step's tokens on the
    # instance that prefills, as the config file (or the default) sets them
    prefills = cfg.local if (flags.get("mode") or cfg.mode) == "local" else cfg.prefill
    sets, _ = vllm_serve.apply(flags, prefills.max_batch_tokens)
    flags = {**flags, **sets}
    f = flags.get
    secret, names = f("secret_file"), f("served_model_name")
    device = f("device") or default_device(flags, gpus)
    mode = f("mode") or cfg.mode
    devices = [device or cfg.local.device] if mode == "local" else [
        f("prefill_device") or device or cfg.prefill.device, f("decode_device") or device or cfg.decode.device]
    on_cuda = any(d.startswith("cuda") for d in devices)
    model = _model(flags, cfg.model, on_cuda=on_cuda, weights=(f("role") or cfg.host_role) != "router",
                   capability=capability() if on_cuda else None)
    if not (f("skip_tokenizer_init") or cfg.skip_tokenizer_init):
        check_tokenizer(model, "--tokenizer" if f("tokenizer") else "--model")
    given_name, aliases = model_name(flags), []
    if not names and given_name and not _preset_named(given_name):
        # vLLM's default: the --model string as given; the directory's name and path still answer, unlisted
        names = [given_name]
        aliases = [n for n in (model.name, model.checkpoint) if n and n != given_name]
    served = [*(names or [model.name]), *aliases]
    if cfg.model.lora.enabled:  # the --config file's adapters, read as the flags' are (a flag given wins)
        try:
            lora = lora_config({**flags, **{k: v for k, v in lora_flags(cfg.model.lora).items() if f(k) is None}},
                               model, served)
        except ValueError as e:
            raise ValueError(f"model.lora (--config {path}): {e}") from None
    else:
        lora = lora_config(flags, model, served)
    model = msgspec.structs.replace(model, lora=lora)
    given = f("max_model_len")
    # the length the deployment ends with, wherever it is said: the flag, else the --config file's (0 there: unsaid)
    max_len, where = (given, "--max-model-len") if given is not None else (
        cfg.max_model_len or None, f"max_model_len (--config {path})")
    check_max_model_len(max_len, model, where)
    if f("disable_sliding_window") and model.sliding_window:
        # vLLM's: every layer attends to the whole context, which is capped at the window (within it, the window's
        # attention and the whole context's are the same)
        window = model.sliding_window
        if max_len is not None and max_len > window:
            raise ValueError(f"{where} {max_len} with --disable-sliding-window: the context is capped at the "
                             f"sliding window, {window} tokens")
        max_len = max_len or window
        model = msgspec.structs.replace(model, sliding_window=0, window_layers=())
    if max_len is None and model.derived_max_len:
        max_len = model.derived_max_len  # vLLM's default: the derived length, not the YaRN-stretched one
    tp = f("tensor_parallel_size") or f("tp")  # --tp: the deprecated spelling
    sizes = dict(max_num_seqs=f("max_num_seqs"), max_batch_tokens=f("max_batch_tokens"),
                 prefill_chunk=f("prefill_chunk"), prefix_cache=False if f("no_prefix_cache") else None)
    trace = f("trace")
    cfg = _replace(
        cfg, mode=f("mode"), pull_read=f("pull_read"), push_stream=f("push_stream"),
        push_stream_groups=f("push_stream_groups"), kv_verify=f("kv_verify"),
        # a host of several (--role) serves on its advertised address unless --host says otherwise
        host=f("host") or (f("role") and f("advertise")), port=f("port"), metrics_port=f("metrics_port"),
        uds=_path(f("uds")), root_path=f("root_path"), otlp_traces_endpoint=f("otlp_traces_endpoint"),
        kv_events=kv_events.parse_config(events) if (events := f("kv_events_config")) else
        kv_events.checked(cfg.kv_events, f"kv_events (--config {path})") if path else None,
        skip_tokenizer_init=True if f("skip_tokenizer_init") else None,
        force_include_usage=True if f("enable_force_include_usage") else None,
        return_tokens_as_token_ids=True if f("return_tokens_as_token_ids") else None,
        log_config=log_config_of(f("log_config_file")),
        host_role=f("role"), registry=f("registry"), advertise=f("advertise"), registry_ttl_s=f("registry_ttl"),
        log_level=f("log_level"), model=model, max_model_len=max_len,
        secret_file=os.path.abspath(secret) if secret else None,
        prefill_instances=f("prefill_instances"), decode_instances=f("decode_instances"),
        router_queue=f("router_queue"), router_max_in_flight=f("max_in_flight"),
        router_max_connections=f("max_connections"), shutdown_timeout_s=f("shutdown_timeout"),
        ssl_keyfile=_path(f("ssl_keyfile")), ssl_certfile=_path(f("ssl_certfile")),
        ssl_ca_certs=_path(f("ssl_ca_certs")), ssl_cert_reqs=f("ssl_cert_reqs"),
        ssl_refresh=True if f("enable_ssl_refresh") else None,
        cors_origins=f("allowed_origins"), cors_methods=f("allowed_methods"), cors_headers=f("allowed_headers"),
        cors_credentials=True if f("allow_credentials") else None,
        push_pin_fraction=f("push_pin_fraction"), gpu_memory_utilization=f("gpu_memory_utilization"),
        chat_template=chat_template_text(template) if (template := f("chat_template")) else
        chat_template_text(cfg.chat_template, f"chat_template (--config {path})") if cfg.chat_template else None,
        reasoning_parser=f("reasoning_parser"), tool_call_parser=tool_parser(flags),
        writer_warm=f("writer_warm"), writer_post_thread=f("writer_post_thread"),
        link_window=f("link_window"), link_window_mib=f("link_window_mib"), link_order=f("link_order"),
        staging=f("staging"), staging_mib=f("staging_mib"),
        conditional_disagg=True if f("conditional_disagg") else None,
        metrics_auth=True if f("metrics_auth") else None,
        served_model_name=tuple(dict.fromkeys(names)) if names else None,
        model_aliases=tuple(dict.fromkeys(aliases)) if aliases else None,
        trace_endpoint=TRACE_AUTO if trace else None,
        trace_tap_endpoint=trace if trace not in (None, TRACE_AUTO) else None,
        prefill=_replace(cfg.prefill, tp=f("prefill_tp") or tp, block_size=f("prefill_block_size") or f("block_size"),
                         num_blocks=f("num_blocks"), device=f("prefill_device") or device, **sizes),
        decode=_replace(cfg.decode, tp=f("decode_tp") or tp, block_size=f("decode_block_size") or f("block_size"),
                        num_blocks=f("num_blocks"), device=f("decode_device") or device, **sizes),
        local=_replace(cfg.local, tp=tp, block_size=f("block_size"), num_blocks=f("num_blocks"),
                       device=device, **sizes),
    )
    if f("max_num_seqs") is None:
        cfg = _seqs_within_tokens(cfg)
    otlp.check(cfg.otlp_traces_endpoint, os.environ)  # the exporter missing, or an unknown protocol: refused now
    tls.server_context(cfg)  # a key, certificate or CA file that does not load is refused now, naming it
    if cfg.uds:
        uds.check_free(cfg.uds)  # too long, in no directory, on a file that is no socket or a live one: refused now
    return _pool_sizes(cfg, flags)


def _seqs_within_tokens(cfg: DeploymentConfig) -> DeploymentConfig:
    """vLLM's default --max-num-seqs: where it is not given, at most --max-num-batched-tokens (EngineArgs lowers its
    default so; one given above the tokens is refused, ``supervisor.plan``). An instance's max_num_seqs counts as
    given when --max-num-seqs or a --config file set it to other than the default."""
    default = InstanceConfig(role="local").max_num_seqs

    def within(inst: InstanceConfig) -> InstanceConfig:
        if inst.max_num_seqs != default or not 1 <= inst.max_batch_tokens < default:
            return inst
        return msgspec.structs.replace(inst, max_num_seqs=inst.max_batch_tokens)

    return msgspec.structs.replace(cfg, prefill=within(cfg.prefill), decode=within(cfg.decode), local=within(cfg.local))


def _path(given: Optional[str]) -> Optional[str]:
    """A file flag's path made absolute (the processes start elsewhere); None: not given."""
    return os.path.abspath(given) if given else None
