"""Every environment variable the code reads: its type, default and what it does (pushkv's own
``PUSHKV_*``, and the few of other tools' that pushkv reads itself).

Nothing is read when this module is imported: ``envs.PUSHKV_THREADS`` (typed for mypy by the
``TYPE_CHECKING`` block below) or ``get(NAME, environ)`` reads the environment at that moment and
parses the value by the variable's type, refusing a bad one with an error that names the variable.
``tests/tools/test_envs.py`` holds this table to the names the code uses, and docs/running.md's table
to this one (``python -m pushkv.envs`` prints it).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

# (no A/B switches: an A/B that has its winner loses its switch)
OPERATOR, INTERNAL, DEBUG, TOOLS = ("operator", "set by the supervisor", "debug kill-switches", "tools and tests")
FOREIGN = "other tools' variables pushkv reads"


@dataclass(frozen=True)
class Var:
    name: str
    type: type  # str, int, float or bool
    default: Any
    doc: str
    kind: str = OPERATOR
    choices: tuple[str, ...] = ()


_VARS = (
    # operator
    Var("PUSHKV_API_KEY", str, "", "the router's HTTP API key: requests must carry `Authorization: Bearer KEY`; "
        "empty: no key asked. `pushkv bench`, `chat-bench` and `sweep` send it (before `OPENAI_API_KEY`)"),
    Var("PUSHKV_REGISTRY_DIR", str, "", "where `pushkv up` records deployments (`pushkv status`, taps find "
        "them there); empty: a directory of the user's own"),
    Var("PUSHKV_THREADS", int, 1, "torch CPU threads per worker"),
    Var("PUSHKV_PROFILE_DIR", str, "", "each writer process writes its cProfile to DIR/NAME.prof at exit; "
        "empty: off"),
    Var("PUSHKV_KDF", str, "scrypt", "how the CURVE keys come from --secret-file: scrypt (a work factor, then "
        "HKDF) or hkdf (HKDF alone, as before scrypt: every host of a deployment must use the same; see "
        "docs/security.md, upgrading)", choices=("scrypt", "hkdf")),
    Var("PUSHKV_SECRET_FILE", str, "", "pushkv.vllm: the CURVE secret file when the connector's extra config "
        "names none"),
    Var("PUSHKV_LOG", str, "INFO", "pushkv.vllm's log level: its writer process's, and the connector's lines in vLLM's "
        "log (timestamped, unless that process set up Python's logging)"),
    Var("PUSHKV_WARM_GRAMMARS", bool, True, "the router loads xgrammar on a parse thread once it is ready, so the "
        "first structured-output request's check does not wait ~1.5 s for it; 0: loaded by that first request "
        "(the tests' deployments, which start many routers on two cores)"),
    Var("PUSHKV_RESPONSES_STORE", int, 1024, "the router keeps this many /v1/responses answers (the latest, within "
        "64 MiB) for previous_response_id and GET /v1/responses/ID, as OpenAI's store; 0: none kept"),
    # set by the supervisor for each child
    Var("PUSHKV_NAME", str, "", "the process's name (`prefill-writer-0`)", INTERNAL),
    Var("PUSHKV_DEPLOYMENT_ID", str, "", "the deployment the process belongs to", INTERNAL),
    Var("PUSHKV_HOST", str, "", "the host named in every trace event of the process", INTERNAL),
    Var("PUSHKV_POOL", str, "", "the pool handle a writer reports and its worker maps (base64)", INTERNAL),
    # debug kill-switches: each turns a GPU fast path off for the plain torch one that computes the same
    # (to tell a kernel's fault from the rest's); not A/B switches, nothing is left to measure
    Var("PUSHKV_CUDA_GRAPHS", bool, True, "batched engine: CUDA graphs for decode steps (TP 1); 0: every step "
        "launched eagerly", DEBUG),
    Var("PUSHKV_FUSED", bool, True, "batched engine: the fused norm/RoPE/store kernels; 0: torch's ops", DEBUG),
    Var("PUSHKV_SAMPLER", str, "auto", "sampling: auto (the Triton kernel on CUDA, torch's ops elsewhere), or "
        "force one", DEBUG, ("auto", "torch", "triton")),
    Var("PUSHKV_CHECKSUM", str, "triton", "--kv-verify on CUDA: the Triton kernel, or torch's ops", DEBUG,
        ("triton", "torch")),
    Var("PUSHKV_MOE_DECODE", str, "grouped", "MoE decode steps (<= 8 tokens) on CUDA: the grouped kernels "
        "(the faster on an H200), or the three-launch ungrouped ones (kernels/triton_moe_decode.py: equal at one "
        "token, 1.5x slower at eight on an H200)", DEBUG, ("grouped", "ungrouped")),
    # tools and tests
    Var("PUSHKV_FAULTS_DIR", str, "", "fault injection: where armed kill and fire points are found (tests)",
        TOOLS),
    Var("PUSHKV_VLLM_TIMING", bool, False, "pushkv.vllm: print per-transfer timestamps to stderr", TOOLS),
    Var("PUSHKV_WRITERS_ROOT", str, "", "pushkv transfer-report --writers-only: run the writers from this "
        "checkout (a before/after comparison)", TOOLS),
    Var("PUSHKV_TCPW_UCX_LOG", str, "", "pushkv tcp-write-report: keep UCX's protocol log", TOOLS),
    # other tools' variables, read as those tools read them
    Var("HF_HUB_OFFLINE", str, "", "Hugging Face's offline mode (1/true/yes/on): `--model ORG/NAME` only from the "
        "local cache, and the error says so", FOREIGN),
    Var("XDG_CACHE_HOME", str, "", "where preflight remembers what it verified (DIR/pushkv); empty: ~/.cache",
        FOREIGN),
    Var("XDG_RUNTIME_DIR", str, "", "the deployments' registry and the vLLM connector's sockets live under it "
        "when it exists; else under /tmp, per user", FOREIGN),
    Var("VLLM_NIXL_SIDE_CHANNEL_HOST", str, "", "pushkv.vllm: the writers' handshake host when the connector's "
        "extra config names none; empty: 127.0.0.1", FOREIGN),
    Var("VLLM_NIXL_SIDE_CHANNEL_PORT", int, 0, "pushkv.vllm: the writers' handshake port when the extra config "
        "names none; 0: 5600", FOREIGN),
    Var("OPENAI_API_KEY", str, "", "`pushkv bench`, `chat-bench` and `sweep`: the API key they send "
        "(`Authorization: Bearer KEY`) where `PUSHKV_API_KEY` is unset, as `vllm bench serve` sends it", FOREIGN),
    Var("VLLM_ALLOW_RUNTIME_LORA_UPDATING", bool, False, "the router serves vLLM's `/v1/load_lora_adapter` and "
        "`/v1/unload_lora_adapter` (with `--enable-lora`); off: those paths are 404, as vLLM's", FOREIGN),
    Var("VLLM_ALLOW_LONG_MAX_MODEL_LEN", bool, False, "`pushkv up`: a `--max-model-len` past the derived length "
        "of a YaRN checkpoint (its `max_position_embeddings`, as vLLM 0.32 derives it) is taken, up to the YaRN length "
        "(`original_max_position_embeddings` x factor); off: refused, as vLLM's", FOREIGN),
    Var("VLLM_LOGGING_CONFIG_PATH", str, "", "`pushkv up`: the `--log-config-file` where the flag is not given, as "
        "vLLM reads it (a dictConfig JSON file every process applies)", FOREIGN),
    Var("VLLM_API_KEY", str, "", "`pushkv vllm-proxy`: the instances' API key for its probes where `--api-key` is "
        "not given (the key `vllm serve` reads there)", FOREIGN),
)
VARS: dict[str, Var] = {v.name: v for v in _VARS}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse(var: Var, raw: str) -> Any:
    """``raw`` as ``var``'s type; ValueError naming the variable if it is not one."""
    try:
        if var.type is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(f"not one of {'/'.join(_TRUE + _FALSE)}")
        value = var.type(raw)
    except ValueError as e:
        raise ValueError(f"{var.name}={raw!r}: {e}") from None
    if var.choices and value not in var.choices:
        allowed = ", ".join(c or "''" for c in var.choices)
        raise ValueError(f"{var.name}={raw!r}: not one of {allowed}")
    return value


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The variable's value now (from ``environ``, default os.environ), or its default if unset."""
    var = VARS[name]
    raw = (os.environ if environ is None else environ).get(name)
    return var.default if raw is None or (raw == "" and var.type is not str) else parse(var, raw)


