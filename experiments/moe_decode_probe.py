"""Qwen3-30B-A3B's decode step on a GPU at small batches: the step with and without each change of the
decode path, through the CUDA graphs the worker replays, and where a batch-1 step spends its time.

Variants (each re-captures the graphs):
- ``before``: no programmatic dependent launch (``kernels.chain.ON`` off) and the router's matmul as its own
  launch (``batched.ROUTER_IN_NORM_TOKENS = 0``): the defaults before this probe's first GPU run (both are on
  now, from its figures: docs/results/2026-12-04-moe-decode);
- ``router``: the router's logits made in the post-attention norm's launch (``add_rms_router``), up to 16
  tokens;
- ``pdl``: the Triton kernels chained by programmatic dependent launch;
- ``both``; ``router_128``: both, the router's logits in the norm up to 128 tokens;
- ``ungrouped``: both, with ``PUSHKV_MOE_DECODE=ungrouped``: a step of up to 8 tokens takes the GEMV kernels
  that route each slot themselves (``triton_moe_decode``), so the router in the norm leaves two launches for
  the experts where the grouped path keeps three (routing and grouping, gate/up, down);
- ``gemv_alone``: the router in the norm and the qkv and o projections of up to 8 tokens as GEMVs
  (``kernels/triton_gemv.py``, ``batched.GEMV_TOKENS``) instead of cuBLAS, unchained; ``gemv``: the same,
  chained, so each GEMV's weights stream in while the kernel before it runs; ``gemv_4``, ``gemv_2``: chained,
  4 and 2 output columns a program (fewer registers each, so more of the weights resident early); ``gemv1_2``:
  the GEMVs of 2 columns at one token only, as shipped since 2026-12-04's GPU run of their float32 test;
- ``self_route``: ``gemv1_2`` with a one-token step routed by the MoE gate/up kernel itself, no routing launch
  (``triton_moe.SELF_ROUTE_ONE_TOKEN``); ``fused_merge``: ``gemv1_2`` with the split decode attention merged by
  its last program, no merge launch (``triton_paged.FUSED_MERGE``); ``self_route_merge``: both;
- ``down_gemv_N``: ``gemv1_2`` with the MoE down projections of a one-token step as GEMVs of N columns a
  program that load their experts' weights before they wait for gate/up (``triton_moe.DOWN_GEMV_TOKENS``,
  ``DOWN_GEMV_COLUMNS``); ``down_gemv2_8``: the same to two tokens, 8 columns;
- ``prefetch_down``: ``gemv1_2`` with the grouped gate/up programs asking L2 for their experts' down weights
  (``triton_moe.PREFETCH_DOWN_TOKENS``, kernels/prefetch.py), up to 8 tokens;
- ``ungrouped1``: ``gemv1_2`` with the ungrouped MoE decode kernels (two launches); ``ungrouped_prefetch``: their
  gate/up asking L2 for the down weights (``triton_moe_decode.PREFETCH_DOWN``); ``one_launch``: gate/up and down
  in one launch (``triton_moe_decode.ONE_LAUNCH``); ``one_launch_prefetch``: both;
- ``ahead_o``: ``gemv1_2`` with a launch that asks L2 for the o projection's weights while the attention runs
  (``batched.AHEAD``, kernels/prefetch.py), up to 8 tokens; ``ahead_o_route``, ``ahead_o_sum``: also the next
  layer's qkv, while the MoE routes or while the residual add sums the experts; ``ahead_all``: ``ahead_o_sum``
  with ``prefetch_down``;
- ``own``: ``gemv1_2`` with each grouped gate/up and down program asking L2 for its own weight rows at once before
  its pipelined loads (``triton_moe.PREFETCH_OWN_TOKENS``), up to 8 tokens; ``own_down``: with ``prefetch_down``;
  ``own_all``: with ``ahead_all``;
- ``ungrouped_own``: ``ungrouped_prefetch`` with each ungrouped program asking for its own rows first
  (``triton_moe_decode.PREFETCH_OWN``; a down program its rows of all k experts at once); ``one_launch_own``: the
  same in one launch; ``one_launch_all``: that with the o and next qkv weights ahead;
- ``ahead_kv``: ``gemv1_2`` with each decode attention program asking L2 for its first key tile before it waits
  (``triton_paged.PREFETCH_KV``); ``own_all_kv``: ``own_all`` with that;
- ``prefetch_down_l2``, ``own_all_l2``, ``one_launch_all_l2``: those with the device's most L2 set aside for
  evict-last lines (``cuda_driver.persisting_l2``). CUDA gives persisting lines their priority within that
  set-aside, which starts at 0; these variants tell whether the evict-last asks (the down weights, the weights
  ahead) need it to outlast the expert weights streaming past before they are read;
- ``router_late``: the shipped step with ``add_rms_router``'s programs loading their router rows after they wait
  (``triton_fused.ROUTER_EARLY`` off, as before 2026-12-05's run). Six more changes to the one-token step's small
  kernels were timed on 2026-12-05 and taken out (docs/results/2026-12-05-small-kernels).
- ``early_o``: the shipped step with the decode attention and its merge letting the next kernel be scheduled as
  their programs start, before they wait (``chain.EARLY_NEXT``), so the o GEMV's programs load their weights while
  the attention waits and runs, not only during the merge; ``early_qkv``: the layer's first norm so, for the qkv
  GEMV (its weights then load during the experts' down projection); ``early_o_qkv``: both; ``early_small``: every
  small kernel so (the norms, RoPE, attention, merge, routing); ``early_small_gemv``: and the GEMVs; ``early_all``:
  and the experts' kernels; ``early_o_rope``, ``early_o_gemv``, ``early_o_route``, ``early_o_moe``: ``early_o`` and
  the RoPE kernel, the GEMVs, the GEMVs, norm and routing, and those and the experts'. ``early_o`` ships since
  2026-12-05's run (the same step as ``gemv1_2``, kept under its name); ``early_none``: as before it. Two more were
  timed on 2026-12-05 and taken out (docs/results/2026-12-05-rope-guess): the attention doing RoPE and the K/V
  store itself, and gate/up guessing its experts ahead of the routing.
- ``grouped``: the shipped step with a one- or two-token step's experts through the grouped kernels, as before
  2026-12-06's whole-row GEMVs (``triton_moe.ROWS_ONE_TOKEN``, ``DOWN_ROWS_ONE_TOKEN``, shipped since: gate/up one
  row of each a program on 2 warps, down 4 rows on 4); ``rows_up``, ``rows_down``: one of the two only; ``rows_up_w4``,
  ``rows_up_2``, ``rows_both``, ``rows_both_4``, ``rows_down_R_W``: other rows and warps; ``rows_few_N``: the
  whole-row kernels for steps of up to N tokens (``triton_moe.ROWS_TOKENS``: 2 ships since 2026-12-06's run, the
  same step as ``gemv1_2``; ``rows_few_1``: as before); ``rows_few_2_up``: gate/up's for two tokens, down by the
  grouped kernel.
- ``gemv_tok_N``: the shipped step with the qkv and o projections of steps of up to N tokens as the GEMVs that load
  their weights before they wait (``batched.GEMV_TOKENS``: 2 ships since 2026-12-06's run, the same step as
  ``gemv1_2``; ``gemv_tok_1``: as before), not cuBLAS.
- ``route_few_N``: steps of 2 up to N tokens routed and grouped in one program's registers
  (``triton_moe.ROUTE_FEW_TOKENS``: 8 ships since 2026-12-06's run, on 1 warp up to 4 tokens and 4 above), on one
  warp; ``route_few_N_W`` on W warps; ``route_few_0``: the general kernel, as before. The same tables and bits.
- ``seven_copies``: the shipped step with a replay's step arrays copied in as before 2026-12-06 (the host arrays to
  the device, then each of five vectors and the table into the graph apart: seven launches, not two).

``--variants both,gemv1_2`` times only those.

For each: the step's time at each --batches (context --ctx) against the bytes bound (``pushkv roofline``'s:
the weights and K/V a step reads, the experts counted as chosen, at the copy rate measured in the same
run); the chained variants' logits against the unchained ones' (the same bits: chaining changes no
arithmetic), and the router's own dot against cuBLAS's and the ungrouped kernels against the grouped (close,
and how often the greedy token agrees; the GEMVs against cuBLAS likewise). Then a profile of a batch-1 graph
replay (``--profile-batch``), before, with both and with the chained GEMVs: each kernel's GPU time a layer, and the
time no kernel runs.

    python3 -m experiments.moe_decode_probe --out DIR    (from the checkout's root; a few minutes on an H200)

writes DIR/moe_decode.json and DIR/moe_decode.md; ``--plot DIR/moe_decode.json --out DIR`` then draws
DIR/moe_decode.png (each batch's variants against the bound, the shipped step marked) where matplotlib is.
With ``--sweep-tokens 1,2,8,16,64`` it sweeps the grouped
MoE kernels' decode tiles instead (gate/up and down apart, ``TILE_SWEEP``; each kernel alone over the 48 layers,
captured in a CUDA graph; output checked against the shipped tile's) and writes DIR/moe_decode_tiles.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from typing import NamedTuple

import torch

from pushkv import cuda_driver
from pushkv.model import batched
from pushkv.model.kernels import chain, triton_gemv
from tools.roofline import (
    _time,
    chosen_experts,
    copy_bandwidth,
    decode_bound,
    decode_seqs,
    load,
    matmul_rate,
    model_counts,
)


class Flags(NamedTuple):
    """A variant's switches: chained launches, the router in the norm up to this many tokens, the MoE decode
    kernels of up to 8 tokens, the qkv and o GEMVs up to this many tokens and their columns a program; then what a
    variant leaves out unless it names it."""

    chain: bool
    router_tokens: int
    moe_decode: str
    gemv_tokens: int
    gemv_columns: int
    self_route: bool = False  # triton_moe.SELF_ROUTE_ONE_TOKEN
    fused_merge: bool = False  # triton_paged.FUSED_MERGE
    down_gemv_tokens: int = 0  # triton_moe.DOWN_GEMV_TOKENS
    down_gemv_columns: int = 8  # triton_moe.DOWN_GEMV_COLUMNS
    prefetch_down_tokens: int = 0  # triton_moe.PREFETCH_DOWN_TOKENS
    one_launch: bool = False  # triton_moe_decode.ONE_LAUNCH
    prefetch_down: bool = False  # triton_moe_decode.PREFETCH_DOWN
    ahead_tokens: int = 0  # batched.AHEAD_TOKENS
    ahead: frozenset = frozenset({"o"})  # batched.AHEAD
    prefetch_own_tokens: int = 0  # triton_moe.PREFETCH_OWN_TOKENS
    prefetch_own: bool = False  # triton_moe_decode.PREFETCH_OWN
    prefetch_kv: bool = False  # triton_paged.PREFETCH_KV
    l2_set_aside: bool = False  # the device's most L2 set aside for evict-last lines (cuda_driver.persisting_l2)
    persistent: bool = False  # triton_moe.PERSISTENT_ONE_TOKEN
    persistent_per_sm: int = 3  # triton_moe_token.PER_SM
    router_early: bool = False  # triton_fused.ROUTER_EARLY
    early_next: frozenset = frozenset()  # chain.EARLY_NEXT
    route_one: bool = False  # triton_moe.ROUTE_ONE_TOKEN
    one_token_tiles: object = None  # triton_moe.ONE_TOKEN_TILES (a Tiles)
    rows_up: bool = False  # triton_moe.ROWS_ONE_TOKEN
    rows_down: bool = False  # triton_moe.DOWN_ROWS_ONE_TOKEN
    rows: int = 1  # triton_moe.ROWS
    rows_warps: int = 4  # triton_moe.ROWS_WARPS
    down_rows: int = 8  # triton_moe.DOWN_ROWS
    down_rows_warps: int = 4  # triton_moe.DOWN_ROWS_WARPS
    rows_tokens: int = 1  # triton_moe.ROWS_TOKENS
    route_few: int = 0  # triton_moe.ROUTE_FEW_TOKENS
    route_few_warps: tuple = (1, 4)  # triton_moe.ROUTE_FEW_WARPS
    # a replay's copies of its step arrays: 1 (batched.ONE_COPY_ENTRIES, the table staged at the graph's width),
    # 2 (the table rows at the step's width, then spread into the graph's table) or 7 (as before 2026-12-06)
    input_copies: int = 1


# the kernels before the o GEMV (the decode attention and its merge) letting it be scheduled as they start, so its
# weights load while they wait and run (shipped since 2026-12-05's run); then every kernel but the GEMVs and the
# experts' (which hold the SMs longest)
_EARLY_O = frozenset({"attn", "merge"})
_EARLY_SMALL = frozenset({"add_rms", "rope", "attn", "merge", "norm_router", "route"})
# the shipped step (``gemv1_2``); the key-tile prefetch is on since 2026-12-05's run (``ahead_kv``: the same step,
# kept under its name; ``no_kv``: without it)
SHIPPED = Flags(True, 16, "grouped", 2, 2, prefetch_kv=True, router_early=True, early_next=_EARLY_O,
                route_one=True, rows_up=True, rows_down=True, rows_warps=2, down_rows=4, rows_tokens=2,
                route_few=8)
_UNGROUPED = SHIPPED._replace(moe_decode="ungrouped")
_OWN_ALL = SHIPPED._replace(prefetch_down_tokens=8, ahead_tokens=8, ahead=frozenset({"o", "qkv_sum"}),
                            prefetch_own_tokens=8)
VARIANTS = {"before": Flags(False, 0, "grouped", 0, 8), "router": Flags(False, 16, "grouped", 0, 8),
            "pdl": Flags(True, 0, "grouped", 0, 8), "both": Flags(True, 16, "grouped", 0, 8),
            "router_128": Flags(True, 128, "grouped", 0, 8), "ungrouped": Flags(True, 16, "ungrouped", 0, 8),
            "gemv_alone": Flags(False, 16, "grouped", 8, 8), "gemv": Flags(True, 16, "grouped", 8, 8),
            "gemv_4": Flags(True, 16, "grouped", 8, 4), "gemv_2": Flags(True, 16, "grouped", 8, 2),
            "gemv1_2": SHIPPED,
            "self_route": SHIPPED._replace(self_route=True), "fused_merge": SHIPPED._replace(fused_merge=True),
            "self_route_merge": SHIPPED._replace(self_route=True, fused_merge=True),
            "down_gemv_4": SHIPPED._replace(down_gemv_tokens=1, down_gemv_columns=4),
            "down_gemv_8": SHIPPED._replace(down_gemv_tokens=1, down_gemv_columns=8),
            "down_gemv_16": SHIPPED._replace(down_gemv_tokens=1, down_gemv_columns=16),
            "down_gemv2_8": SHIPPED._replace(down_gemv_tokens=2, down_gemv_columns=8),
            "prefetch_down": SHIPPED._replace(prefetch_down_tokens=8),
            "ungrouped1": _UNGROUPED,
            "ungrouped_prefetch": _UNGROUPED._replace(prefetch_down=True),
            "one_launch": _UNGROUPED._replace(one_launch=True),
            "one_launch_prefetch": _UNGROUPED._replace(one_launch=True, prefetch_down=True),
            "ahead_o": SHIPPED._replace(ahead_tokens=8),
            "ahead_o_route": SHIPPED._replace(ahead_tokens=8, ahead=frozenset({"o", "qkv_route"})),
            "ahead_o_sum": SHIPPED._replace(ahead_tokens=8, ahead=frozenset({"o", "qkv_sum"})),
            "ahead_all": SHIPPED._replace(prefetch_down_tokens=8, ahead_tokens=8, ahead=frozenset({"o", "qkv_sum"})),
            "own": SHIPPED._replace(prefetch_own_tokens=8),
            "own_down": SHIPPED._replace(prefetch_down_tokens=8, prefetch_own_tokens=8),
            "own_all": _OWN_ALL,
            "ungrouped_own": _UNGROUPED._replace(prefetch_down=True, prefetch_own=True),
            "one_launch_own": _UNGROUPED._replace(one_launch=True, prefetch_down=True, prefetch_own=True),
            "one_launch_all": _UNGROUPED._replace(one_launch=True, prefetch_down=True, prefetch_own=True,
                                                  ahead_tokens=8, ahead=frozenset({"o", "qkv_sum"})),
            "ahead_kv": SHIPPED._replace(prefetch_kv=True),
            "persistent": SHIPPED._replace(persistent=True),
            "persistent_1": SHIPPED._replace(persistent=True, persistent_per_sm=1),
            "persistent_2": SHIPPED._replace(persistent=True, persistent_per_sm=2),
            "persistent_4": SHIPPED._replace(persistent=True, persistent_per_sm=4),
            "no_kv": SHIPPED._replace(prefetch_kv=False),
            "router_late": SHIPPED._replace(router_early=False),
            "early_o": SHIPPED._replace(early_next=_EARLY_O),
            "early_none": SHIPPED._replace(early_next=frozenset()),
            "early_qkv": SHIPPED._replace(early_next=frozenset({"add_rms"})),
            "early_o_qkv": SHIPPED._replace(early_next=_EARLY_O | {"add_rms"}),
            "early_small": SHIPPED._replace(early_next=_EARLY_SMALL),
            "early_small_gemv": SHIPPED._replace(early_next=_EARLY_SMALL | {"gemv"}),
            "early_all": SHIPPED._replace(early_next=chain.NAMES),
            "early_o_rope": SHIPPED._replace(early_next=_EARLY_O | {"rope"}),
            "early_o_gemv": SHIPPED._replace(early_next=_EARLY_O | {"gemv"}),
            "early_o_route": SHIPPED._replace(early_next=_EARLY_O | {"gemv", "norm_router", "route"}),
            "early_o_moe": SHIPPED._replace(early_next=_EARLY_O | {"gemv", "norm_router", "route", "gate_up", "down"}),
            # a one-token step's routing in registers (triton_moe.ROUTE_ONE_TOKEN, shipped since 2026-12-06's run):
            # the same tables and bits; route_general: the general kernel, as before
            "route_one": SHIPPED._replace(route_one=True),
            "route_general": SHIPPED._replace(route_one=False),
            # a one-token step's gate/up, down or both as whole-row GEMVs (triton_moe.ROWS_ONE_TOKEN,
            # DOWN_ROWS_ONE_TOKEN): gate/up 1 row (of each) a program on 4 warps (rows_both_4: 4 on 8), down 8 rows on
            # 4 warps, or rows_down_R_W: R rows on W warps
            "rows_up": SHIPPED._replace(rows_down=False),
            "rows_down": SHIPPED._replace(rows_up=False),
            "rows_both": SHIPPED._replace(down_rows=8),
            "rows_up_w4": SHIPPED._replace(rows_warps=4),
            "rows_up_2": SHIPPED._replace(rows=2),
            "rows_both_4": SHIPPED._replace(rows_up=True, rows_down=True, rows=4, rows_warps=8, down_rows=4,
                                            down_rows_warps=8),
            **{f"rows_down_{r}_{w}": SHIPPED._replace(rows_up=True, rows_down=True, down_rows=r, down_rows_warps=w)
               for r, w in ((2, 4), (4, 4), (16, 4), (16, 8), (32, 8))},
            "grouped_up": SHIPPED._replace(rows_up=False),
            # the grouped kernels for gate/up and down at one token, as shipped before 2026-12-06's rows
            "grouped": SHIPPED._replace(rows_up=False, rows_down=False),
            # the whole-row kernels for steps of up to N tokens (triton_moe.ROWS_TOKENS, 2 shipped since 2026-12-06's
            # run; rows_few_1: as before it), each block's rows read once
            **{f"rows_few_{n}": SHIPPED._replace(rows_tokens=n) for n in (1, 2, 4, 8)},
            # the qkv and o projections as GEMVs (kernels/triton_gemv.py) for steps of up to N tokens, not cuBLAS
            # (batched.GEMV_TOKENS, 1 shipped)
            **{f"gemv_tok_{n}": SHIPPED._replace(gemv_tokens=n) for n in (1, 2, 4, 8)},
            # steps of 2 up to N tokens routed in one program's registers (triton_moe.ROUTE_FEW_TOKENS, 8 shipped since
            # 2026-12-06's run: 1 warp up to 4 tokens, 4 above), on 1 warp (route_few_N_W: on W); the same tables and
            # bits; route_few_0: the general kernel, as before
            **{f"route_few_{n}": SHIPPED._replace(route_few=n, route_few_warps=(1, 1)) for n in (0, 2, 4, 8)},
            **{f"route_few_{n}_{w}": SHIPPED._replace(route_few=n, route_few_warps=(w, w)) for n in (4, 8)
               for w in (2, 4)},
            # a replay's step arrays copied in seven launches, as before 2026-12-06's two; in two, as before one
            "seven_copies": SHIPPED._replace(input_copies=7), "two_copies": SHIPPED._replace(input_copies=2),
            # gate/up's rows for two tokens, their down by the grouped kernel
            "rows_few_2_up": SHIPPED._replace(rows_tokens=2, rows_down=False),
            "own_all_kv": _OWN_ALL._replace(prefetch_kv=True),
            "prefetch_down_l2": SHIPPED._replace(prefetch_down_tokens=8, l2_set_aside=True),
            "own_all_l2": _OWN_ALL._replace(l2_set_aside=True),
            "one_launch_all_l2": _UNGROUPED._replace(one_launch=True, prefetch_down=True, prefetch_own=True,
                                                     ahead_tokens=8, ahead=frozenset({"o", "qkv_sum"}),
                                                     l2_set_aside=True)}
# (variant, its baseline): their logits compared (the same bits where the variant changes no arithmetic)
PAIRS = (("router", "before"), ("ungrouped", "both"), ("gemv", "both"), ("gemv1_2", "both"),
         ("self_route", "gemv1_2"), ("fused_merge", "gemv1_2"), ("self_route_merge", "gemv1_2"),
         ("down_gemv_8", "gemv1_2"), ("prefetch_down", "gemv1_2"), ("ungrouped1", "gemv1_2"),
         ("ungrouped_prefetch", "ungrouped1"), ("one_launch", "ungrouped1"), ("one_launch_prefetch", "ungrouped1"),
         ("ahead_o", "gemv1_2"), ("ahead_o_route", "gemv1_2"), ("ahead_o_sum", "gemv1_2"), ("ahead_all", "gemv1_2"),
         ("own", "gemv1_2"), ("own_down", "gemv1_2"), ("own_all", "gemv1_2"), ("ungrouped_own", "ungrouped1"),
         ("one_launch_own", "ungrouped1"), ("one_launch_all", "ungrouped1"), ("ahead_kv", "no_kv"),
         ("own_all_kv", "gemv1_2"), ("prefetch_down_l2", "prefetch_down"), ("own_all_l2", "own_all"),
         ("one_launch_all_l2", "one_launch_all"), ("persistent", "gemv1_2"), ("persistent_1", "persistent"),
         ("persistent_2", "persistent"), ("persistent_4", "persistent"), ("router_late", "gemv1_2"),
         ("early_o", "gemv1_2"), ("early_none", "gemv1_2"), ("early_qkv", "gemv1_2"),
         ("early_o_qkv", "gemv1_2"), ("early_small", "gemv1_2"), ("early_small_gemv", "gemv1_2"),
         ("early_all", "gemv1_2"), ("early_o_rope", "early_o"), ("early_o_gemv", "early_o"),
         ("early_o_route", "early_o"), ("early_o_moe", "early_o"), ("route_general", "gemv1_2"),
         ("rows_up", "grouped_up"), ("rows_down", "grouped_up"), ("rows_both", "rows_up"), ("rows_both_4", "rows_both"),
         ("rows_down_4_4", "rows_both"), ("rows_down_16_4", "rows_both"), ("rows_down_16_8", "rows_both"),
         ("rows_down_32_8", "rows_both"), ("grouped_up", "gemv1_2"), ("grouped", "gemv1_2"),
         ("rows_up_w4", "gemv1_2"), ("rows_up_2", "gemv1_2"), ("rows_down_2_4", "gemv1_2"), ("rows_few_1", "gemv1_2"),
         ("rows_few_2", "gemv1_2"), ("rows_few_4", "gemv1_2"), ("rows_few_8", "gemv1_2"), ("rows_few_2_up", "gemv1_2"),
         ("gemv_tok_1", "gemv1_2"), ("gemv_tok_2", "gemv1_2"), ("gemv_tok_4", "gemv1_2"), ("gemv_tok_8", "gemv1_2"),
         *((f"route_few_{n}", "gemv1_2") for n in (0, 2, 4, 8)),
         *((f"route_few_{n}_{w}", f"route_few_{n}") for n in (4, 8) for w in (2, 4)), ("seven_copies", "gemv1_2"),
         ("two_copies", "gemv1_2"))

# the variants whose replay (--profile-batch, 1) is profiled kernel by kernel, where they are timed
PROFILED = ("before", "both", "gemv", "gemv1_2", "self_route_merge", "down_gemv_8", "prefetch_down", "one_launch",
            "one_launch_prefetch", "ahead_o_sum", "ahead_all", "own", "own_all", "one_launch_own", "one_launch_all",
            "own_all_kv", "own_all_l2", "persistent", "early_o", "early_small", "early_all", "route_one",
            "route_general", "rows_both", "grouped", "rows_few_1", "rows_few_2_up", "gemv_tok_1",
            "gemv_tok_2", "gemv_tok_4", "gemv_tok_8", "route_few_0", "route_few_2", "route_few_4", "route_few_8",
            "two_copies")


SHIPPED_RUN, ONE_COPY_ENTRIES = batched._DecodeGraph.run, batched.ONE_COPY_ENTRIES


def _seven_copies_run(self, plan):
    """``batched._DecodeGraph.run`` before 2026-12-06's change (variant ``seven_copies``): the host arrays copied to
    the device, then each of the graph's five step vectors and its table copied in apart."""
    B, S, W = plan.num_seqs, self.size, plan.block_table.shape[1]
    dev = self.staged(plan).to(self.fwd.device, non_blocking=True)
    if self.fwd.cuda:
        self.staging.copied()
    mt = self.meta
    for i, v in enumerate((mt.ids, mt.positions, mt.slots, mt.seq_lens, mt.lora)):
        v.copy_(dev[i * S:(i + 1) * S])
    mt.block_table[:, :W].copy_(dev[5 * S:].view(S, W))
    self._launch()
    return self.logits[:B].clone()


