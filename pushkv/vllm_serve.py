"""``vllm serve``'s flags, as ``pushkv up`` takes them: a vLLM user's command line either runs, or says which of its
flags pushkv does not build and what to do instead, before anything starts.

Each flag here is of one kind (docs/running.md, "From vllm serve", is :func:`markdown_table`):

- **same**: a pushkv setting under vLLM's name, with vLLM's meaning (``--max-num-batched-tokens`` is
  ``--max-batch-tokens``, ``--enforce-eager`` turns the CUDA graphs off);
- **when**: taken where its value is what pushkv does anyway (``--pipeline-parallel-size 1``, ``--kv-cache-dtype
  auto``); another value is refused, naming it;
- **no effect**: vLLM's logging and engine-tuning knobs (``--disable-log-stats``, ``--compilation-config``): taken,
  and one line at startup says that pushkv has no such knob;
- **refused**: a vLLM feature pushkv does not build (``--speculative-config``): refused by name,
  with what to do instead.

``vllm serve MODEL``'s positional model and a ``--config`` YAML file of vLLM's flags (its keys the flags' names)
are taken too (:func:`yaml_argv`). Pure: :func:`add_flags` declares the flags on ``pushkv up``'s parser;
:func:`apply` turns the parsed flags into pushkv's and the startup notes, or raises ValueError naming the flag and
its value. A flag pushkv also spells its own way must not disagree with it.
"""
from __future__ import annotations

import argparse
import decimal
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

SAME, WHEN, NO_EFFECT, REFUSED = "same", "when", "no effect", "refused"
SWITCH = "switch"  # a flag without a value
ON_OFF = "on/off"  # --flag and --no-flag, as vLLM's boolean options


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # as vLLM spells it, the long name last
    kind: str
    says: str  # what pushkv does with it, or why not
    value: Any = str  # argparse type; SWITCH; ON_OFF
    takes: Optional[Callable[[Any], bool]] = None  # WHEN: the values taken
    sets: str = ""  # SAME: the pushkv flag (its dest) it stands for

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[-1].lstrip("-").replace("-", "_")

    @property
    def name(self) -> str:
        return self.names[-1]


HUMAN = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(v: str) -> int:
    """vLLM's human-readable integers (``human_readable_int``): 2048, 2k (2,000), 2K (2,048), 25.6k; m, g, M, G."""
    text = str(v).strip()
    unit = HUMAN.get(text[-1:], 0)
    try:
        if not unit:
            return int(text)
        n = decimal.Decimal(text[:-1]) * unit  # (a float's 16.1 * 1000 is not whole)
    except (ValueError, decimal.InvalidOperation):
        raise argparse.ArgumentTypeError(f"{v!r} is neither an integer nor one with a unit (2k = 2000, 2K = 2048)"
                                         ) from None
    if n != n.to_integral_value():
        raise argparse.ArgumentTypeError(f"{v!r} is not a whole number of tokens")
    return int(n)


def human_int_or_auto(v: str) -> Optional[int]:
    """vLLM's ``--max-model-len``: a human-readable integer, or auto (or -1): the model's own length."""
    return None if str(v).strip().lower() in ("auto", "-1") else human_int(v)


def _one(v: Any) -> bool:
    return int(v) == 1


def _zero(v: Any) -> bool:
    return float(v) == 0


def _xgrammar_config(v: Any) -> bool:
    """vLLM's --structured-outputs-config, where it asks for what pushkv does: xgrammar, and nothing else."""
    import json

    try:
        cfg = json.loads(v)
    except ValueError:
        return False
    return isinstance(cfg, dict) and set(cfg) <= {"backend"} and str(cfg.get("backend", "auto")) in ("auto",
                                                                                                      "xgrammar")


def _of(*values: str) -> Callable[[Any], bool]:
    return lambda v: str(v).lower() in values


