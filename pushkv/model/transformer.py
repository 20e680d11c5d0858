"""Decoder-only transformer (the families of pushkv.model.arch) with paged attention over an external KV pool.

The pool is ``[num_blocks, num_layers, 2, kv_heads_local, block_size, head_dim]``
(see pushkv.kv.layout), or a list of per-layer ``[num_blocks, planes, kv_heads_local,
block_size, head_dim]`` views (``[..., groups, group heads, ...]`` when the pool
keeps head groups apart; hybrid layouts keep each layer group apart); token
position p of a sequence lives in block ``block_table[p // block_size]`` at slot
``p % block_size``. Keys are stored after RoPE. MLA-style attention is in mla.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from pushkv.config import ModelConfig
from pushkv.kv.layout import blocks_for, layout_for
from pushkv.messages import KVLayoutDesc, SeqWork
from pushkv.model import scoring
from pushkv.model.lora import LoraBank, LoraStep
from pushkv.model.masks import visible
from pushkv.model.moe import moe_mlp
from pushkv.model.norms import rms_norm, rotate_half
from pushkv.model.rope import cos_sin, cos_sin_rows, dynamic_spans, seq_spans
from pushkv.model.sampling import Sampled, sample
from pushkv.model.shard import ShardPlan
from pushkv.model.weights import TORCH_DTYPES, LayerWeights, RankWeights

if TYPE_CHECKING:
    from pushkv.model.batched import BatchedForward

log = logging.getLogger(__name__)

WINDOW_CHUNK = 256  # least query rows per windowed-attention chunk


@dataclass
class _SeqPlan:
    """Index tensors of one sequence for one step, shared by all layers."""

    rows: slice  # its tokens in the packed batch
    start: int
    num_new: int
    block_table: torch.Tensor  # long, on device
    # attention kind ("full" | "window") -> (first key position, [_Chunk, ...])
    attn: dict


@dataclass
class _Chunk:
    """Queries [q0, q1) (indices into the new tokens) against keys [k0, k1) (indices
    into the gathered keys, which start at the kind's first key position)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Optional[torch.Tensor]  # bool [q1 - q0, k1 - k0], True = attend
    causal: bool


class Model:
    """One tensor-parallel rank of the model. Not thread-safe."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, weights: RankWeights,
                 device: str = "cpu", group=None):
        self.cfg = cfg
        self.plan = plan
        self.tp_rank = plan.tp_rank
        self.tp_size = plan.tp_size
        self.device = torch.device(device)
        self.group = group
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.w = weights
        self.window_layers = frozenset(cfg.window_layers) if cfg.sliding_window > 0 else frozenset()
        self.rope_dim = cfg.head_dim  # dims RoPE rotates (MLA: the decoupled part only)
        self._cos = self._sin = torch.empty(0)
        self.attn_scale: Optional[float] = None  # the softmax scale; None: 1/sqrt(the query width)
        self.batched: Optional[BatchedForward] = None  # one packed pass per step, attention in place
        self.lora_bank: Optional[LoraBank] = None  # LoRA adapters by slot (pushkv.model.lora)
        self.lora_step: Optional[LoraStep] = None  # the running step's adapters, while it runs

    def enable_batched(self, max_num_seqs: int = 64, use_graphs=None) -> None:
        """Run steps through pushkv.model.batched (the GPU path; on CPU, for tests)."""
        from pushkv.model.batched import BatchedForward

        self.batched = BatchedForward(self, max_num_seqs, use_graphs)

    # ------------------------------------------------------------------ public
    def kv_layout(self, num_blocks: int, block_size: int) -> KVLayoutDesc:
        lay = layout_for(self.cfg, self.tp_size, self.tp_rank, num_blocks, block_size)
        if (lay.head_start, lay.kv_heads) != (self.plan.kv_start, self.plan.kv_heads):
            raise ValueError(f"shard plan heads {self.plan} disagree with KV layout {lay}")
        return lay

    @torch.inference_mode()
    def execute(self, seqs: Sequence[SeqWork], pool: torch.Tensor) -> list[int]:
        """Run the new tokens of every seq, write their K/V into pool, and return the
        next token of each seq with sample=True, in order (as each seq's sampling says)."""
        return self.execute_sampled(seqs, pool).tokens

    @torch.inference_mode()
    def execute_sampled(self, seqs: Sequence[SeqWork], pool: torch.Tensor, on_layer=None) -> Sampled:
        """``execute``, with the log-probabilities the seqs asked for (the prompt's too, for a
        chunk with ``score_prompt``: ``Sampled.prompt``). ``on_layer(layer)`` runs once each layer
        has stored the step's new K/V (queued on the device's stream)."""
        # every rank computes the same full-vocabulary logits; rank 0's answer is the one read
        plan = scoring.plan(seqs) if self.tp_rank == 0 else scoring.ScorePlan()
        logits, hidden = self.forward_step(seqs, pool, on_layer, score=bool(plan.rows))
        out = sample(logits, [s for s in seqs if s.sample])
        if plan.seqs:
            out.prompt = scoring.score(hidden, self.lm_logits, plan)
        return out

    @torch.inference_mode()
    def logits(self, seqs: Sequence[SeqWork], pool: torch.Tensor, on_layer=None) -> torch.Tensor:
        """float32 [num sampled seqs, vocab] logits of each sampled seq's last position."""
        return self.forward_step(seqs, pool, on_layer)[0]

    @torch.inference_mode()
    def forward_step(self, seqs: Sequence[SeqWork], pool: torch.Tensor, on_layer=None,
                     score: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``logits``, and with ``score`` the final-normed hidden rows the seqs' prompt chunks
        score (``scoring.rows``, in order; None without)."""
        pools = self._layer_pools(pool)
        if not seqs:
            return torch.empty(0, self.cfg.vocab_size), None
        for s in seqs:
            self._check_seq(s, pools[0].shape[-2])
        forward = self.batched.step if self.batched is not None else self._forward

        def run(part: list[SeqWork], *args):
            self.lora_step = LoraStep.of(self.lora_bank, part, self.device)
            try:
                return forward(part, *args)
            finally:
                self.lora_step = None

        if not self.cfg.deterministic:
            return run(list(seqs), pools, on_layer, score)
        # Each seq alone: its matmul shapes, hence its bytes, never depend on the batch. A layer
        # holds the whole step's K/V once the last seq's pass has stored it.
        last = len(seqs) - 1
        outs = [run([s], pools, on_layer if i == last else None, score) for i, s in enumerate(seqs)]
        parts = [lg for lg, _ in outs if lg.shape[0]]
        kept = [h for _, h in outs if h is not None and h.shape[0]]
        return (torch.cat(parts) if parts else torch.empty(0, self.cfg.vocab_size),
                torch.cat(kept) if kept else None)

    # -------------------------------------------------------- building blocks
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), head_dim] in the model dtype (HF rotate-half convention)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            if need > self.cfg.max_position:
                raise ValueError(f"position {need - 1} beyond max_position={self.cfg.max_position}")
            n = min(max(need, 2 * self._cos.shape[0], 1024), self.cfg.max_position)
            self._cos, self._sin = cos_sin(self.cfg.rope_theta, self.rope_dim, self.cfg.rope_scaling, n,
                                           self.device, self.dtype)
        return self._cos[positions], self._sin[positions]

    def step_rope(self, seqs: Sequence[SeqWork], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope dim] of a step's packed tokens: the table's rows, but for the rows that
        dynamic RoPE rotates for their sequence's length (a long prompt's)."""
        cos, sin = self.rope(positions)
        spans = dynamic_spans(self.cfg.rope_scaling, seq_spans(seqs))
        if spans:
            cos, sin = cos.clone(), sin.clone()
            for row, start, n, length in spans:
                cos[row:row + n], sin[row:row + n] = cos_sin_rows(
                    self.cfg.rope_theta, self.rope_dim, self.cfg.rope_scaling, start, start + n, length,
                    self.device, self.dtype)
        return cos, sin

    def qkv(self, lw: LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Pre-norm + projections + q/k norm + RoPE (the step's cos, sin rows). x [N, d] ->
        q [N, q_heads, hd], k and v [N, kv_heads, hd]."""
        p, hd, eps = self.plan, self.cfg.head_dim, self.cfg.rms_eps
        h = rms_norm(x, lw.input_norm, eps)
        qkv = self.adapted(lw, "qkv", F.linear(h, lw.qkv, lw.qkv_bias), h)
        q, k, v = qkv.split([p.q_heads * hd, p.kv_heads * hd, p.kv_heads * hd], dim=-1)
        q = q.view(-1, p.q_heads, hd)
        k = k.view(-1, p.kv_heads, hd)
        v = v.view(-1, p.kv_heads, hd)
        if lw.q_norm is not None:
            assert lw.k_norm is not None  # (the two come together)
            q = rms_norm(q, lw.q_norm, eps)
            k = rms_norm(k, lw.k_norm, eps)
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attn_out(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after o_proj; attn [N, q_heads * hd]."""
        return x + self._all_reduce(self.adapted(lw, "o", F.linear(attn, lw.o), attn))

    def adapted(self, lw: LayerWeights, kind: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y``, the projection ``kind`` of ``x``, with the running step's LoRA deltas added (pushkv.model.lora)."""
        return y if self.lora_step is None else self.lora_step.add(lw.index, kind, y, x)

    def mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """Residual after the SwiGLU MLP."""
        return x + self.mlp_delta(lw, rms_norm(x, lw.post_norm, self.cfg.rms_eps))

    def mlp_delta(self, lw: LayerWeights, h: torch.Tensor, summed: bool = True,
                  logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What the MLP (dense SwiGLU, or the routed experts) adds to the residual; h normed.
        ``summed`` False: an MoE layer on the GPU at TP 1 may give its tokens' k experts unsummed,
        [T, k, d], for ``triton_fused.add_rms`` to sum in the residual add (one launch less).
        ``logits``: an MoE layer's router logits of h on the GPU, made with the norm
        (``triton_fused.add_rms_router``)."""
        if lw.router is not None:
            shared = getattr(lw, "shared_gate_up", None) is not None
            if h.is_cuda:  # the Triton kernels, no host sync (kernels/triton_moe.py)
                from pushkv.model.kernels import triton_moe

                out = triton_moe.moe_mlp(h, lw.router, lw.gate_up, lw.down, self.cfg.experts_per_token,
                                         self.cfg.norm_topk_prob, summed=summed or self.tp_size > 1 or shared,
                                         logits=logits)
            else:
                out = moe_mlp(h, lw.router, lw.gate_up, lw.down, self.cfg.experts_per_token,
                              self.cfg.norm_topk_prob)
            return self._all_reduce(out + self.shared_expert(lw, h) if shared else out)
        gate, up = self.adapted(lw, "gate_up", F.linear(h, lw.gate_up), h).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return self._all_reduce(self.adapted(lw, "down", F.linear(act, lw.down), act))

    @staticmethod
    def shared_expert(lw, h: torch.Tensor) -> torch.Tensor:
        """An MoE layer's shared expert: a SwiGLU every token goes through (this rank's columns: a partial sum
        under TP), scaled by the sigmoid of its gate where it has one (Qwen2-MoE; the same factor on every rank)."""
        gate, up = F.linear(h, lw.shared_gate_up).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, lw.shared_down)
        if lw.shared_gate is not None:
            out = torch.sigmoid(F.linear(h, lw.shared_gate)) * out
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head, float32 logits."""
        return self.lm_logits(rms_norm(x, self.w.final_norm, self.cfg.rms_eps))

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden rows (the sampler's, and the prompt's scores)."""
        return F.linear(h, self.w.lm_head).float()

    def layer_window(self, layer: int) -> int:
        return self.cfg.sliding_window if layer in self.window_layers else 0

    # ---------------------------------------------------------------- internals
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def _layer_pools(self, pool) -> list[torch.Tensor]:
        """Per-layer [blocks, planes, kv_heads, block, dim] (or [blocks, planes, groups,
        group heads, block, dim]) views of a 6-d pool or a list of them."""
        c = self.cfg
        if isinstance(pool, torch.Tensor):
            if pool.dim() != 6 or pool.shape[1] != c.num_layers:
                raise ValueError(f"pool shape {tuple(pool.shape)} does not match layout "
                                 f"[blocks, {c.num_layers}, {c.kv_planes}, {self.plan.kv_heads}, block, "
                                 f"{c.cache_head_dim}]")
            pool = [pool[:, l] for l in range(c.num_layers)]
        want = (c.kv_planes, self.plan.kv_heads)
        if len(pool) != c.num_layers:
            raise ValueError(f"{len(pool)} layer pools for {c.num_layers} layers")
        for t in pool:
            heads = t.shape[2] * t.shape[3] if t.dim() == 6 else t.shape[2] if t.dim() == 5 else -1
            if heads < 0 or (t.shape[1], heads) != want or t.shape[-1] != c.cache_head_dim \
                    or t.shape[-2] != pool[0].shape[-2]:
                raise ValueError(f"pool shape {tuple(t.shape)} does not match layout "
                                 f"[blocks, {c.kv_planes}, {self.plan.kv_heads}, block, {c.cache_head_dim}]")
            if t.dtype != self.dtype:
                raise ValueError(f"pool dtype {t.dtype} != model dtype {self.dtype}")
        return pool

    def _check_seq(self, s: SeqWork, block_size: int) -> None:
        if not s.token_ids:
            raise ValueError(f"seq {s.seq_id}: no tokens to run")
        end = s.start_pos + len(s.token_ids)
        if s.start_pos < 0 or end > self.cfg.max_position:
            raise ValueError(f"seq {s.seq_id}: positions {s.start_pos}..{end - 1} out of range")
        if len(s.block_table) < blocks_for(end, block_size):
            raise ValueError(f"seq {s.seq_id}: {len(s.block_table)} blocks cannot hold {end} tokens")
        if min(s.token_ids) < 0 or max(s.token_ids) >= self.cfg.vocab_size:
            raise ValueError(f"seq {s.seq_id}: token id outside vocab of {self.cfg.vocab_size}")

    def _plan_seq(self, s: SeqWork, rows: slice, block_size: int) -> _SeqPlan:
        start, n = s.start_pos, len(s.token_ids)
        kinds = {"full": 0}
        if self.window_layers:
            kinds["window"] = self.cfg.sliding_window
        attn = {kind: self._plan_attention(start, n, window) for kind, window in kinds.items()}
        bt = torch.tensor(s.block_table[:blocks_for(start + n, block_size)], device=self.device)
        return _SeqPlan(rows, start, n, bt, attn)

    def _plan_attention(self, start: int, n: int, window: int) -> tuple[int, list[_Chunk]]:
        lo = max(0, start - window + 1) if window else 0
        if n == 1:  # one query sees every key gathered for it
            return lo, [_Chunk(0, 1, 0, start + 1 - lo, None, False)]
        if lo == start and (not window or n <= window):  # square causal: SDPA's fast path
            return lo, [_Chunk(0, n, 0, n, None, True)]
        # Windowed prefill runs in query chunks so the masks stay O(n * window), not O(n^2).
        step = max(window, WINDOW_CHUNK) if window else n
        chunks = []
        for q0 in range(0, n, step):
            q1 = min(n, q0 + step)
            k0 = max(lo, start + q0 - window + 1) if window else lo
            qpos = torch.arange(start + q0, start + q1, device=self.device)[:, None]
            kpos = torch.arange(k0, start + q1, device=self.device)[None, :]
            chunks.append(_Chunk(q0, q1, k0 - lo, start + q1 - lo, visible(qpos, kpos, window), False))
        return lo, chunks

    def _forward(self, seqs: list[SeqWork], pool: list[torch.Tensor], on_layer=None,
                 score: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        bs = pool[0].shape[-2]
        ids: list[int] = []
        pos: list[int] = []
        plans, last_rows = [], []
        for s in seqs:
            r0 = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            plans.append(self._plan_seq(s, slice(r0, len(ids)), bs))
            if s.sample:
                last_rows.append(len(ids) - 1)
        dev = self.device
        positions = torch.tensor(pos, device=dev)
        w_block = torch.cat([p.block_table[torch.arange(p.start, p.start + p.num_new, device=dev) // bs]
                             for p in plans])
        w_slot = positions % bs

        x = F.embedding(torch.tensor(ids, device=dev), self.w.embed)
        rope = self.step_rope(seqs, positions)
        for layer, lw in enumerate(self.w.layers):
            kind = "window" if layer in self.window_layers else "full"
            outs = self._attention(lw, x, rope, pool[layer], plans, kind, w_block, w_slot, bs)
            if on_layer is not None:
                on_layer(layer)
            x = self.attn_out(lw, x, outs[0] if len(outs) == 1 else torch.cat(outs))
            x = self.mlp(lw, x)
        kept = scoring.rows(seqs) if score else []
        hidden = rms_norm(x[torch.tensor(kept, device=dev)], self.w.final_norm, self.cfg.rms_eps) if kept else None
        if not last_rows:
            return torch.empty(0, self.cfg.vocab_size), hidden
        return self.head(x[torch.tensor(last_rows, device=dev)]), hidden

    def _attention(self, lw, x, rope, kv_pool, plans, kind, w_block, w_slot, bs) -> list[torch.Tensor]:
        """One layer's attention, per seq [num_new, q_heads * hd]; stores the new K/V.
        kv_pool: this layer's [blocks, 2, kv_heads, block, hd] view; rope: the step's cos, sin rows."""
        q, k, v = self.qkv(lw, x, rope)
        self._store(kv_pool, w_block, 0, w_slot, k)
        self._store(kv_pool, w_block, 1, w_slot, v)
        return [self._attend(kv_pool, p, q[p.rows], k[p.rows], v[p.rows], p.attn[kind], bs) for p in plans]

    @staticmethod
    def _store(kv_pool, block: torch.Tensor, plane: int, slot: torch.Tensor, x: torch.Tensor) -> None:
        """x [N, kv_heads, dim] into (block, plane, every head, slot) of a 5-d or 6-d layer view."""
        if kv_pool.dim() == 6:  # head groups are separate regions
            kv_pool[block, plane, :, :, slot] = x.view(x.shape[0], kv_pool.shape[2], kv_pool.shape[3], -1)
        else:
            kv_pool[block, plane, :, slot] = x

    @staticmethod
    def _past(kv_pool, p: _SeqPlan, lo: int, bs: int) -> Optional[torch.Tensor]:
        """p's cached rows at positions [lo, p.start) as [planes, kv_heads, n, dim], or None."""
        if lo >= p.start:
            return None
        b0, b1 = lo // bs, (p.start - 1) // bs + 1
        past = kv_pool[p.block_table[b0:b1]]  # [nb, planes, kvh, bs, dim] (a copy)
        if past.dim() == 6:
            past = past.flatten(2, 3)
        nb, planes, kvh, _, dim = past.shape
        past = past.permute(1, 2, 0, 3, 4).reshape(planes, kvh, nb * bs, dim)
        return past[:, :, lo - b0 * bs:p.start - b0 * bs]

    def _attend(self, kv_pool, p: _SeqPlan, q, k, v, attn, bs: int) -> torch.Tensor:
        """Causal attention of p's new queries over its past (from the pool) and new keys."""
        lo, chunks = attn
        past = self._past(kv_pool, p, lo, bs)
        if past is not None:
            keys = torch.cat((past[0], k.transpose(0, 1)), dim=1)
            vals = torch.cat((past[1], v.transpose(0, 1)), dim=1)
        else:
            keys, vals = k.transpose(0, 1), v.transpose(0, 1)
        return self._sdpa(q, keys, vals, chunks, p.num_new)

    def _sdpa(self, q, keys, vals, chunks, num_new: int) -> torch.Tensor:
        """q [N, H, E], keys [Hk, S, E], vals [Hk, S, Ev] -> [N, H * Ev] over the chunks."""
        q = q.transpose(0, 1)[None]
        keys, vals = keys[None], vals[None]
        outs = [F.scaled_dot_product_attention(
            q[:, :, c.q0:c.q1], keys[:, :, c.k0:c.k1], vals[:, :, c.k0:c.k1], attn_mask=c.mask,
            is_causal=c.causal, enable_gqa=q.shape[1] != keys.shape[1], scale=self.attn_scale) for c in chunks]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out[0].transpose(0, 1).reshape(num_new, -1)
