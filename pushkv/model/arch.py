"""The one registry of architectures pushkv serves: config.json's ``architectures`` -> the
family's parts (q/k norm, q/k/v bias, which layers slide, the experts' parameter names).

The families share everything else (RMSNorm, GQA attention, RoPE, SwiGLU, the engine), so a
family is a handful of named differences beside the shared parts, not a model class of its own.
Pure, no torch: ``pushkv up`` reads a checkpoint's config through it and refuses what is not
built (:func:`check_supported`) before any process starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pushkv.model.fp8 import fp8_blocks_of


@dataclass(frozen=True)
class MoeParts:
    """Where a mixture-of-experts family keeps its router and experts, and how it says so."""

    block: str  # layer prefix of the MoE block: "mlp" or "block_sparse_moe"
    gate: str  # expert projection names: SwiGLU gate, up, down
    up: str
    down: str
    inter_key: str  # config key of one expert's intermediate size
    norm_topk_key: Optional[str]  # config key of renormalising the chosen weights; None: always
    shared: str = ""  # the shared expert's (always on, beside the routed ones) prefix in the block; "": none
    shared_gate: str = ""  # its gate's name (a sigmoid of h times it scales its output: Qwen2-MoE); "": ungated


def _no_window(hf: dict, num_layers: int) -> tuple[int, ...]:
    return ()


def _every_layer(hf: dict, num_layers: int) -> tuple[int, ...]:
    """Mistral and Mixtral: ``sliding_window`` set means every layer slides."""
    return tuple(range(num_layers)) if hf.get("sliding_window") else ()


def _qwen_windows(hf: dict, num_layers: int) -> tuple[int, ...]:
    """Qwen2/3: ``layer_types`` where written, else layers from ``max_window_layers`` on when
    ``use_sliding_window``."""
    types = hf.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        return tuple(range(hf.get("max_window_layers", 0), num_layers))
    return ()


@dataclass(frozen=True)
class Family:
    qk_norm: bool  # RMSNorm on each query and key head before RoPE (Qwen3)
    qkv_bias: bool  # bias on q/k/v, none on o (Qwen2)
    windows: Callable[[dict, int], tuple[int, ...]]  # the layers that use the sliding window
    moe: Optional[MoeParts] = None
    mla: bool = False  # DeepSeek's multi-head latent attention (pushkv.model.mla), its MoE read by deepseek_of
    # max_position_embeddings where config.json leaves it out: transformers' config class default, which transformers
    # and vLLM (reading transformers' config) then run with
    max_positions: int = 32768
    rope_theta: float = 10000.0  # the RoPE base where config.json names none: transformers' default_theta


QWEN3_MOE = MoeParts("mlp", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size", "norm_topk_prob")
MIXTRAL = MoeParts("block_sparse_moe", "w1", "w3", "w2", "intermediate_size", None)
DEEPSEEK = MoeParts("mlp", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size", "norm_topk_prob",
                    shared="shared_experts")
QWEN2_MOE = MoeParts("mlp", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size", "norm_topk_prob",
                     shared="shared_expert", shared_gate="shared_expert_gate")

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(qk_norm=False, qkv_bias=False, windows=_no_window, max_positions=2048),
    "MistralForCausalLM": Family(qk_norm=False, qkv_bias=False, windows=_every_layer, max_positions=4096 * 32),
    "Qwen2ForCausalLM": Family(qk_norm=False, qkv_bias=True, windows=_qwen_windows),
    "Qwen3ForCausalLM": Family(qk_norm=True, qkv_bias=False, windows=_qwen_windows),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, qkv_bias=False, windows=_qwen_windows, moe=QWEN3_MOE),
    "Qwen2MoeForCausalLM": Family(qk_norm=False, qkv_bias=True, windows=_qwen_windows, moe=QWEN2_MOE),
    "MixtralForCausalLM": Family(qk_norm=False, qkv_bias=False, windows=_every_layer, moe=MIXTRAL,
                                 max_positions=4096 * 32, rope_theta=1e6),
    "DeepseekV2ForCausalLM": Family(qk_norm=False, qkv_bias=False, windows=_no_window, moe=DEEPSEEK, mla=True,
                                    max_positions=2048),
    "DeepseekV3ForCausalLM": Family(qk_norm=False, qkv_bias=False, windows=_no_window, moe=DEEPSEEK, mla=True,
                                    max_positions=4096),
}
# DeepSeek's routings as their configs name them: (scoring_func, topk_method) -> how pushkv routes (MoeRouting)
DEEPSEEK_ROUTINGS = {("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc")}

# config.json keys that, set, name an attention or model variant no family here builds
VARIANTS = {
    "attention_bias": "a bias on q/k/v and o projections",
    "mlp_bias": "biases on the MLP projections",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "attention_chunk_size": "chunked local attention",
    "query_pre_attn_scalar": "a query scale other than 1/sqrt(head_dim)",
    "no_rope_layers": "layers without RoPE",
    "shared_expert_intermediate_size": "a shared expert",
}


def family_of(hf: dict) -> tuple[str, Family]:
    """The registry's entry for config.json's ``architectures``, or a ValueError naming them."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise ValueError(f"architectures {archs!r} is not a list")
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"architectures {archs}: not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch, ARCHITECTURES[arch]


