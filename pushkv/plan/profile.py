"""Hardware profiles: the cost model's parameters for one deployment, and what the planner needs
besides them (block size, P's and D's KV capacity, the router's relay for pull, layer groups for push).

A profile is the router's own ``Costs`` (``pushkv status`` / ``/health``'s ``costs``, read from
a running deployment or measured by ``pushkv bench``) or one derived on paper from a link and a
model (``derived``), so the planner routes with exactly the prices the router uses.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from pushkv.kinds import LinkOrder
from pushkv.protocol.link_queue import ORDERS
from pushkv.router.cost import Costs


@dataclass(frozen=True)
class Profile:
    name: str
    costs: Costs
    block_size: int = 16
    d_capacity_tokens: int = 1 << 30  # KV tokens one D instance holds (requests wait at the router past it)
    relay_ms: float = 1.0  # pull: P's answer through the router to D before D's READ
    layer_groups: int = 4  # push-layer: a group's blocks leave as soon as it is stored
    # the layers of each group as the pools cut them (kv.layout.split_layers); empty: layer_groups
    # equal groups (what runs before the cut's short first and last groups had)
    group_layers: tuple[int, ...] = ()
    # push-layer: at the prefill's end the rest leaves at once as one more part (beyond PARTS_AHEAD), as
    # P's rendezvous asks it since 2026-12-03; False: it waited for the last WRITE (runs before)
    rest_at_end: bool = True
    # the link each P -> D pair shares (plan/link.py): None = no link model, each transfer alone at
    # the handoff's rate however many overlap; else P's WRITEs in flight per link (0: all at once,
    # as a fast link's writer posts them), taken in link_order, every transfer on the link sharing
    # its rate, and the link moving link_overlap_share of one transfer's rate with several on it
    link_window: Optional[int] = None
    # D's READs from one P in flight at once (its writer's read queue; 0: every READ at once); None: link_window
    read_window: Optional[int] = None
    link_order: LinkOrder = "arrival"
    link_overlap_share: float = 1.0
    # P's step (plan/prefill_step.py): the prompts waiting when a step ends go in the next one
    # together up to this many tokens and prompts (the deployment's --max-batch-tokens and
    # --max-num-seqs); 0 tokens: one prompt a step
    max_batch_tokens: int = 0
    max_num_seqs: int = 64
    # every P and D on one device (a one-GPU deployment): the GPU is time-sliced between the steps
    # that run at once, so each computes at an equal share of it (two at once: each at half speed)
    one_device: bool = False
    # the transfers are staged by the transport through that one device (UCX's cuda_copy on a GPU):
    # none moves while a prefill computes on it (plan/link.py, "Held")
    staged_holds: bool = False
    # KV tokens one P instance holds: a prompt holds its blocks on P from its admission until its KV
    # has left (push: P's last WRITE; pull: D's READ), and prompts wait at P past it, in arrival order
    p_capacity_tokens: int = 1 << 30
    note: str = ""

    def __post_init__(self) -> None:
        if self.read_window is not None and self.read_window < 0:
            raise ValueError(f"profile {self.name}: read_window {self.read_window} < 0 (0: every READ at once)")
        if self.link_window is not None and self.link_window < 0:
            raise ValueError(f"profile {self.name}: link_window {self.link_window} < 0 (0: every WRITE at once)")
        if self.link_order not in ORDERS:
            raise ValueError(f"profile {self.name}: link_order {self.link_order!r} is not one of {', '.join(ORDERS)}")
        if not 0 < self.link_overlap_share <= 1:
            raise ValueError(f"profile {self.name}: link_overlap_share {self.link_overlap_share} is not in (0, 1]")
        if self.max_batch_tokens < 0 or self.max_num_seqs < 1:
            raise ValueError(f"profile {self.name}: max_batch_tokens {self.max_batch_tokens} < 0 or max_num_seqs "
                             f"{self.max_num_seqs} < 1 (0 tokens: one prompt a step)")
        if self.group_layers and (len(self.group_layers) != self.layer_groups or min(self.group_layers) < 1):
            raise ValueError(f"profile {self.name}: group_layers {self.group_layers} is not {self.layer_groups} "
                             f"groups of at least one layer")
        if self.link_window is not None and self.costs.handoff_ms_per_block <= 0:
            raise ValueError(f"profile {self.name}: the link model needs handoff_ms_per_block > 0 (the link's rate)")

    def stored_share(self, groups: int) -> tuple[int, int]:
        """How much of a prompt's KV (and of P's step) the first ``groups`` groups are, as a
        fraction ``(num, den)``."""
        if not self.group_layers:
            return groups, self.layer_groups
        return sum(self.group_layers[:groups]), sum(self.group_layers)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["costs"] = self.costs.as_dict()
        return d


def from_dict(d: dict) -> Profile:
    """A profile from JSON: {"name", "costs": {...Costs fields...}, "block_size", ...}; a plain
    /health body (its "costs") works too."""
    c = {k: v for k, v in (d.get("costs") or {}).items() if k in Costs.__dataclass_fields__}
    rest = {k: v for k, v in d.items() if k in Profile.__dataclass_fields__ and k not in ("costs",)}
    rest.setdefault("name", "measured")
    return Profile(costs=Costs(**c), **rest)


def derived(name: str, *, prefill_ms_per_token: float, prefill_ms_fixed: float, kv_bytes_per_token: int,
            link_gb_s: float, link_latency_ms: float, step_ms_fixed: float, step_ms_per_seq: float,
            step_ms_per_kctx: float, block_size: int, d_capacity_tokens: int, relay_ms: float,
            note: str = "") -> Profile:
    """A profile on paper: the handoff from the KV's size and the link (bytes per block / bandwidth)."""
    per_block_ms = kv_bytes_per_token * block_size / (link_gb_s * 1e9) * 1e3
    costs = Costs(prefill_ms_fixed=prefill_ms_fixed, prefill_ms_per_token=prefill_ms_per_token,
                  prefill_ms_per_cached_token=prefill_ms_per_token / 100,
                  handoff_ms_fixed=link_latency_ms, handoff_ms_per_block=per_block_ms,
                  step_ms_fixed=step_ms_fixed, step_ms_per_seq=step_ms_per_seq, step_ms_per_kctx=step_ms_per_kctx)
    return Profile(name, costs, block_size=block_size, d_capacity_tokens=d_capacity_tokens, relay_ms=relay_ms,
                   note=note)