SEVEN_COPIES_RUN = _seven_copies_run


def set_variant(fwd, name: str) -> int:
    """Switch the decode path to variant ``name``; returns the L2 set-aside for evict-last lines now (bytes)."""
    from pushkv.model.kernels import triton_fused, triton_moe, triton_moe_decode, triton_moe_token, triton_paged

    f = VARIANTS[name]
    chain.ON, batched.ROUTER_IN_NORM_TOKENS, os.environ["PUSHKV_MOE_DECODE"] = f.chain, f.router_tokens, f.moe_decode
    batched.GEMV_TOKENS, triton_gemv.COLUMNS = f.gemv_tokens, f.gemv_columns
    triton_moe.SELF_ROUTE_ONE_TOKEN, triton_paged.FUSED_MERGE = f.self_route, f.fused_merge
    triton_moe.DOWN_GEMV_TOKENS, triton_moe.DOWN_GEMV_COLUMNS = f.down_gemv_tokens, f.down_gemv_columns
    triton_moe.PREFETCH_DOWN_TOKENS, triton_moe.PREFETCH_OWN_TOKENS = f.prefetch_down_tokens, f.prefetch_own_tokens
    triton_moe_decode.ONE_LAUNCH, triton_moe_decode.PREFETCH_DOWN = f.one_launch, f.prefetch_down
    triton_moe_decode.PREFETCH_OWN, triton_paged.PREFETCH_KV = f.prefetch_own, f.prefetch_kv
    batched.AHEAD_TOKENS, batched.AHEAD = f.ahead_tokens, f.ahead
    triton_moe.PERSISTENT_ONE_TOKEN, triton_moe_token.PER_SM = f.persistent, f.persistent_per_sm
    triton_moe_token._GRID.clear()  # sized again at this variant's programs an SM
    triton_fused.ROUTER_EARLY = f.router_early
    chain.EARLY_NEXT = f.early_next
    triton_moe.ROUTE_ONE_TOKEN = f.route_one
    triton_moe.ONE_TOKEN_TILES = f.one_token_tiles
    triton_moe.ROWS_ONE_TOKEN, triton_moe.DOWN_ROWS_ONE_TOKEN = f.rows_up, f.rows_down
    triton_moe.ROWS, triton_moe.ROWS_WARPS = f.rows, f.rows_warps
    triton_moe.DOWN_ROWS, triton_moe.DOWN_ROWS_WARPS = f.down_rows, f.down_rows_warps
    triton_moe.ROWS_TOKENS = f.rows_tokens
    triton_moe.ROUTE_FEW_TOKENS, triton_moe.ROUTE_FEW_WARPS = f.route_few, f.route_few_warps
    batched._DecodeGraph.run = SEVEN_COPIES_RUN if f.input_copies == 7 else SHIPPED_RUN
    batched.ONE_COPY_ENTRIES = ONE_COPY_ENTRIES if f.input_copies == 1 else 0
    fwd.drop_graphs()  # captured with the last variant's launches
    if not torch.cuda.is_available():
        return 0
    # CUDA gives evict-last lines their priority within the set-aside, which starts at 0
    try:
        return cuda_driver.persisting_l2(1 << 40 if f.l2_set_aside else 0)[0]
    except cuda_driver.DriverError as e:  # said, and the variant timed without it: the run goes on
        print(f"{name}: the L2 set-aside was refused ({e})", flush=True)
        return -1 if f.l2_set_aside else 0