def moe_parts(architecture: str) -> MoeParts:
    """Expert parameter names of a family; pushkv's own random MoE is named as Qwen3-MoE."""
    fam = ARCHITECTURES.get(architecture)
    return fam.moe if fam is not None and fam.moe is not None else QWEN3_MOE


def check_supported(hf: dict, arch: str, family: Family) -> None:
    """Refuse, by field and value, what config.json asks for that no part here builds."""
    fp8_blocks_of(hf)  # a quantization_config other than block-scaled fp8 is refused by name
    q = hf.get("compression_config")
    if q:
        method = q.get("quant_method", q.get("format")) if isinstance(q, dict) else q
        raise ValueError(f"compression_config: quant_method {method!r} is not supported: pushkv loads float32, "
                         "bfloat16 and float16 weights, and block-scaled fp8 (quantization_config)")
    for key, what in VARIANTS.items():
        if key == "shared_expert_intermediate_size" and family.moe is not None and family.moe.shared_gate:
            continue  # Qwen2-MoE's gated shared expert: built
        if hf.get(key):
            raise ValueError(f"{key}: {hf[key]!r} ({what}) is not built for {arch}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf['hidden_act']!r} is not supported (only 'silu')")
    if family.mla:
        _check_deepseek(hf, arch)
    if family.moe is not None:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError(f"decoder_sparse_step {hf.get('decoder_sparse_step', 1)} / mlp_only_layers "
                             f"{hf.get('mlp_only_layers')}: dense layers between MoE layers are not built")
        if int(hf.get("num_experts_per_tok") or 0) < 1:
            raise ValueError(f"num_experts_per_tok: {hf.get('num_experts_per_tok')!r} must be >= 1")


def deepseek_routing(hf: dict, arch: str) -> tuple[str, str]:
    """(scoring_func, topk_method) of a DeepSeek config: V2's default softmax and greedy, V3's sigmoid and noaux_tc
    (transformers' DeepSeek-V3 routes so whatever its config names)."""
    if arch == "DeepseekV3ForCausalLM":
        return "sigmoid", "noaux_tc"
    return hf.get("scoring_func") or "softmax", hf.get("topk_method") or "greedy"


def _check_deepseek(hf: dict, arch: str) -> None:
    routing = deepseek_routing(hf, arch)
    if arch == "DeepseekV3ForCausalLM" and (hf.get("scoring_func") or "sigmoid", hf.get("topk_method") or
                                            "noaux_tc") != routing:
        raise ValueError(f"scoring_func {hf.get('scoring_func')!r} / topk_method {hf.get('topk_method')!r}: "
                         f"{arch} routes by sigmoid and noaux_tc only")
    if routing not in DEEPSEEK_ROUTINGS:
        raise ValueError(f"scoring_func {routing[0]!r} with topk_method {routing[1]!r} is not supported "
                         f"(supported: {sorted(DEEPSEEK_ROUTINGS)})")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise ValueError(f"moe_layer_freq: {hf['moe_layer_freq']!r}: only every layer past first_k_dense_replace "
                         "an MoE layer (1) is built")
    nope, v = hf.get("qk_nope_head_dim"), hf.get("v_head_dim")
    if not nope or v != nope:
        raise ValueError(f"v_head_dim {v!r} with qk_nope_head_dim {nope!r}: only equal widths are built")
    if not hf.get("kv_lora_rank") or not hf.get("qk_rope_head_dim"):
        raise ValueError(f"kv_lora_rank {hf.get('kv_lora_rank')!r} / qk_rope_head_dim {hf.get('qk_rope_head_dim')!r} "
                         "must both be set")
    groups, experts = int(hf.get("n_group") or 1), num_experts_of(hf)
    if routing[1] != "greedy" and (experts % groups or not 1 <= int(hf.get("topk_group") or 1) <= groups):
        raise ValueError(f"n_group {groups} / topk_group {hf.get('topk_group')!r} do not divide "
                         f"{experts} experts into groups to choose from")


def num_experts_of(hf: dict) -> int:
    """transformers 5 writes ``num_local_experts``; Qwen3-MoE's own configs ``num_experts``, DeepSeek's
    ``n_routed_experts``."""
    return int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0)
