"""Deployment configuration: model geometry, instances, endpoints.

Plain msgspec Structs so a whole deployment serialises to JSON and every
child process receives exactly the config the supervisor built.

Every closed set of values (a mode, a role, a switch) is a ``Literal`` alias (``pushkv.kinds``): msgspec
refuses any other value when a config is decoded (``decode_config``, ``config_from_builtins``)
and ``__post_init__`` when one is built or replaced, each naming the field and the values it
allows; mypy (strict_equality) refuses a comparison with a value the field cannot hold. On the
wire and in JSON they stay plain strings.
"""
from __future__ import annotations

import functools
import os
import re
import typing
import uuid
from typing import Any, Literal, Optional

import msgspec

from pushkv.kinds import (
    Direction,
    Engine,
    GroupScore,
    HostRole,
    KVVerify,
    LinkOrder,
    MaxLoraRank,
    Mode,
    PullRead,
    PushStream,
    RandomInit,
    ReasoningParser,
    Role,
    RopeType,
    RouterScoring,
    Staging,
    StreamSent,
    Switch,
    ToolCallParser,
)
from pushkv.messages import PrefillSource
from pushkv.protocol.kv_events import KVEventsConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}



@functools.cache
def json_object(text: str, flag: str, what: str) -> dict:
    """A flag's value that must be a JSON object (vLLM's --hf-overrides and the like): the object, or ValueError
    naming the flag and saying ``what`` it holds."""
    import json

    try:
        got = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag}: not JSON: {e}") from None
    if not isinstance(got, dict):
        raise ValueError(f"{flag}: a JSON object of {what}, not {type(got).__name__}")
    return got


def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """``cls``'s fields of a Literal type -> the values each allows."""
    out: dict[str, tuple[Any, ...]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is Literal:
            out[name] = typing.get_args(hint)
    return out


def _allowed(values: tuple[Any, ...]) -> str:
    return ", ".join(repr(v) for v in values)


def check_choices(obj: msgspec.Struct) -> None:
    """ValueError naming the first Literal field of ``obj`` holding a value its type refuses."""
    for name, allowed in choices(type(obj)).items():
        value = getattr(obj, name)
        if value not in allowed:
            raise ValueError(f"{type(obj).__name__}.{name}: {value!r} is not one of {_allowed(allowed)}")


_BAD_ENUM = re.compile(r"Invalid enum value (?P<value>.+) - at `\$(?P<path>[^`]*)`")


def explain(e: msgspec.ValidationError, cls: type) -> msgspec.ValidationError:
    """msgspec's error for a bad Literal value (it names the value and the path), with the values
    the field allows; any other error as it was."""
    m = _BAD_ENUM.fullmatch(str(e))
    if not m:
        return e
    t: Any = cls
    for part in re.findall(r"\.(\w+)", m["path"]):  # $.prefills[0].role: prefills, role
        hints = typing.get_type_hints(t) if isinstance(t, type) else {}
        t = hints.get(part)
        while typing.get_origin(t) in (tuple, typing.Union):  # tuple[X, ...], Optional[X]: X
            t = next(a for a in typing.get_args(t) if a is not type(None) and a is not Ellipsis)
    if typing.get_origin(t) is not Literal:
        return e
    return msgspec.ValidationError(f"{e}: not one of {_allowed(typing.get_args(t))}")


class SamplingDefaults(msgspec.Struct, frozen=True):
    """A checkpoint's default sampling (its ``generation_config.json``): what a request that leaves
    a field unset gets. None: pushkv's own default (greedy; max_tokens as the endpoint says)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    max_tokens: Optional[int] = None  # max_new_tokens
    repetition_penalty: Optional[float] = None
    # a bound on every request's max_tokens, its own too (vLLM's override_max_tokens): the max_new_tokens of a
    # --generation-config DIR's file, or of --override-generation-config
    max_tokens_cap: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None


class RopeScaling(msgspec.Struct, frozen=True):
    """How a checkpoint's RoPE frequencies differ from plain RoPE (its ``rope_parameters`` or
    ``rope_scaling``), as pushkv/model/rope.py computes them. ``default``: plain RoPE."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    original_max_position: int = 0  # the context the model was pretrained on (llama3, yarn, dynamic)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: what cos and sin are multiplied by (read or derived at load)
    truncate: bool = True  # yarn: round the correction range to whole dims

    def __post_init__(self) -> None:
        check_choices(self)


class MoeRouting(msgspec.Struct, frozen=True):
    """How an MoE router chooses (the default: Qwen3-MoE's and Mixtral's softmax top-k). DeepSeek's: the scores by
    softmax (V2) or sigmoid (V3); ``groups`` groups of experts, of which the ``topk_groups`` best (by their best
    score, or their two best summed) are chosen from; a correction bias added to the scores for the choice only
    (``bias``, V3); the chosen weights times ``scale``."""

    scoring: RouterScoring = "softmax"
    groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "max"
    bias: bool = False  # the router's e_score_correction_bias
    scale: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        check_choices(self)