def profile_step(run, layers: int, reps: int = 20) -> dict:
    """A graph replay's kernels: GPU microseconds a layer by kernel, the step's span and what no kernel covers."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    by: dict[str, float] = {}
    spans = []
    ends = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by[ev.name[:80]] = by.get(ev.name[:80], 0.0) + ev.device_time_total
            spans.append((ev.time_range.start, ev.time_range.end))
            ends.append((ev.time_range.end, ev.name[:80]))
    spans.sort()
    ends.sort()
    # what each kernel adds to the step: its end less the end before it (a chained step's kernels end in order,
    # each after the one it waits for), summed by kernel; the replays' own gaps go to the first kernel of each
    adds: dict[str, float] = {}
    for (e0, _), (e1, name) in zip(ends, ends[1:]):
        adds[name] = adds.get(name, 0.0) + (e1 - e0)
    busy, end = 0.0, None
    for s, e in spans:  # the union of kernel intervals
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    per = reps * layers
    kernels = sorted(((v / per, k) for k, v in by.items()), reverse=True)
    added = sorted(((v / per, k) for k, v in adds.items()), reverse=True)
    return {"kernel_us_a_layer": [{"us": round(u, 2), "kernel": k} for u, k in kernels[:16]],
            "added_us_a_layer": [{"us": round(u, 2), "kernel": k} for u, k in added[:16]],
            "busy_us_a_layer": round(busy / per, 2), "span_us_a_layer": round(span / per, 2)}


# the grouped kernels' decode tiles swept, gate/up and down apart: (output columns, k a step, warps, stages)
# (the first sweep on an H200 found 64 columns best at every count, so the wider ones were added)
TILE_SWEEP = [(bn, bk, w, st) for bn in (16, 32, 64, 128, 256) for bk in (64, 128, 256) for w in (2, 4, 8)
              for st in (3, 4, 5, 6) if bn * bk * st <= 64 * 256 * 4]


def swept_variants(rows: list[dict]) -> dict[str, Flags]:
    """The shipped step with the one-token tiles this card's sweep found best (``swept_1``: gate/up's and down's;
    ``swept_up``, ``swept_down``: one of them, the other as shipped), for ``--then-time``."""
    from pushkv.model.kernels import triton_moe

    shipped = triton_moe.tiles_for(1)
    best = {kern: min((r for r in rows if r["tokens"] == 1 and r["kernel"] == kern), key=lambda r: r["us"])["tile"]
            for kern in ("gate_up", "down")}
    (bn_up, bk, w, st), (bn_down, bk_d, w_d, st_d) = best["gate_up"], best["down"]
    up = shipped._replace(bn_up=bn_up, bk=bk, warps=w, stages=st, bk_down=shipped.bk_down or shipped.bk,
                          down_warps=shipped.down_warps or shipped.warps,
                          down_stages=shipped.down_stages or shipped.stages)
    both = up._replace(bn_down=bn_down, bk_down=bk_d, down_warps=w_d, down_stages=st_d)
    down = shipped._replace(bn_down=bn_down, bk_down=bk_d, down_warps=w_d, down_stages=st_d)
    return {"swept_1": SHIPPED._replace(one_token_tiles=both), "swept_up": SHIPPED._replace(one_token_tiles=up),
            "swept_down": SHIPPED._replace(one_token_tiles=down)}


def graph_us(fn, reps: int) -> float:
    """Microseconds a call of ``fn`` captured in a CUDA graph and replayed (no launch cost from Python)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, reps) * 1e6