# Profiles on paper for the questions the planner answers (docs/results/plan/): Qwen3-32B, TP 8
# on H200 nodes. Prefill and decode figures are the one-H200 roofline (docs/results/
# gpu_roofline_32b.txt: 16k prefill 2,777 ms; decode step 18.6-26.8 ms) scaled to 8 ranks at
# 85 % efficiency; KV 256 KiB per token (64 layers x 8 KV heads x 128 x K,V x bf16); D's
# capacity what 8 x 141 GB holds after the weights (65 GB) at that size.
QWEN3_32B_TP8: dict[str, Any] = dict(prefill_ms_per_token=2777.0 / 16384 / (8 * 0.85), prefill_ms_fixed=5.0,
                     kv_bytes_per_token=64 * 8 * 128 * 2 * 2, step_ms_fixed=18.6 / (8 * 0.85) + 4.0,
                     step_ms_per_seq=0.06, step_ms_per_kctx=0.01, block_size=16,
                     d_capacity_tokens=int((8 * 141e9 - 65e9) / (64 * 8 * 128 * 2 * 2)), relay_ms=0.5)
PRESETS = {
    "qwen3-32b-tp8-rdma": lambda: derived(
        "qwen3-32b-tp8-rdma", link_gb_s=8 * 400 / 8 * 0.7, link_latency_ms=0.05, **QWEN3_32B_TP8,
        note="8 x 400 Gb/s RDMA per node at 70 % (NIXL over UCX/IB)"),
    "qwen3-32b-tp8-tcp": lambda: derived(
        "qwen3-32b-tp8-tcp", link_gb_s=25 / 8 * 0.8, link_latency_ms=0.2, **QWEN3_32B_TP8,
        note="one 25 Gb/s TCP link per node at 80 % (UCX over TCP)"),
}