FLAGS: tuple[Flag, ...] = (
    # the same setting under vLLM's name
    Flag(("--max-num-batched-tokens",), SAME, "tokens a step may hold: --max-batch-tokens", human_int,
         sets="max_batch_tokens"),
    Flag(("--num-gpu-blocks-override",), SAME, "KV blocks in each rank's pool: --num-blocks", int, sets="num_blocks"),
    Flag(("--enable-prefix-caching",), SAME, "full prompt blocks cached by a hash of their tokens (on unless "
         "--no-enable-prefix-caching or --no-prefix-cache)", ON_OFF, sets="no_prefix_cache"),
    Flag(("--enable-chunked-prefill",), SAME, "a long prompt prefilled in chunks of --max-num-batched-tokens, mixed "
         "with decodes: --prefill-chunk N (--no-enable-chunked-prefill: --prefill-chunk 0)", ON_OFF,
         sets="prefill_chunk"),
    Flag(("--enforce-eager",), SAME, "no CUDA graphs: every decode step launches its kernels", SWITCH,
         sets="enforce_eager"),
    Flag(("--download-dir",), SAME, "where a --model repo id is downloaded and looked for (huggingface_hub's "
         "cache_dir)", sets="download_dir"),
    # taken where the value is what pushkv does
    Flag(("-pp", "--pipeline-parallel-size"), WHEN, "1: pipeline parallelism is not built; -tp splits a model "
         "over GPUs", int, _one),
    Flag(("-dp", "--data-parallel-size"), WHEN, "1: replicas are instances here (--prefill-instances, "
         "--decode-instances), each placed by the router", int, _one),
    Flag(("--api-server-count",), WHEN, "1: one router serves HTTP", int, _one),
    Flag(("--kv-cache-dtype",), WHEN, "auto: the KV cache is kept in the model's dtype", str, _of("auto")),
    Flag(("-q", "--quantization"), WHEN, "fp8 on a block-scaled fp8 checkpoint (what vLLM infers from it), "
         "dequantized at load; online quantization of a checkpoint that is not is not built", str,
         _of("fp8", "none")),
    Flag(("--distributed-executor-backend",), WHEN, "mp: every rank is a process of its own", str, _of("mp", "uni")),
    Flag(("--tokenizer-mode",), WHEN, "auto: the checkpoint's tokenizer.json", str, _of("auto", "hf")),
    Flag(("--scheduling-policy",), WHEN, "fcfs: requests are served in the order they arrive", str, _of("fcfs")),
    Flag(("--max-logprobs",), WHEN, "20: pushkv's bound on logprobs, top_logprobs and prompt_logprobs "
         "(pushkv/limits.py)", int, lambda v: int(v) == 20),
    Flag(("--lora-dtype",), WHEN, "auto: LoRA adapters run in the model's dtype", str, _of("auto")),
    Flag(("--cpu-offload-gb",), WHEN, "0: weights stay on the device", float, _zero),
    Flag(("--guided-decoding-backend",), WHEN, "xgrammar (or auto): structured output is compiled by xgrammar",
         str, _of("xgrammar", "auto")),
    Flag(("--structured-outputs-config",), WHEN, "a JSON object whose backend is xgrammar (or auto): structured "
         "output is compiled by xgrammar; its other fields are not built", str, _xgrammar_config),
    Flag(("--trust-remote-code",), WHEN, "taken: pushkv runs no code from a checkpoint; an architecture outside its "
         "registry is refused by name", SWITCH, lambda v: True),
    # vLLM's knobs that pushkv has no counterpart of: taken, and said
    Flag(("-O", "--compilation-config"), NO_EFFECT, "pushkv runs its own Triton kernels, not torch.compile"),
    Flag(("--cuda-graph-sizes",), NO_EFFECT, "pushkv captures a decode graph per batch bucket up to --max-num-seqs",
         value=str),
    Flag(("--async-scheduling",), NO_EFFECT, "pushkv's scheduler and worker are processes of their own already",
         SWITCH),
    Flag(("--disable-custom-all-reduce",), NO_EFFECT, "TP ranks all-reduce through torch.distributed", SWITCH),
    Flag(("--max-parallel-loading-workers",), NO_EFFECT, "each rank loads its own slices", int),
    Flag(("--swap-space",), NO_EFFECT, "nothing is swapped to host memory: a request that does not fit waits",
         float),
    Flag(("--max-cpu-loras",), NO_EFFECT, "every --lora-modules adapter is held on every rank from the start", int),
    Flag(("--fully-sharded-loras",), NO_EFFECT, "each TP rank holds its share of every adapter (the rows of B a "
         "column-parallel projection gives it, the columns of A a row-parallel one takes)", SWITCH),
    Flag(("--disable-log-stats",), NO_EFFECT, "pushkv logs no periodic stats; /metrics has them", SWITCH),
    Flag(("--collect-detailed-traces",), NO_EFFECT, "--otlp-traces-endpoint's spans always carry each request's "
         "phases (queue, prefill, kv_transfer, decode) as children"),
    Flag(("--disable-log-requests",), NO_EFFECT, "pushkv does not log requests", SWITCH),
    Flag(("--enable-log-requests",), NO_EFFECT, "pushkv does not log requests; --trace records every message",
         SWITCH),
    Flag(("--uvicorn-log-level",), NO_EFFECT, "the router is aiohttp, logging at --log-level"),
    Flag(("--disable-uvicorn-access-log",), NO_EFFECT, "the router keeps no access log", SWITCH),
    Flag(("--disable-fastapi-docs",), NO_EFFECT, "the router serves no API docs", SWITCH),
    Flag(("--max-log-len",), NO_EFFECT, "pushkv does not log prompts", int),
    Flag(("--enable-server-load-tracking",), NO_EFFECT, "the router always counts its requests in flight: GET /load",
         SWITCH),
    Flag(("--enable-prompt-tokens-details",), NO_EFFECT, "usage.prompt_tokens_details.cached_tokens is always given",
         SWITCH),
    Flag(("--enable-request-id-headers",), NO_EFFECT, "every response carries X-Request-Id (the client's own where "
         "it sent one)", SWITCH),
    Flag(("--disable-frontend-multiprocessing",), NO_EFFECT, "the router is a process of its own, beside the "
         "engines", SWITCH),
    Flag(("--response-role",), WHEN, "assistant: chat answers as the assistant", str, _of("assistant")),
    # vLLM's features that pushkv does not build
    Flag(("--speculative-config",), REFUSED, "speculative decoding is not built"),
    Flag(("--kv-transfer-config",), REFUSED, "pushkv up runs P and D itself and moves the KV between them: --mode "
         "push|pull chooses how (vLLM instances take pushkv's transfer through its PushKVConnector)"),
    Flag(("--enable-expert-parallel",), REFUSED, "expert parallelism is not built: -tp splits every expert's "
         "intermediate columns", SWITCH),
    Flag(("--limit-mm-per-prompt",), REFUSED, "pushkv serves text only"),
    Flag(("--mm-processor-kwargs",), REFUSED, "pushkv serves text only"),
    Flag(("--hf-overrides",), SAME, "a JSON object of config.json fields read over the checkpoint's (Qwen2.5's "
         "YaRN: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
         "\"original_max_position_embeddings\": 32768}}'); not quantization_config", sets="hf_overrides"),
    Flag(("--rope-scaling",), SAME, "config.json's rope_scaling, as --hf-overrides '{\"rope_scaling\": ...}' sets it",
         sets="rope_scaling"),
    Flag(("--rope-theta",), SAME, "config.json's rope_theta, as --hf-overrides '{\"rope_theta\": ...}' sets it", float,
         sets="rope_theta"),
    Flag(("--override-generation-config",), SAME, "a JSON object of generation_config.json's sampling fields "
         "(temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, max_new_tokens), "
         "over the checkpoint's with "
         "--generation-config auto, a directory's with DIR, alone with vllm; a request's own values still win, but "
         "max_new_tokens bounds every request's max_tokens, as vLLM's",
         sets="override_generation_config"),
    Flag(("--code-revision",), REFUSED, "pushkv runs no code from a checkpoint"),
    Flag(("--enable-sleep-mode",), REFUSED, "sleep mode is not built", SWITCH),
    Flag(("--headless",), REFUSED, "pushkv up --role prefill|decode runs a host without the router", SWITCH),
    Flag(("--middleware",), REFUSED, "vLLM adds each import path's ASGI middleware (a class, or an http "
         "middleware function) to its FastAPI app; pushkv's router is aiohttp, which runs no ASGI middleware: put it "
         "in an ASGI proxy or the gateway in front of the router"),
)
BY_DEST = {f.dest: f for f in FLAGS}