def sweep_tiles(model, tokens: list[int], reps: int = 20) -> list[dict]:
    """gate/up and down of the grouped kernels (row block 16, as ``triton_moe.tiles_for`` gives a decode step)
    at each token count, every layer in turn (each call reads its own layer's experts from HBM, as a step does,
    not the last call's from L2), per tile of ``TILE_SWEEP``: microseconds a layer and the bytes rate, and the
    largest difference from the shipped tile's output (on an H200: none; a row's sums run in the same order)."""
    from pushkv.model.kernels import triton_moe
    from pushkv.model.moe import route

    cfg = model.cfg
    k, renorm = cfg.experts_per_token, cfg.norm_topk_prob
    layers = [lw for lw in model.w.layers if lw.router is not None]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in tokens:
        shipped = triton_moe.tiles_for(T)
        inputs = []
        for lw in layers:
            h = torch.randn(T, cfg.hidden_size, device="cuda", dtype=lw.gate_up.dtype, generator=g)
            w, _, slot_ids, block_expert = triton_moe.group_logits(torch.nn.functional.linear(h, lw.router), k,
                                                                   renorm, shipped.bm)
            inputs.append((lw, h, w, slot_ids, block_expert))
        experts = sum(len(set(route(h, lw.router, k, renorm)[1].flatten().tolist()))
                      for lw, h, *_ in inputs) / len(inputs)
        item = layers[0].gate_up.element_size()
        up_bytes = experts * layers[0].gate_up.shape[1] * cfg.hidden_size * item
        down_bytes = experts * layers[0].down.shape[1] * layers[0].down.shape[2] * item

        def up(t, i, inputs=inputs):
            lw, h, _, slot_ids, block_expert = inputs[i]
            return triton_moe.gate_up_product(h, lw.gate_up, slot_ids, block_expert, k, t)

        n_layers = len(inputs)
        acts = [up(shipped, i) for i in range(n_layers)]

        def down(t, i, inputs=inputs, acts=acts, T=T):
            lw, _, w, slot_ids, block_expert = inputs[i]
            return triton_moe.down_per_slot(acts[i], lw.down, w, slot_ids, block_expert, T * k, t)

        # the product's rows of blocks past the last expert's (no expert: never written) are left out
        written = (inputs[0][4] >= 0).repeat_interleave(shipped.bm)

        def up_rows(t, i, written=written):
            return up(t, i)[written]

        want_up, want_down = up_rows(shipped, 0).float(), down(shipped, 0).float()
        for kernel, fn, check, want, nbytes in (("gate_up", up, up_rows, want_up, up_bytes),
                                                ("down", down, down, want_down, down_bytes)):
            for bn, bk, wp, st in TILE_SWEEP:
                t = (triton_moe.Tiles(shipped.bm, bn, 64, bk, wp, st) if kernel == "gate_up" else
                     triton_moe.Tiles(shipped.bm, 64, bn, 64, 4, 3, bk, wp, st))
                try:
                    err = float((check(t, 0).float() - want).abs().max())
                    us = graph_us(lambda fn=fn, t=t, n=n_layers: [fn(t, i) for i in range(n)], reps) / n_layers
                except Exception as e:  # a tile the device cannot run (shared memory): said, not hidden
                    print(f"{kernel} {t} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append({"tokens": T, "kernel": kernel, "tile": [bn, bk, wp, st], "us": round(us, 2),
                             "GBps": round(nbytes / us / 1e3, 1), "max_diff": err,
                             "shipped": (bn, bk, wp, st) == ((shipped.bn_up, shipped.bk, shipped.warps, shipped.stages)
                                                             if kernel == "gate_up" else
                                                             (shipped.bn_down, shipped.bk_down or shipped.bk,
                                                              shipped.down_warps or shipped.warps,
                                                              shipped.down_stages or shipped.stages))})
            mine = [r for r in rows if r["tokens"] == T and r["kernel"] == kernel]
            best = min(mine, key=lambda r: r["us"])
            ship = next((r for r in mine if r["shipped"]), None)
            print(f"tokens {T} {kernel} ({experts:.1f} experts a layer): best {best['tile']} {best['us']} us "
                  f"{best['GBps']} GB/s; shipped {ship and ship['us']} us", flush=True)
    return rows