class LoraModule(msgspec.Struct, frozen=True):
    """One LoRA adapter a deployment serves (vLLM's --lora-modules NAME=PATH): a request whose ``model`` is ``name``
    runs through it. ``path``: its PEFT directory (a Hub id resolved to one at launch)."""

    name: str
    path: str
    base_model_name: str = ""  # the served model it adapts (vLLM's JSON form); "": the first served name
    given: str = ""  # the path as given (a Hub id, a relative path): /v1/models' root, as vLLM's; "": ``path``


class LoraConfig(msgspec.Struct, frozen=True):
    """vLLM's --enable-lora and its settings (pushkv/model/lora.py): every adapter is loaded on every rank of every
    instance at start; a step holds sequences of at most ``max_loras`` adapters."""

    enabled: bool = False
    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_rank: MaxLoraRank = 16  # --max-lora-rank: one of vLLM's ranks

    def __post_init__(self) -> None:
        check_choices(self)

    def slot(self, name: str) -> int:
        """The adapter's slot (1, 2... in the order given); 0 for none (""); -1 for a name not served."""
        if not name:
            return 0
        return next((i for i, m in enumerate(self.modules, 1) if m.name == name), -1)


class ModelConfig(msgspec.Struct, frozen=True):
    name: str = "small"
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    vocab_size: int = 320  # 256 bytes + specials, padded
    max_position: int = 32768
    # vLLM 0.32's derived max_model_len where it is below max_position: YaRN's max_position_embeddings, which vLLM no
    # longer stretches by the factor (a longer --max-model-len needs VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); 0: max_position
    derived_max_len: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"  # a key of DTYPE_BYTES (supervisor/geometry.py refuses another)
    seed: int = 0
    qk_norm: bool = True  # Qwen3-style q/k RMSNorm
    tie_embeddings: bool = False
    checkpoint: Optional[str] = None  # local HF directory (Llama/Qwen3)
    deterministic: bool = True  # batch-invariant forward
    eos_token_id: int = -1  # -1: never stop on EOS (random weights)
    sliding_window: int = 0  # tokens; 0 = full attention everywhere
    window_layers: tuple[int, ...] = ()  # layers that use the sliding window
    # MLA-style attention (kv_lora_rank > 0): each layer caches one latent row of
    # kv_lora_rank + qk_rope_dim per token, shared by every head (and TP rank);
    # head_dim is then the per-head no-RoPE query/key and value width.
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    # "auto": the batched engine (one packed forward per step, Triton paged attention,
    # CUDA graphs) on CUDA, the per-sequence engine on the CPU; "batched" | "per-seq" force one
    engine: Engine = "auto"
    cuda_graphs: bool = True  # the batched engine replays decode steps as CUDA graphs (False: --enforce-eager)
    random_init: RandomInit = "cpu"  # random weights drawn on "cpu" (fp32, then cast) or "device"
    # every id that ends a turn: config.json's eos_token_id (an int or a list) and
    # generation_config.json's; eos_token_id above is the first of them
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # from generation_config.json (--generation-config auto)
    # the checkpoint's architecture (config.json "architectures", a key of pushkv/model/arch.py's
    # registry); "" = pushkv's own random model, named as Qwen3 (Qwen3MoE with experts)
    architecture: str = ""
    # vLLM's --hf-overrides (and --rope-scaling, --rope-theta): a JSON object of config.json fields read over the
    # checkpoint's, here so that every process reading the checkpoint's config reads the same (checkpoint.py)
    hf_overrides: str = ""
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling = RopeScaling()
    # mixture of experts (num_experts > 0): every layer's MLP is num_experts SwiGLU experts of
    # intermediate_size columns each, experts_per_token of them chosen per token by a softmax router
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True  # the chosen experts' router weights renormalised to sum to 1
    routing: MoeRouting = MoeRouting()
    shared_intermediate_size: int = 0  # an MoE layer's always-on shared expert of this width (DeepSeek); 0: none
    shared_gate: bool = False  # ... its output scaled by a sigmoid of the layer's input (Qwen2-MoE)
    dense_layers: int = 0  # the first N layers of an MoE model have a dense MLP (DeepSeek's first_k_dense_replace)
    dense_intermediate_size: int = 0  # ... of this width
    q_lora_rank: int = 0  # MLA queries through a down-projection, an RMSNorm and an up-projection (DeepSeek-V2/V3)
    attn_scale: float = 0.0  # the attention's softmax scale; 0: 1 / sqrt(the query width)
    # the checkpoint rotates RoPE dims in adjacent pairs (0, 1), (2, 3)... (DeepSeek): its rotated rows are permuted
    # at load into halves, the pairs RoPE rotates here, on queries and keys alike (their dot products unchanged)
    rope_interleave: bool = False
    # local directory of the tokenizer (--tokenizer, or the checkpoint's with --load-format dummy);
    # None: the checkpoint's own, or pushkv's byte tokenizer without one
    tokenizer: Optional[str] = None
    lora: LoraConfig = LoraConfig()  # LoRA adapters served beside the weights (vLLM's --enable-lora)

    def __post_init__(self) -> None:
        check_choices(self)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def all_eos_ids(self) -> tuple[int, ...]:
        """The ids generation stops on (unless a request ignores EOS)."""
        return self.eos_token_ids or ((self.eos_token_id,) if self.eos_token_id >= 0 else ())

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """Cache planes per (layer, head): K and V, or one latent."""
        return 1 if self.is_mla else 2

    @property
    def cache_kv_heads(self) -> int:
        """Heads the KV cache holds per layer (the latent counts as one)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Width of one cached head row."""
        return self.kv_lora_rank + self.qk_rope_dim if self.is_mla else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_planes * self.cache_kv_heads * self.cache_head_dim * self.dtype_bytes