if TYPE_CHECKING:  # what ``envs.NAME`` returns, for mypy (tests/tools/test_envs.py holds it to the table)
    PUSHKV_API_KEY: str
    PUSHKV_REGISTRY_DIR: str
    PUSHKV_THREADS: int
    PUSHKV_PROFILE_DIR: str
    PUSHKV_KDF: str
    PUSHKV_SECRET_FILE: str
    PUSHKV_LOG: str
    PUSHKV_WARM_GRAMMARS: bool
    PUSHKV_RESPONSES_STORE: int
    PUSHKV_NAME: str
    PUSHKV_DEPLOYMENT_ID: str
    PUSHKV_HOST: str
    PUSHKV_POOL: str
    PUSHKV_CUDA_GRAPHS: bool
    PUSHKV_FUSED: bool
    PUSHKV_SAMPLER: str
    PUSHKV_MOE_DECODE: str
    PUSHKV_CHECKSUM: str
    PUSHKV_FAULTS_DIR: str
    PUSHKV_VLLM_TIMING: bool
    PUSHKV_WRITERS_ROOT: str
    PUSHKV_TCPW_UCX_LOG: str
    HF_HUB_OFFLINE: str
    XDG_CACHE_HOME: str
    XDG_RUNTIME_DIR: str
    VLLM_NIXL_SIDE_CHANNEL_HOST: str
    VLLM_NIXL_SIDE_CHANNEL_PORT: int
    OPENAI_API_KEY: str
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    VLLM_ALLOW_LONG_MAX_MODEL_LEN: bool
    VLLM_LOGGING_CONFIG_PATH: str
    VLLM_API_KEY: str


def __getattr__(name: str) -> Any:
    if name in VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def markdown_table() -> str:
    """The table of docs/running.md ("Environment variables")."""
    rows = ["| variable | type | default | what |", "| --- | --- | --- | --- |"]
    for kind in (OPERATOR, INTERNAL, DEBUG, TOOLS, FOREIGN):
        rows.append(f"| *{kind}* | | | |")
        for v in _VARS:
            if v.kind == kind:
                default = ("1" if v.default else "0") if v.type is bool else str(v.default)
                shown = " \\| ".join(c for c in v.choices if c)
                what = v.doc + (f" ({shown})" if v.choices else "")
                rows.append(f"| `{v.name}` | {v.type.__name__} | {f'`{default}`' if default else ''} | {what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