def save(rep: dict, out: str) -> None:
    with open(os.path.join(out, "moe_decode.json"), "w") as f:
        json.dump(rep, f, indent=1)


def markdown(rep: dict) -> str:
    names = rep.get("variants", list(VARIANTS))
    out = [f"{rep.get('model', 'qwen3-30b-a3b')} on {rep['gpu']}; copy rate {rep['copy_GBps']:.0f} GB/s; "
           f"context {rep['ctx']} keys a sequence", "",
           "| batch | bound ms | " + " | ".join(f"{n} ms (x bound)" for n in names) + " |",
           "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for r in rep["rows"]:
        cells = [f"{r[n]['ms']:.2f} ({r[n]['ms'] / r['bound_ms']:.2f})" for n in names]
        out.append(f"| {r['batch']} | {r['bound_ms']:.2f} | " + " | ".join(cells) + " |")
    pairs = [f"{a}_vs_{b}" for a, b in PAIRS if f"{a}_vs_{b}" in rep["rows"][0]]
    out += ["", "chained: the same bits at " + ", ".join(f"batch {r['batch']}: {r['chained_same_bits']}"
                                                          for r in rep["rows"]),
            "", "| variant against its baseline | " + " | ".join(f"batch {r['batch']}: max abs, argmax agree"
                                                                   for r in rep["rows"]) + " |",
            "| --- |" + " --- |" * len(rep["rows"])]
    for p in pairs:
        out.append(f"| {p.replace('_vs_', ' against ')} | " + " | ".join(
            f"{r[p]['max_abs']:.3g}, {r[p]['argmax_agree']:.0%}" for r in rep["rows"]) + " |")
    if "gemv1_2" in names:  # what decides a flag: each variant against the shipped step, fastest first
        for r in rep["rows"]:
            ship = r["gemv1_2"]["ms"]
            ranked = sorted(names, key=lambda n: r[n]["ms"])
            out += ["", f"Batch {r['batch']}, fastest first (against the shipped gemv1_2, {ship:.3f} ms): " + ", ".join(
                f"{n} {r[n]['ms']:.3f} ({(r[n]['ms'] / ship - 1) * 100:+.1f} %)" for n in ranked)]
    out.append("")
    for name, p in rep["profile"].items():
        out += [f"Batch-{rep.get('profile_batch', 1)} graph replay, {name}: {p['span_us_a_layer']} us a layer, "
                f"kernels busy {p['busy_us_a_layer']} us",
                "", "| us a layer | kernel |", "| --- | --- |"]
        out += [f"| {k['us']} | `{k['kernel']}` |" for k in p["kernel_us_a_layer"]]
        out.append("")
        if p.get("added_us_a_layer"):  # the chain's time by kernel: each one's end less the end before it
            out += ["| us a layer added to the step (its end less the end before it) | kernel |", "| --- | --- |"]
            out += [f"| {k['us']} | `{k['kernel']}` |" for k in p["added_us_a_layer"]]
            out.append("")
    return "\n".join(out)


def plot(rep: dict, path: str) -> None:
    """Each batch's variants as bars of their step time in multiples of its bytes bound, fastest at the top, the
    shipped step (``gemv1_2``) marked and the 1.5x goal drawn: from a saved moe_decode.json, so it runs where the
    results land (matplotlib need not be on the GPU machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rows = rep["variants"], rep["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 0.32 * len(names) + 1.6), squeeze=False)
    for ax, r in zip(axes[0], rows):
        ranked = sorted(names, key=lambda n: r[n]["ms"], reverse=True)
        x = [r[n]["ms"] / r["bound_ms"] for n in ranked]
        ax.barh(range(len(ranked)), x, color=["tab:orange" if n == "gemv1_2" else "tab:blue" for n in ranked])
        ax.set_yticks(range(len(ranked)), ranked, fontsize=8)
        ax.axvline(1.5, color="tab:green", linestyle="--", linewidth=1, label="goal: 1.5x the bound")
        for i, (n, v) in enumerate(zip(ranked, x)):
            ax.text(v, i, f" {r[n]['ms']:.2f} ms", va="center", fontsize=7)
        ax.set_xlim(0, max(x + [1.5]) * 1.25)
        ax.set_xlabel("decode step / its bytes bound")
        ax.set_title(f"batch {r['batch']} (bound {r['bound_ms']:.2f} ms; orange: shipped)", fontsize=9)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{rep.get('model', 'qwen3-30b-a3b')} decode step on {rep['gpu']}, context {rep['ctx']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--batches", default="1,8,16,64")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a preset (a dense one: --chain-only)")
    ap.add_argument("--chain-only", action="store_true", help="only 'before' and 'pdl' (chained launches off and "
                    "on), no profile: what chaining gives a model")
    ap.add_argument("--profile-batch", type=int, default=1, help="the batch whose graph replay is profiled")
    ap.add_argument("--variants", default="", help="comma-separated names of VARIANTS to time (default: all)")
    ap.add_argument("--plot", metavar="JSON", help="only draw DIR/moe_decode.png from a saved moe_decode.json "
                    "(here, after a GPU run)")
    ap.add_argument("--sweep-tokens", default="", help="token counts the grouped decode tiles are swept at "
                    "(alone: no variants, no profile)")
    ap.add_argument("--then-time", action="store_true", help="after a sweep that includes 1 token, time the shipped "
                    "step against it with the sweep's best one-token tiles (variants swept_1, swept_up, swept_down)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.join(args.out, "moe_decode.png"))
        return
    batches = [int(b) for b in args.batches.split(",")]
    dev = torch.device("cuda")
    bw, rate = copy_bandwidth(dev), matmul_rate(dev)
    cfg, model, views, nblocks = load(args.model, max(batches))
    c = model_counts(model)
    fwd = model.batched
    if args.sweep_tokens:
        rows = sweep_tiles(model, [int(t) for t in args.sweep_tokens.split(",")], args.reps)
        with open(os.path.join(args.out, "moe_decode_tiles.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)
        if not args.then_time:
            return
        VARIANTS.update(swept_variants(rows))
        args.variants = args.variants or "gemv1_2,swept_1,swept_up,swept_down"
    fwd.warmup(views)
    variants = (args.variants.split(",") if args.variants else ["before", "pdl"] if args.chain_only
                else list(VARIANTS))
    rep: dict = {"gpu": torch.cuda.get_device_name(), "model": args.model, "copy_GBps": bw / 1e9, "ctx": args.ctx,
                 "variants": variants, "rows": [], "profile": {}}
    for B in batches:
        run = functools.partial(fwd.logits, decode_seqs(cfg, B, args.ctx, 16), views)
        fwd.use_graphs = False  # counted eagerly: a replay runs no Python
        read = sum(chosen_experts(model, run))
        fwd.use_graphs = True
        row: dict = {"batch": B, "bound_ms": decode_bound(c, B, args.ctx, bw, rate, read) * 1e3}
        logits = {}
        for name in variants:
            set_aside = set_variant(fwd, name)
            try:
                row[name] = {"ms": _time(run, args.reps) * 1e3}
                logits[name] = run().float()
            except Exception as e:  # said and recorded: one variant's fault does not lose the others'
                print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row[name] = {"ms": float("nan"), "error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            if set_aside:
                row[name]["l2_set_aside_MiB"] = round(set_aside / 2**20, 1) if set_aside > 0 else "refused"
        # chaining changes no arithmetic: the same bits; the router's own dot orders its sums otherwise than
        # cuBLAS, and the ungrouped kernels theirs, so those are compared as close (random weights' logits are
        # nearly flat, so a greedy token may differ without a fault)
        row["chained_same_bits"] = all(torch.equal(logits[a], logits[b]) for a, b in (
            ("pdl", "before"), ("both", "router"), ("gemv", "gemv_alone")) if a in logits and b in logits)
        for a, b in PAIRS + tuple((v, "gemv1_2") for v in VARIANTS if v.startswith("swept")):
            if a not in logits or b not in logits:
                continue
            row[f"{a}_vs_{b}"] = {"max_abs": float((logits[a] - logits[b]).abs().max()),
                                  "argmax_agree": float((logits[a].argmax(-1) == logits[b].argmax(-1)).float().mean())}
        rep["rows"].append(row)
        print(json.dumps(row), flush=True)
        save(rep, args.out)  # each batch as it is measured: a run cut short keeps what it had
    run = functools.partial(fwd.logits, decode_seqs(cfg, args.profile_batch, args.ctx, 16), views)
    rep["profile_batch"] = args.profile_batch
    for name in [v for v in PROFILED + ("swept_1",) if v in variants] if len(variants) > 2 else ():
        set_variant(fwd, name)
        rep["profile"][name] = profile_step(run, cfg.num_layers)
    set_variant(fwd, "before")
    save(rep, args.out)
    text = markdown(rep)
    with open(os.path.join(args.out, "moe_decode.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