PRESETS: dict[str, ModelConfig] = {
    # unit tests: fast everywhere
    "tiny": ModelConfig(
        name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_position=8192,
    ),
    # default: small enough for 2 CPU cores, big enough that KV transfer matters
    "small": ModelConfig(name="small"),
    # larger KV per token for transfer benchmarks
    "medium": ModelConfig(
        name="medium", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
        head_dim=64, intermediate_size=1536, deterministic=False,
    ),
    # hybrid attention: "small" with every other layer on a 48-token sliding window
    # (Gemma-2 style local/global alternation); only window blocks of those layers move
    "hybrid": ModelConfig(name="hybrid", sliding_window=48, window_layers=(0, 2)),
    # MLA-style: one latent row (64 + 16 RoPE) per token and layer, replicated on every rank
    "mla": ModelConfig(
        name="mla", num_kv_heads=1, qk_norm=False, kv_lora_rank=64, qk_rope_dim=16,
    ),
    # real geometries (random weights drawn on the device, bf16, Qwen3's vocabulary and
    # RoPE base): what the GPU engine and the push-vs-pull experiment run
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position=40960,
        rope_theta=1e6, dtype="bfloat16", deterministic=False, random_init="device",
    ),
    # Qwen3-30B-A3B's shape: 128 experts of 768 columns a layer, 8 routed per token (3.3B of 30.5B
    # parameters active); the shape the MoE roofline is to run (named as Qwen3-MoE's weights)
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
        head_dim=128, intermediate_size=768, vocab_size=151936, max_position=40960,
        rope_theta=1e6, dtype="bfloat16", deterministic=False, random_init="device",
        architecture="Qwen3MoeForCausalLM", num_experts=128, experts_per_token=8,
    ),
    "qwen3-32b": ModelConfig(
        name="qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8,
        head_dim=128, intermediate_size=25600, vocab_size=151936, max_position=40960,
        rope_theta=1e6, dtype="bfloat16", deterministic=False, random_init="device",
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return msgspec.structs.replace(PRESETS[name], **overrides)


def model_fingerprint(model: ModelConfig) -> str:
    """What a peer's KV means, as a short hash: geometry, dtype and where the weights come from
    (random weights: their seed; a checkpoint: its directory's name). Two writers whose
    fingerprints differ would move KV that the other's model reads wrongly."""
    import hashlib

    keep = {f: getattr(model, f) for f in model.__struct_fields__
            if f not in ("checkpoint", "engine", "random_init", "deterministic", "max_position", "eos_token_id",
                         "tokenizer", "lora", "derived_max_len")}
    keep["checkpoint"] = os.path.basename(os.path.normpath(model.checkpoint)) if model.checkpoint else ""
    if model.lora.modules:  # an adapter's name must mean the same weights to both sides of a transfer
        keep["lora"] = [(m.name, os.path.basename(os.path.normpath(m.path))) for m in model.lora.modules]
    return hashlib.sha256(msgspec.json.encode(keep)).hexdigest()[:16]


class InstanceConfig(msgspec.Struct, frozen=True):
    role: Role
    engine_id: str = ""
    tp: int = 1
    block_size: int = 16
    # KV blocks in each rank's pool; 0 = sized at launch from DeploymentConfig.gpu_memory_utilization
    # (CUDA only: `pushkv up` asks it for a CUDA instance given no --num-blocks)
    num_blocks: int = 2048
    max_num_seqs: int = 32
    max_batch_tokens: int = 8192
    # chunked prefill: a prompt longer than this many tokens is prefilled over several steps,
    # at most this many tokens a step, mixed with the running decodes (0 = never chunk)
    prefill_chunk: int = 0
    # endpoints (filled by the supervisor)
    sched_endpoint: str = ""  # router -> scheduler (ROUTER bind)
    worker_endpoints: tuple[str, ...] = ()  # scheduler -> worker rank r
    writer_endpoints: tuple[str, ...] = ()  # scheduler -> writer rank r
    handshake_endpoints: tuple[str, ...] = ()  # writer rank r, peers connect
    dist_init: str = ""  # torch.distributed init for tp>1
    device: str = "cpu"  # "cpu" or "cuda[:N]"; rank r of a cuda instance uses cuda:N+r
    index: int = 0  # which instance of its role (several P or D on one host); 0 = the first
    # prefix caching: full prompt blocks are indexed by a chained hash of their tokens and reused
    # by later requests (only the uncached suffix is computed); freed blocks stay cached, LRU
    prefix_cache: bool = True
    # the scheduler serves /metrics (vLLM's names) on this TCP port of DeploymentConfig.metrics_host()
    metrics_port: int = 0  # filled by the supervisor (from DeploymentConfig.metrics_port, else a free port)

    def __post_init__(self) -> None:
        check_choices(self)

    @property
    def name(self) -> str:
        """Process-name prefix: ``prefill`` for the first instance (names as before), ``prefill1``, ..."""
        return self.role if self.index == 0 else f"{self.role}{self.index}"

    def source(self):
        """Where a decode leg finds this prefill instance's writers (``messages.PrefillSource``)."""

        return PrefillSource(self.engine_id, self.tp, tuple(self.handshake_endpoints))


class Timeouts(msgspec.Struct, frozen=True):
    registration_wait_s: float = 30.0  # P's finished blocks waiting for D's registration
    write_wait_s: float = 60.0  # D's registered blocks waiting for the WRITE
    transfer_s: float = 30.0  # a posted transfer in flight
    lease_s: float = 30.0  # pull: P's blocks pinned for D's READ
    # pull: while D has the READ queued or running it renews the lease (every lease_s / 3); a
    # lease is never renewed past this many seconds after it was first held
    lease_max_s: float = 300.0
    step_s: float = 120.0  # one forward step on a worker
    request_s: float = 600.0  # router-side bound on one request


class TransferPlan(msgspec.Struct, frozen=True):
    """What a P/D deployment's KV transfers do, decided once where the deployment is planned
    (``kv.layout.plan_transfer``, called by ``supervisor.plan.plan_deployment``) from the mode, the
    stream flags, the model and both roles' block sizes, and carried in the planned config: every
    process reads this, none decides it again from the raw flags (``kv.layout.transfer_of``)."""

    stream: PushStream = "off"  # how P streams a prompt's KV while it computes ("off": one WRITE at the end)
    unit: int = 0  # tokens per streamed part: a whole block of both sides (their lcm); 0: no parts
    split: int = 0  # runs of layers both pools are cut into for a layer stream; 0: one group per attention kind
    groups: int = 1  # layer groups each pool holds (``kv.layout.layer_groups``): marks, parts and checksum rows
    fallback: str = ""  # why a stream the flags ask for is off ("" when none is asked for or it is on)
    direction: Direction = "write"  # push and pull_read "write": P WRITEs; pull otherwise: D READs

    def __post_init__(self) -> None:
        check_choices(self)

    @property
    def sent(self) -> StreamSent:
        """What P's writers say of the stream in ``KVSent.stream``."""
        if self.fallback:
            return "fallback"
        return "" if self.stream == "off" else self.stream

    def describe(self, sent: StreamSent) -> str:
        """A transfer's stream as its stats show it: ``layer``, ``chunk``, ``fallback: <why>`` or ""."""
        return f"fallback: {self.fallback}" if sent == "fallback" else sent


class DeploymentConfig(msgspec.Struct, frozen=True):
    mode: Mode = "push"
    # pull mode, how D fetches P's blocks after the relay: "inline" (READ posted inside D's
    # engine step, blocking it, like the default connector), "background" (READ on D's writer),
    # "write" (D registers its blocks after the relay and P WRITEs them: pull's protocol with
    # push's transfer direction, to separate protocol cost from READ-vs-WRITE transport cost)
    pull_read: PullRead = "background"
    # push: when P's KV leaves for D. "off": one WRITE after the whole prefill; "chunk": each
    # prefill chunk's finished blocks are written as soon as its step ends, while the next chunk
    # computes (needs prefill_chunk); "layer": each layer group's regions as soon as the worker
    # marks them stored (the pools of both sides cut into push_stream_groups layer groups, the first
    # and the last about half the others: kv.layout.split_layers; the default:
    # docs/results/stream_layer). 10 groups (2 + 8 x 4 + 2 layers for 36): on a capped link the link
    # starts on the short first group and little is left after the prompt's end
    # (docs/results/2026-12-02-slow-link/groups/, docs/results/2026-12-03-slow-link-tail/)
    push_stream: PushStream = "layer"
    push_stream_groups: int = 10
    host: str = "127.0.0.1"
    port: int = 8000
    # the router listens on this Unix domain socket instead of host:port (vLLM's --uds; pushkv/uds.py): plain HTTP,
    # the file made 0660 and removed when the router stops
    uds: str = ""
    # the prefix a proxy serves the router's API under (vLLM's --root-path): every route is served under it as well
    # as bare, and the API key guards both
    root_path: str = ""
    # each finished request's spans go to this OpenTelemetry collector (vLLM's --otlp-traces-endpoint; pushkv/otlp.py,
    # router/otlp_spans.py), over OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, the default, or http/protobuf)
    otlp_traces_endpoint: str = ""
    # each instance publishes its prefix cache's events as vLLM's --kv-events-config does (protocol/kv_events.py,
    # scheduler/kv_events_pub.py): off by default
    kv_events: KVEventsConfig = KVEventsConfig()
    # vLLM's --skip-tokenizer-init: the router loads no tokenizer; prompts come as token ids, outputs are token ids
    # with empty text (stop strings, chat, structured output and the parsers refused by name)
    skip_tokenizer_init: bool = False
    # vLLM's --enable-force-include-usage: every stream carries usage, in each chunk and after the last, as if it asked
    # stream_options {"include_usage": true, "continuous_usage_stats": true} (a unary answer always has it)
    force_include_usage: bool = False
    # vLLM's --return-tokens-as-token-ids: a logprob's token is written "token_id:N" unless the request says false
    return_tokens_as_token_ids: bool = False
    # vLLM's --log-config-file (VLLM_LOGGING_CONFIG_PATH): a logging.config.dictConfig JSON object, applied by every
    # process in place of pushkv's own format (processes/common.py); "": pushkv's. The text travels, not the path
    log_config: str = ""
    # each P / D instance's /metrics: the first instance planned gets this port, the next ones the
    # ports after it (P's instances, then D's); 0 = a free port each (shown by `pushkv status`)
    metrics_port: int = 0
    model: ModelConfig = PRESETS["small"]
    prefill: InstanceConfig = InstanceConfig(role="prefill")
    decode: InstanceConfig = InstanceConfig(role="decode")
    local: InstanceConfig = InstanceConfig(role="local")
    timeouts: Timeouts = Timeouts()
    deployment_id: str = ""
    run_dir: str = ""
    control_endpoint: str = ""  # supervisor's ROUTER: Ready / Ping
    events_endpoint: str = ""  # supervisor's PUB: lifecycle events
    trace_endpoint: str = ""  # "" = tracing off; else every process PUBs here
    log_level: str = "INFO"
    max_model_len: int = 0  # 0 = model.max_position
    trace_tap_endpoint: str = ""  # the supervisor's XPUB that taps connect to (set with trace_endpoint)
    # file holding the shared secret every ZMQ socket on a network (tcp://) endpoint derives its
    # CURVE keys from (pushkv/security.py); "" = no CURVE
    secret_file: str = ""
    # Several instances per role on one host: ``prefill``/``decode`` are the template every
    # instance of the role is planned from; ``plan_deployment`` fills ``prefills``/``decodes``
    # (instance i has index i, its own engine id, endpoints and devices; the first one is also
    # ``prefill``/``decode``, so a one-instance deployment reads exactly as before).
    prefill_instances: int = 1
    decode_instances: int = 1
    prefills: tuple[InstanceConfig, ...] = ()
    decodes: tuple[InstanceConfig, ...] = ()
    router_queue: int = 256  # requests waiting at the router for D room; past it: 429
    # choices (a request's n) the router serves at once, queued ones included; past it: 429 with
    # Retry-After, before anything is prefilled (it bounds the router's memory and open streams)
    router_max_in_flight: int = 1024
    # HTTP connections the router holds at once (kept 256 under its open-file limit, which it raises
    # to the hard limit at start); one past it gets 503 with Retry-After, closed before it is read
    router_max_connections: int = 4096
    # a request's headers must arrive within this of its connection's accept (or of the last response
    # on a kept-alive one), its body within the next; else the connection is closed / 408
    router_header_timeout_s: float = 10.0
    router_body_timeout_s: float = 30.0
    # vLLM's --shutdown-timeout: on stop (SIGTERM, SIGINT, pushkv stop) the router refuses new requests (503) and
    # lets those in flight finish for up to this long before it ends the rest (503 "router shutting down") and
    # the instances stop; 0 (vLLM's default): they end at once. A P or D host of several (host_role) marks its
    # instances draining in the registry (chosen for no new request) and stops once they hold no request, or at this
    shutdown_timeout_s: float = 0.0
    # the router serves HTTPS with this key and certificate chain (PEM files; both or neither), and checks client
    # certificates against ssl_ca_certs as ssl_cert_reqs says (0 none, 1 optional, 2 required: Python's ssl.CERT_*)
    ssl_keyfile: str = ""
    ssl_certfile: str = ""
    ssl_ca_certs: str = ""
    ssl_cert_reqs: int = 0
    # vLLM's --enable-ssl-refresh: the router takes the key, certificate and CA files again when they change on disk
    # (a certificate rotated in place), for the connections after (pushkv/tls.py, Refresher)
    ssl_refresh: bool = False
    # cross-origin requests, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials
    # and their defaults (router/cors.py): every origin, method and header, no credentials
    cors_origins: tuple[str, ...] = ("*",)
    cors_methods: tuple[str, ...] = ("*",)
    cors_headers: tuple[str, ...] = ("*",)
    cors_credentials: bool = False
    # push: D blocks reserved and still waiting for their KV may take at most this fraction of a
    # D instance's pool; a request past it falls back to late allocation (D allocates after P)
    push_pin_fraction: float = 0.5
    # conditional disaggregation: per request the router may have D prefill it itself (nothing
    # moves) when the cost model, learned from this deployment's own timings, says that is cheaper
    conditional_disagg: bool = False
    # Several hosts (``pushkv up --role``): the part this host runs: "" = everything (one host),
    # "router", "prefill" or "decode" (that role's instances only, found by the router through
    # ``registry``). Every host is given the same model and geometry.
    host_role: HostRole = ""
    registry: str = ""  # etcd://[user:pass@]HOST:PORT[/prefix]; "" = single-host discovery
    registry_ttl_s: int = 5  # lease TTL: a dead or cut-off host leaves the registry within this
    advertise: str = ""  # this host's address for other hosts: its tcp:// endpoints bind on it
    # Writers keep their loop hot (poll timeout 0, sched_yield) while a transfer with them is
    # expected (P: from D's registration or the end of prefill until the WRITE is done; D: from
    # ExpectKV until the KV is here), each expectation capped by its deadline: a post and its
    # completion then skip the wake-up from an idle sleep, at the price of a core per waiting
    # writer. "auto" = on for CUDA instances, off on the CPU; "on" | "off" force it.
    # See pushkv/writer/poll.py.
    writer_warm: Switch = "auto"
    # P's writers post WRITEs from a second NIXL agent on its own thread (transport/poster.py): over
    # UCX's TCP transport a post returns only when the transfer is done, and the loop would read no
    # notification meanwhile. "auto" = on when UCX_TLS limits UCX to TCP lanes (poster.wanted).
    writer_post_thread: Switch = "auto"
    # P's writers queue the WRITEs bound for each D rank (protocol/link_queue.py) and keep at most
    # link_window of them (and link_window_mib MiB, 0: no byte bound) on the link at a time, the
    # next chosen by link_order: WRITEs that overlap on a slow link share it badly (issue 27).
    # D's writers queue pull's READs from each P instance the same way (writer/decode.py).
    # link_window 0 = auto: when UCX_TLS limits UCX to TCP lanes (as for the poster) 1 WRITE, 2 pull
    # READs (protocol/link_queue.AUTO_WINDOW), else no queue.
    link_window: int = 0
    link_window_mib: int = 0
    link_order: LinkOrder = "arrival"
    # Who moves a GPU pool's KV through host memory when the transport cannot reach GPU memory
    # itself (UCX over TCP): "transport" = UCX's cuda_copy lane, a fragment at a time inside its
    # progress calls; "pushkv" = each writer keeps a pinned host staging area laid out as its pool
    # (staging_mib), P copies each WRITE's blocks into slots of it on a copy stream, the WRITE goes
    # host to host into slots D registered, and D copies them into its blocks before reporting
    # them (writer/staging.py). "auto" = pushkv for
    # push on GPU pools when UCX_TLS limits UCX to TCP lanes, else transport. Both sides of a
    # deployment must agree (the Hello carries the memory kind).
    staging: Staging = "auto"
    # the staging area of each writer, MiB of pinned host memory (0 = auto: 1/16 of the host's memory,
    # never more than the pool): a transfer waits for room in it, one larger than it fails
    staging_mib: int = 0
    # the names a request's "model" may give (vLLM's --served-model-name); none: the model's name
    # (preset or checkpoint directory) and the checkpoint's path. Another name gets 404.
    served_model_name: tuple[str, ...] = ()
    # more names a request's "model" may give, which /v1/models does not list (it lists the served names, as vLLM's):
    # without --served-model-name, the checkpoint directory's name and path beside the --model string
    model_aliases: tuple[str, ...] = ()
    # Verified handoff: P sums the KV it stored per (block, layer group, KV head) in the prefill
    # step; the sums travel with the WRITE's WriteDone (push) or the relay (pull); D's workers
    # recompute them over the landed blocks before the first decode step, and a mismatch fails
    # the request (502). "sample": the first, the last and a few hashed blocks; "full": all.
    # See pushkv/kv/checksum.py and docs/layouts.md.
    kv_verify: KVVerify = "sample"
    # /metrics (the router's and each instance's) needs the API key too (``--metrics-auth``); off:
    # open to scrapers, as vLLM's. The key reaches the router and, with this on, the schedulers
    # through their environment (PUSHKV_API_KEY), never through this file.
    metrics_auth: bool = False
    # vLLM's --gpu-memory-utilization: the fraction of each GPU's memory this host's instances may
    # use (ranks on one GPU share it); a CUDA instance whose num_blocks is 0 gets the KV pool that
    # fraction leaves after its weights and activations (supervisor/kv_sizing.py, at launch)
    gpu_memory_utilization: float = 0.9
    # the chat template's text (pushkv up --chat-template FILE|TEMPLATE, read at launch); "" = the
    # checkpoint's (or the plain one)
    chat_template: str = ""
    # a chat choice's reasoning (<think> ... </think>) as reasoning_content, apart from its content, as vLLM's
    # --reasoning-parser (pushkv/router/reasoning.py); "": the output is all content
    reasoning_parser: ReasoningParser = ""
    # a chat request with tools gets the calls its choices write as tool_calls, as vLLM's --enable-auto-tool-choice
    # --tool-call-parser (pushkv/router/tool_calls.py); "": they come back as text
    tool_call_parser: ToolCallParser = ""
    # what the transfers do, decided by the planner (plan_deployment); None until then
    transfer: Optional[TransferPlan] = None

    def __post_init__(self) -> None:
        check_choices(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} must be in (0, 1]: "
                             "the fraction of each GPU's memory the instances may use")
        if self.link_window < 0 or self.link_window_mib < 0:
            raise ValueError(f"DeploymentConfig.link_window ({self.link_window}) and link_window_mib "
                             f"({self.link_window_mib}) are >= 0 (0: auto / no byte bound)")
        if self.staging_mib < 0:
            raise ValueError(f"DeploymentConfig.staging_mib ({self.staging_mib}) is >= 0 (0: auto)")
        if self.staging == "pushkv" and self.mode != "push":
            raise ValueError(f"DeploymentConfig.staging 'pushkv' stages push's WRITEs; mode {self.mode!r} keeps the "
                             "transport's staging (staging 'auto' or 'transport')")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")
                               or any(ch in self.root_path for ch in "?#{} \t\n")):
            raise ValueError(f"--root-path {self.root_path!r}: a URL path that starts with '/' and does not end with "
                             "one, without ?, #, braces or spaces (e.g. /api)")
        if self.uds and self.ssl_certfile:
            raise ValueError(f"--uds {self.uds} serves plain HTTP to this host's processes: HTTPS (--ssl-certfile) is "
                             "for the router on TCP; give one or the other")
        if self.uds and self.host_role not in ("", "router"):
            raise ValueError(f"--uds {self.uds}: only the host that runs the router (--role router, or one host) "
                             f"listens on it, not --role {self.host_role}")
        if self.skip_tokenizer_init:
            for flag, given in (("--reasoning-parser", self.reasoning_parser), ("--tool-call-parser",
                                                                               self.tool_call_parser),
                                ("--chat-template", self.chat_template)):
                if given:
                    raise ValueError(f"--skip-tokenizer-init with {flag}: {flag} reads the output's text (or writes "
                                     "the prompt's), which a router without a tokenizer has none of")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: the router's HTTPS needs its key and its "
                             f"certificate (got keyfile {self.ssl_keyfile!r}, certfile {self.ssl_certfile!r})")
        if self.ssl_refresh and not self.ssl_certfile:
            raise ValueError("--enable-ssl-refresh takes the certificate files again as they change: it needs "
                             "--ssl-keyfile and --ssl-certfile")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout {self.shutdown_timeout_s} must be >= 0 (seconds the requests in "
                             "flight have to finish at stop; 0: they end at once)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs} must be 0 (none), 1 (optional) or 2 (required)")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs check client certificates of the router's HTTPS: "
                             "give --ssl-keyfile and --ssl-certfile too")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs} checks client certificates against "
                             "--ssl-ca-certs: give it")
        if not 0.0 <= self.push_pin_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"DeploymentConfig.push_pin_fraction (--push-pin-fraction) is "
                             f"{self.push_pin_fraction}: a fraction of D's pool, in [0, 1] (0: every push "
                             f"request allocates late)")

    def metrics_host(self) -> str:
        """Where the instances' /metrics listen: this host's advertised address, else the router's --host."""
        return self.advertise or self.host

    def served_names(self) -> tuple[str, ...]:
        if self.served_model_name:
            return tuple(dict.fromkeys(self.served_model_name + self.model_aliases))
        return tuple(dict.fromkeys(n for n in (self.model.name, self.model.checkpoint) if n))

    def caches_prefixes(self, inst: InstanceConfig) -> bool:
        """Does ``inst`` cache prompt prefixes? Its ``prefix_cache``, but never under dynamic (NTK) RoPE: a cached
        block's keys carry the rotation of the length they were computed at, another request's may differ."""
        return inst.prefix_cache and self.model.rope_scaling.rope_type != "dynamic"

    def role_instances(self, role: Role) -> list[InstanceConfig]:
        """Every planned instance of ``role`` (the template alone before planning)."""
        planned = {"prefill": self.prefills, "decode": self.decodes}.get(role, ())
        return list(planned) if planned else [self.instance(role)]

    def instances(self) -> list[InstanceConfig]:
        """The instances this host runs (every planned one on a single host)."""
        if self.mode == "local":
            return [self.local]
        if self.host_role == "router":
            return []
        if self.host_role in ("prefill", "decode"):
            return self.role_instances(self.host_role)
        return self.role_instances("prefill") + self.role_instances("decode")

    def instance(self, role: Role, index: int = 0) -> InstanceConfig:
        if index:
            return self.role_instances(role)[index]
        return {"prefill": self.prefill, "decode": self.decode, "local": self.local}[role]