def add_flags(group) -> None:
    """Declare every flag of :data:`FLAGS` on ``group`` (an argparse group of ``pushkv up``), dest ``vllm_NAME``."""
    for f in FLAGS:
        if f.kind == SAME and f.value == ON_OFF:
            default = "on" if f.sets == "no_prefix_cache" else f"--{f.sets.replace('_', '-')}'s"
        elif f.kind == SAME:
            default = "off" if f.value == SWITCH else ("huggingface_hub's cache" if f.sets == "download_dir"
                                                       else f"--{f.sets.replace('_', '-')}'s")
        else:
            default = "not given"
        help = f"{f.kind}: {f.says} (default: {default})"
        if f.value == SWITCH:
            group.add_argument(*f.names, dest=f.dest, action="store_true", help=help)
        elif f.value == ON_OFF:
            group.add_argument(*f.names, dest=f.dest, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            group.add_argument(*f.names, dest=f.dest, type=f.value, metavar="VALUE", help=help)


def given(flags: Mapping[str, Any]) -> list[tuple[Flag, Any]]:
    """The vLLM flags the parsed ``flags`` hold, each with its value (a switch given: True)."""
    out = []
    for f in FLAGS:
        v = flags.get(f.dest)
        if v is None or v is False and f.value == SWITCH:
            continue
        out.append((f, v))
    return out


def _spelt(f: Flag, v: Any) -> str:
    if f.value == SWITCH:
        return f.name
    if f.value == ON_OFF:
        return f.name if v else "--no-" + f.name[2:]
    return f"{f.name} {v}"


def apply(flags: Mapping[str, Any], max_batch_tokens: int) -> tuple[dict[str, Any], list[str]]:
    """The pushkv flags (dests) that the vLLM ones given stand for, and one startup line for each taken with no
    effect. ``max_batch_tokens``: the tokens a step may hold when no flag says (--enable-chunked-prefill's chunk).
    ValueError, naming the flag and its value, for one refused, for one whose value pushkv does not run, and for
    one that disagrees with pushkv's own spelling of it."""
    sets: dict[str, Any] = {}
    notes: list[str] = []
    for f, v in given(flags):
        if f.kind == REFUSED:
            raise ValueError(f"{_spelt(f, v)}: {f.says}")
        if f.kind == WHEN and not (f.takes is not None and f.takes(v)):
            raise ValueError(f"{_spelt(f, v)} is not supported: pushkv takes {f.says}")
        if f.kind == NO_EFFECT:
            notes.append(f"{_spelt(f, v)} has no effect: {f.says}")
        if f.kind != SAME:
            continue
        if f.sets == "no_prefix_cache":
            value: Any = not v
        elif f.sets == "prefill_chunk":  # on: pushkv's own chunk where given, else a step's tokens
            value = (flags.get("prefill_chunk") or flags.get("max_batch_tokens")
                     or flags.get("vllm_max_num_batched_tokens") or max_batch_tokens) if v else 0
        else:
            value = v
        own = flags.get(f.sets)
        if f.sets == "no_prefix_cache":
            clash = own and value is False  # --no-prefix-cache with --enable-prefix-caching
        else:
            clash = own is not None and own != value
        if clash:
            raise ValueError(f"{_spelt(f, v)} disagrees with --{f.sets.replace('_', '-')} {own}")
        sets[f.sets] = value
    return sets, notes


# flags that take one JSON list on the command line (vLLM's CORS flags), which a YAML list stands for
JSON_LISTS = frozenset({"--allowed-origins", "--allowed-methods", "--allowed-headers"})


def yaml_argv(path: str) -> list[str]:
    """A vLLM ``--config`` YAML file (each key a ``vllm serve`` flag's name, with or without dashes and in either
    spelling, each value its value; ``model`` too) as the command line it stands for. A flag on the command line
    wins over the file's, as in vLLM: the caller puts these first."""
    import yaml  # type: ignore[import-untyped]

    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a YAML mapping of vllm serve flags to values, not {type(data).__name__}")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            if BY_DEST.get("vllm_" + flag[2:].replace("-", "_"), Flag((), "", "")).value == ON_OFF:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, list) and flag in JSON_LISTS:
            import json

            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *(str(x) for x in value)]
        elif isinstance(value, dict):
            import json

            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` with a ``--config FILE.yaml`` (or ``.yml``: vLLM's config file; pushkv's own is JSON or TOML)
    replaced by the flags it holds, put first so that the command line's win."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        elif arg.startswith("--config="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
        else:
            continue
        if not path.endswith((".yaml", ".yml")):
            return argv
        cmd = rest[:1] if rest[:1] == ["up"] else []
        return cmd + yaml_argv(path) + rest[len(cmd):]
    return argv


def markdown_table() -> str:
    """docs/running.md's table of them ("From vllm serve")."""
    rows = ["| vllm serve flag | pushkv up | |", "| --- | --- | --- |"]
    for f in FLAGS:
        says = f.says.replace("|", "\\|")
        rows.append(f"| `{', '.join(f.names)}` | {f.kind} | {says} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_table())