TRACE_AUTO = "auto"  # trace_endpoint as the user asks for it: an ipc socket in the run dir, named by the plan

# What the launcher derives from the user's config (supervisor.plan.plan_deployment), never what
# the flags say: ids, the run dir, endpoints and ports, the instances' copies. A config file may pin
# one (the plan keeps what is set); ``unplanned`` takes them out again.
PLANNED_FIELDS = ("deployment_id", "run_dir", "control_endpoint", "events_endpoint", "prefills", "decodes",
                  "transfer")
PLANNED_INSTANCE_FIELDS = ("engine_id", "sched_endpoint", "worker_endpoints", "writer_endpoints",
                           "handshake_endpoints", "dist_init", "index", "metrics_port")


def unplanned(cfg: DeploymentConfig) -> DeploymentConfig:
    """``cfg`` with every planned field back at its default: the user's part of a planned config."""
    blank = DeploymentConfig()
    inst_blank = InstanceConfig(role="local")
    insts = {role: msgspec.structs.replace(
        getattr(cfg, role), **{f: getattr(inst_blank, f) for f in PLANNED_INSTANCE_FIELDS})
        for role in ("prefill", "decode", "local")}
    return msgspec.structs.replace(cfg, **{f: getattr(blank, f) for f in PLANNED_FIELDS}, **insts)


def rank_device(inst: "InstanceConfig", rank: int) -> str:
    """The device of one TP rank: ranks of a GPU instance take consecutive GPUs."""
    if inst.device == "cpu":
        return "cpu"
    base = int(inst.device.split(":")[1]) if ":" in inst.device else 0
    return f"cuda:{base + rank}"


def new_deployment_id() -> str:
    return uuid.uuid4().hex[:8]


def ipc(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


SHM_DIR = "/dev/shm"  # CPU pools live here, one file per writer incarnation


def shm_prefix(deployment_id: str, role: str = "") -> str:
    """File-name prefix of a deployment's pool segments (of one instance, with ``role``)."""
    return f"pushkv-{deployment_id}-{role}-" if role else f"pushkv-{deployment_id}-"


def shm_name(deployment_id: str, role: str, rank: int, incarnation: int = 0) -> str:
    """Pool segment name; ``incarnation`` (the writer's pid) keeps a restarted
    writer's pool apart from a dead predecessor's, which a worker may still map."""
    base = f"{shm_prefix(deployment_id, role)}{rank}"
    return f"{base}-{incarnation}" if incarnation else base


def encode_config(cfg: DeploymentConfig) -> bytes:
    return msgspec.json.encode(cfg)


def decode_config(data: bytes | str) -> DeploymentConfig:
    try:
        return msgspec.json.decode(data, type=DeploymentConfig)
    except msgspec.ValidationError as e:
        raise explain(e, DeploymentConfig) from None


def config_from_builtins(data: dict) -> DeploymentConfig:
    """A DeploymentConfig from plain data (a parsed JSON or TOML file), validated as decoding is."""
    try:
        return msgspec.convert(data, DeploymentConfig)
    except msgspec.ValidationError as e:
        raise explain(e, DeploymentConfig) from None


def marks_endpoint(writer_endpoint: str) -> str:
    """Where a P writer takes its worker's layer marks (layer-streamed push): beside its
    scheduler socket; both are ipc (worker and writer share a host)."""
    if not writer_endpoint.startswith("ipc://"):
        raise ValueError(f"layer marks need an ipc writer endpoint, got {writer_endpoint!r}")
    return writer_endpoint + ".marks"
