"""The batched forward: one pass over every sequence of a step, attention in place.

All sequences' new tokens (prefills and decodes together) run as one packed batch
through every matmul; each layer stores its new K/V into the pool and attends through
the block tables (``kernels.paged``: Triton on CUDA), so past KV is never copied. The
only host synchronisation of a step is the caller's read of the sampled tokens.

Pure decode steps (one token per sequence, all sampled) on CUDA replay a CUDA graph
captured per batch-size bucket: the launch cost of ~20 kernels per layer otherwise
rivals a decode step of a small batch. Graphs are off under tensor parallelism (the
all-reduce would be captured) and when ``PUSHKV_CUDA_GRAPHS=0``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from pushkv import envs
from pushkv.messages import SeqWork
from pushkv.model import scoring
from pushkv.model.kernels import paged
from pushkv.model.lora import LoraStep
from pushkv.model.masks import causal_mask
from pushkv.model.norms import rms_norm, rotate_half
from pushkv.model.rope import cos_sin, cos_sin_rows, dynamic_spans, seq_spans
from pushkv.model.step import Staging, StepPlan, StepTensors, plan_step

log = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# MLA's decode steps in CUDA graphs too: its latent rows stored by a kernel that reads the slots on the device, the
# decode rows' attention with no host read (``_mla_decode_rows``). On: DeepSeek's float32 tokens equal
# transformers' replayed from graphs on an H100 (experiments/gpu_run.sh mlagraphs;
# docs/results/2026-12-05-mla-kernel-gpu)
MLA_GRAPHS = True
# MLA's decode attention on CUDA as one Triton kernel that reads the latent rows in place (kernels/triton_mla.py),
# its keys split over MLA_SPLITS programs a row, instead of the torch ops that gather every row's latent rows padded to
# the table's width. On: on an H100, 2.1x-12x the torch ops' speed at batches 1-32 and contexts 512-16k with 8
# splits, and DeepSeek's float32 tokens equal transformers' with it and the graphs (experiments/gpu_run.sh mlatriton;
# docs/results/2026-12-05-mla-kernel-gpu)
MLA_TRITON = True
MLA_SPLITS = 8

# An MoE layer's router logits made in the post-attention norm's launch (``add_rms_router``) for steps of up
# to this many tokens (a graph bucket bound, so a step routes alike replayed or eager), where each token's
# program re-reads the router's rows. 16: on an H200, Qwen3-30B-A3B's decode step at 1, 8 and 16 sequences
# took 3.58, 8.75 and 12.87 ms against 3.79, 8.97 and 13.05 with the router's own launch, and 128 gave no more
# at 64 (experiments/moe_decode_probe.py, docs/results/2026-12-04-moe-decode)
ROUTER_IN_NORM_TOKENS = 16

# The qkv and o projections of steps of up to this many tokens as GEMVs that load their weights before they wait
# for the kernel before them (``kernels/triton_gemv.py``; cuBLAS else). A graph bucket bound. On an H200, at 2
# columns a program, they took Qwen3-30B-A3B's chained decode step of one sequence from 3.12 ms to 2.91, but that
# of eight from 8.08 to 9.09 (experiments/moe_decode_probe.py, docs/results/2026-12-04-moe-decode). On an H100 at
# two tokens they took it from 4.90 to 4.72 ms (1.54x -> 1.48x its bytes bound), gave nothing at four (7.27 against
# 7.21) and lost 7 % at eight (variants ``gemv_tok_N``, docs/results/2026-12-06-moe-gemv-h100): so up to two
GEMV_TOKENS = 2

# Steps of up to AHEAD_TOKENS tokens ask L2 for a layer's dense weights ahead of their projection, in a launch of
# their own (``kernels/prefetch.ahead``), at the places named: "o": the o projection's while the attention runs;
# "qkv_route": the next layer's qkv while an MoE layer routes (the last layer asks for none); "qkv_sum": the next
# layer's qkv while the residual add sums the experts. The same bits. Off (0) until experiments/moe_decode_probe.py
# (variants ``ahead_*``) has timed it on a GPU
AHEAD_TOKENS = 0
AHEAD_PLACES = frozenset({"o", "qkv_route", "qkv_sum"})  # every place there is; AHEAD names some
AHEAD: frozenset = frozenset({"o"})

# A step whose sequences are all whole prompts (every key new: ``StepTensors.whole``) of at least this many tokens
# each runs its attention through torch's fused attention (``paged.fresh_attention``: cuDNN's first, where torch
# has it) on the new keys as the RoPE launch leaves them, rather than the paged kernel reading them back from the
# pool; bf16 and fp16 only, and a layer whose sliding window is shorter than a prompt keeps the paged kernel. The
# K/V still go to the pool (the push streams them from there). On an H100 (docs/results/2026-12-07-fresh-attention-h100,
# padded/): Qwen3-30B-A3B's whole prefill in one process, off / on, 16k 440 -> 371 ms (-16 %), 4k 73.3 -> 70.1 (-4 %),
# 2k 39.7-41.6 -> 37.5-38.8; in `pushkv roofline` 4k 73.0 -> 68.4-69.0 ms (50 -> 53 % of the matmul rate), 3k 56.9
# -> 54.0. At 1k the paged kernel was faster (the first, unpadded form: 13-22 % slower), hence the bound. The worker
# builds cuDNN's plan for each padded length at start-up (``warm_fresh``: 2.4-2.8 s up to 8,192 tokens with lengths
# padded to multiples of 128; 3.9 s up to 65,536 as ``paged.fresh_padded`` pads them now). 0: never
SDPA_PROMPT_TOKENS = 2048


def ahead_places(tokens: int, tp_size: int) -> frozenset:
    """Where a step of ``tokens`` asks L2 for dense weights ahead (``AHEAD``; none past ``AHEAD_TOKENS``, and none
    under TP: its all-reduce between launches breaks the chain the ahead launch runs beside). A place not among
    ``AHEAD_PLACES`` is refused: misspelt, it would ask for nothing without a word."""
    if AHEAD - AHEAD_PLACES:
        raise ValueError(f"batched.AHEAD names {sorted(AHEAD - AHEAD_PLACES)}: not among {sorted(AHEAD_PLACES)}")
    return AHEAD if 0 < tokens <= AHEAD_TOKENS and tp_size == 1 else frozenset()


class BatchedForward:
    """Runs one Model's weights over a packed step (see module doc)."""

    def __init__(self, model, max_num_seqs: int = 64, use_graphs: Optional[bool] = None):
        self.m = model
        cfg, plan = model.cfg, model.plan
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.hd = cfg.head_dim
        self.group = plan.q_heads // plan.kv_heads
        # query rows per prefill tile (block_q tokens x the group's query heads); 256 where 8 or more query
        # heads share a KV head: 0.39 against 0.51 ms for a 4k prefill's attention of Qwen3-30B-A3B's 32 on 4
        # on an H200 (experiments/moe_prefill_probe.py)
        rows = 64 if model.dtype == torch.float32 else (256 if self.group >= 8 else 128)
        self.block_q = max(1, rows // self.group)
        self.rope_dim = model.rope_dim  # the head's width, or MLA's decoupled RoPE dims
        self.cos, self.sin = cos_sin(cfg.rope_theta, self.rope_dim, cfg.rope_scaling, cfg.max_position,
                                     self.device, model.dtype)
        self.staging = Staging()
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 1
        if use_graphs is None:  # MoE too: its CUDA kernels never wait for the host (kernels/triton_moe.py)
            use_graphs = (self.cuda and model.tp_size == 1 and cfg.cuda_graphs and envs.PUSHKV_CUDA_GRAPHS
                          and (MLA_GRAPHS or not cfg.is_mla))
        self.use_graphs = use_graphs
        self.fused = self.cuda and envs.PUSHKV_FUSED and not (self.hd & (self.hd - 1)) and not cfg.is_mla
        if self.cuda and any(lw.router is not None for lw in model.w.layers):
            from pushkv.model.kernels import triton_moe_decode, triton_moe_token

            triton_moe_decode.counters(self.device)  # made here, never inside a graph capture
            triton_moe_token.counters(self.device)
        self.max_num_seqs = max_num_seqs
        self.buckets = sorted({b for b in GRAPH_BUCKETS if b < max_num_seqs} | {max_num_seqs})
        self.graphs: dict[int, "_DecodeGraph"] = {}
        # decode steps with a LoRA adapter in them: graphs of their own (the rows' slots an input), captured on first
        # use, so a step of the base model alone never pays the adapters' matmuls
        self.lora_graphs: dict[int, "_DecodeGraph"] = {}
        self.graph_type: type[_DecodeGraph] = _DecodeGraph  # tests stand in a CPU replay
        self.graph_pool: Optional[Any] = None  # torch.cuda.graph_pool_handle(), shared by the graphs
        self.graph_width = 0
        self.graph_pools: tuple = ()  # pools_key of the pools the graphs were captured on

    # ------------------------------------------------------------------ public
    def logits(self, seqs: Sequence[SeqWork], pools: list[torch.Tensor], on_layer=None) -> torch.Tensor:
        return self.step(seqs, pools, on_layer)[0]

    def step(self, seqs: Sequence[SeqWork], pools: list[torch.Tensor], on_layer=None,
             score: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The sampled seqs' logits, and with ``score`` the final-normed hidden rows their prompt
        chunks score (``scoring.rows``; None without)."""
        u = pools[0].shape[-2]
        plan = plan_step(seqs, u, self.block_q)
        spans = dynamic_spans(self.m.cfg.rope_scaling, seq_spans(seqs))
        kept = scoring.rows(seqs) if score else []
        # a decode step's rows are all the table's (dynamic RoPE too), so graphs replay it
        if self.use_graphs and plan.is_decode and plan.num_seqs <= self.max_num_seqs and on_layer is None \
                and not spans and not kept:
            return self._replay(plan, pools), None
        meta = StepTensors.upload(plan, self.device, self.staging)
        if self.m.lora_step is not None:  # the rows' slots came with the step's one upload
            self.m.lora_step.take(meta.lora)
        rope = self._rope_rows(meta, spans) if spans else None
        splits = self.decode_splits(plan.num_seqs)
        if not kept:
            return self.forward(meta, pools, splits, on_layer=on_layer, rope=rope), None
        h = self.hidden(meta, pools, splits, on_layer=on_layer, rope=rope)
        return self.head(meta, h), h.index_select(0, torch.tensor(kept, device=self.device))

    def _rope_rows(self, meta: StepTensors, spans) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, index) of a step with rows that dynamic RoPE rotates for their prompt's
        length: the step's own rows (the table's, those spans recomputed), indexed 0..T-1."""
        cfg = self.m.cfg
        cos = self.cos.index_select(0, meta.positions)
        sin = self.sin.index_select(0, meta.positions)
        for row, start, n, length in spans:
            cos[row:row + n], sin[row:row + n] = cos_sin_rows(cfg.rope_theta, self.rope_dim, cfg.rope_scaling, start,
                                                              start + n, length, self.device, self.m.dtype)
        rows = torch.arange(cos.shape[0], device=self.device, dtype=meta.positions.dtype)
        return cos, sin, rows

    def bucket(self, num_seqs: int) -> int:
        """The size of the graph a decode step of num_seqs replays (past max_num_seqs: num_seqs)."""
        return next((b for b in self.buckets if b >= num_seqs), num_seqs)

    def decode_splits(self, num_seqs: int) -> int:
        """Key-range splits per decode tile: enough programs to fill the GPU twice. Counted at the
        step's graph bucket, so a decode step sums each row's keys in the same order (and float32
        gives the same tokens) whether it replays a graph or runs eagerly (graphs off, a layer hook)."""
        if not self.cuda:
            return 1
        progs = max(1, self.bucket(num_seqs) * self.m.plan.kv_heads)
        return max(1, min(16, -(-2 * self.sms // progs)))

    def forward(self, meta: StepTensors, pools: list[torch.Tensor], splits: int,
                scratch=None, out_logits: Optional[torch.Tensor] = None, on_layer=None,
                rope: Optional[tuple] = None) -> torch.Tensor:
        """rope: (cos, sin, index) where the step's rows are not the table's at their positions."""
        return self.head(meta, self.hidden(meta, pools, splits, scratch, on_layer, rope), out_logits)

    def hidden(self, meta: StepTensors, pools: list[torch.Tensor], splits: int, scratch=None, on_layer=None,
               rope: Optional[tuple] = None) -> torch.Tensor:
        """Every layer over the step: the final-normed hidden rows, one per token."""
        run = self._layers_mla if self.m.cfg.is_mla else self._layers_fused if self.fused else self._layers_torch
        if scratch is None and splits > 1 and meta.decode_tiles.shape[0]:
            p = self.m.plan  # one scratch for every layer: its merge counters are zeroed once a step, not a layer
            scratch = paged.decode_scratch(splits, meta.ids.shape[0], p.q_heads, p.kv_heads, self.hd, self.device)
        return run(meta, pools, splits, scratch, on_layer, rope or (self.cos, self.sin, meta.positions))

    def head(self, meta: StepTensors, h: torch.Tensor, out_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 logits of the sampled rows of ``h``."""
        T = meta.ids.shape[0]
        rows = h.index_select(0, meta.sample_rows.long()) if meta.sample_rows.shape[0] != T else h
        logits = F.linear(rows, self.m.w.lm_head).float()
        if out_logits is not None:
            out_logits.copy_(logits)
            return out_logits
        return logits

    def _layers_torch(self, meta, pools, splits, scratch, on_layer, rope) -> torch.Tensor:
        """Every layer with torch ops (the CPU path); returns the final-normed hidden rows."""
        m, cfg, p = self.m, self.m.cfg, self.m.plan
        hd, eps = self.hd, cfg.rms_eps
        T = meta.ids.shape[0]
        x = F.embedding(meta.ids, m.w.embed)
        cos = rope[0].index_select(0, rope[2])[:, None, :]
        sin = rope[1].index_select(0, rope[2])[:, None, :]
        attn = torch.empty(T, p.q_heads, hd, device=self.device, dtype=m.dtype)
        for layer, lw in enumerate(m.w.layers):
            h = rms_norm(x, lw.input_norm, eps)
            qkv = m.adapted(lw, "qkv", F.linear(h, lw.qkv, lw.qkv_bias), h)
            q, k, v = qkv.split([p.q_heads * hd, p.kv_heads * hd, p.kv_heads * hd], dim=-1)
            q = q.view(T, p.q_heads, hd)
            k = k.view(T, p.kv_heads, hd)
            v = v.view(T, p.kv_heads, hd)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, eps)
                k = rms_norm(k, lw.k_norm, eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            paged.store_kv(pools[layer], k, v, meta.slots)
            if on_layer is not None:
                on_layer(layer)
            paged.attention(q, pools[layer], meta, m.layer_window(layer), attn, splits, scratch)
            x = m.attn_out(lw, x, attn.view(T, -1))
            x = m.mlp(lw, x)
        return rms_norm(x, m.w.final_norm, eps)

    def _layers_mla(self, meta, pools, splits, scratch, on_layer, rope) -> torch.Tensor:
        """Every layer of an MLA model (pushkv.model.mla) with torch ops, on the CPU and CUDA alike: the step's
        projections and MLP batched, each sequence's attention over its latent rows gathered from the pool."""
        m, eps = self.m, self.m.cfg.rms_eps
        T = meta.ids.shape[0]
        x = F.embedding(meta.ids, m.w.embed)
        cos, sin = rope[0].index_select(0, rope[2]), rope[1].index_select(0, rope[2])
        u = pools[0].shape[-2]
        for layer, lw in enumerate(m.w.layers):
            q, lat = m.latent(lw, x, (cos, sin))
            paged.store_latent(pools[layer], lat, meta.slots)
            if on_layer is not None:
                on_layer(layer)
            attn = torch.zeros(T, m.plan.q_heads * m.cfg.head_dim, device=self.device, dtype=m.dtype)
            decode = meta.decode_tiles.shape[0] > 0 and not m.layer_window(layer)
            if decode:  # the step's decode rows together, each over its latent rows as they are
                self._mla_decode_rows(lw, q, pools[layer], meta, attn)
            # the other rows a sequence at a time, reading its lengths on the host: a decode step (a graph's) has none
            for i in range(meta.seq_lens.shape[0] if meta.prefill_tiles.shape[0] or not decode else 0):
                ctx, n, r0 = int(meta.seq_lens[i]), int(meta.q_lens[i]), int(meta.q_starts[i])
                if n == 0 or ctx == 0 or (n == 1 and decode):
                    continue
                blocks = meta.block_table[i, :-(-ctx // u)].long()
                rows = pools[layer][blocks, 0, 0].reshape(-1, lat.shape[-1])[:ctx]
                keys, vals = m._expand(lw, rows)
                mask = causal_mask(ctx, n, m.layer_window(layer), self.device)
                o = F.scaled_dot_product_attention(q[r0:r0 + n].transpose(0, 1)[None], keys[None], vals[None],
                                                   attn_mask=mask, scale=m.attn_scale)
                attn[r0:r0 + n] = o[0].transpose(0, 1).reshape(n, -1)
            x = m.attn_out(lw, x, attn)
            x = m.mlp(lw, x)
        return rms_norm(x, m.w.final_norm, eps)

    def _mla_decode_rows(self, lw, q: torch.Tensor, pool: torch.Tensor, meta, attn: torch.Tensor) -> None:
        """Every decode row of the step at once (``meta.decode_tiles``: the sequences of one token), as
        ``mla.absorbed_attention`` computes one: the query taken into the latent's space, attention over each
        sequence's latent rows as they are (``paged.mla_decode_ref``, or on CUDA with ``MLA_TRITON`` the
        ``triton_mla`` kernel, which reads them in place), the weighted latent taken through the value
        up-projection; no loop and no wait for the host, and S x r x heads x 2 x hd multiplies fewer a row than
        expanding the latent. Writes ``attn``'s rows."""
        cfg, qh = self.m.cfg, self.m.plan.q_heads
        hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
        rows_at = meta.q_starts.long()[meta.decode_tiles.long()]
        q_nope, q_rope = q[rows_at].split([hd, rd], -1)
        q_abs = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, lw.k_up.view(qh, hd, r)), q_rope), -1)
        scale = self.m.attn_scale or (hd + rd) ** -0.5
        if self.cuda and MLA_TRITON and paged.mla_kernel_fits(r, rd):
            from pushkv.model.kernels import triton_mla

            o_lat = triton_mla.mla_decode(q_abs, pool, meta.block_table, meta.seq_lens, meta.decode_tiles, r, scale,
                                          MLA_SPLITS)
        else:
            o_lat = paged.mla_decode_ref(q_abs, pool, meta.block_table, meta.seq_lens, meta.decode_tiles, r, scale)
        attn[rows_at] = torch.einsum("bhr,hdr->bhd", o_lat, lw.v_up.view(qh, hd, r)).reshape(rows_at.shape[0], -1)

    def _layers_fused(self, meta, pools, splits, scratch, on_layer, rope) -> torch.Tensor:
        """Every layer with the fused Triton kernels: ~9 launches a layer."""
        from pushkv.model.kernels import prefetch, triton_gemv
        from pushkv.model.kernels import triton_fused as K
        from pushkv.model.kernels.triton_moe import FUSED_ROUTE_TOKENS

        m, cfg, p = self.m, self.m.cfg, self.m.plan
        eps, layers = cfg.rms_eps, m.w.layers
        T = meta.ids.shape[0]
        linear = triton_gemv.linear if 0 < T <= GEMV_TOKENS else F.linear  # the qkv and o projections
        x = F.embedding(meta.ids, m.w.embed)
        x, h = K.add_rms(x, None, layers[0].input_norm, eps)
        attn = torch.empty(T, p.q_heads, self.hd, device=self.device, dtype=m.dtype)
        places = ahead_places(T, m.tp_size)
        whole = self._whole_prompts(meta, pools[0])
        longest = max((n for _, n in whole), default=0)
        fresh_rows = paged.fresh_rows(whole) if whole else 0
        for layer, lw in enumerate(layers):
            qkv = m.adapted(lw, "qkv", linear(h, lw.qkv, lw.qkv_bias), h)
            fresh = bool(whole) and (not m.layer_window(layer) or m.layer_window(layer) >= longest)
            qkv_out = K.qk_norm_rope_store(qkv, p.q_heads, p.kv_heads, self.hd, lw.q_norm, lw.k_norm, eps, rope[0],
                                           rope[1], rope[2], meta.slots, pools[layer],
                                           rows_out=fresh_rows if fresh else 0)
            if on_layer is not None:
                on_layer(layer)
            if "o" in places:
                prefetch.ahead(lw.o, self.sms)
            if fresh:
                a = paged.fresh_attention(qkv_out[0], qkv_out[1], qkv_out[2], whole, attn)
            else:
                a = paged.attention(qkv_out, pools[layer], meta, m.layer_window(layer), attn, splits, scratch)
            o = m._all_reduce(m.adapted(lw, "o", linear(a.view(T, -1), lw.o), a.view(T, -1)))
            nxt_qkv = layers[layer + 1].qkv if layer + 1 < len(layers) else None
            if lw.router is not None and 0 < T <= min(ROUTER_IN_NORM_TOKENS, FUSED_ROUTE_TOKENS):
                # MoE, a decode step: the router's logits made with the norm, one launch less
                x, h, logits = K.add_rms_router(x, o, lw.post_norm, eps, lw.router)
                if "qkv_route" in places and nxt_qkv is not None:
                    prefetch.ahead(nxt_qkv, self.sms)
                delta = m.mlp_delta(lw, h, summed=False, logits=logits)
            elif lw.router is not None:  # MoE: the grouped Triton kernels (kernels/triton_moe.py), whose
                x, h = K.add_rms(x, o, lw.post_norm, eps)
                delta = m.mlp_delta(lw, h, summed=False)  # k experts a token add_rms sums
            else:
                x, h = K.add_rms(x, o, lw.post_norm, eps)
                act = K.silu_mul(m.adapted(lw, "gate_up", F.linear(h, lw.gate_up), h))
                delta = m._all_reduce(m.adapted(lw, "down", F.linear(act, lw.down), act))
            if "qkv_sum" in places and nxt_qkv is not None:
                prefetch.ahead(nxt_qkv, self.sms)
            nxt = layers[layer + 1].input_norm if layer + 1 < len(layers) else m.w.final_norm
            x, h = K.add_rms(x, delta, nxt, eps)
        return h

    def _whole_prompts(self, meta: StepTensors, pool: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """The step's prompts (``meta.whole``) where its attention goes through ``paged.fresh_attention``
        (``SDPA_PROMPT_TOKENS``, ``_fresh_fits``), else empty; the pool must hold the keys as the step made them."""
        if not self._fresh_fits() or not meta.whole or pool.dtype != self.m.dtype:
            return ()
        return meta.whole if min(n for _, n in meta.whole) >= SDPA_PROMPT_TOKENS else ()

    def _fresh_fits(self) -> bool:
        """Whether this model's prompts may take the fused attention at all (``SDPA_PROMPT_TOKENS`` on): the fused
        attentions take bf16 and fp16, and the default softmax scale."""
        m = self.m
        return bool(SDPA_PROMPT_TOKENS) and m.attn_scale is None and m.dtype in (torch.bfloat16, torch.float16)

    # ------------------------------------------------------------- CUDA graphs
    def _replay(self, plan: StepPlan, pools: list[torch.Tensor]) -> torch.Tensor:
        bucket = self.bucket(plan.num_seqs)
        self._graphs_for(pools, plan.block_table.shape[1])
        lora = self.m.lora_step is not None
        graphs = self.lora_graphs if lora else self.graphs
        g = graphs.get(bucket)
        if g is None:
            g = graphs[bucket] = self.graph_type(self, bucket, self.graph_width, pools, lora)
        return g.run(plan)

    def warmup(self, pools: list[torch.Tensor], num_tokens: int = 512) -> float:
        """Compile the prefill and decode kernels (no K/V is stored); seconds taken."""
        t0 = time.perf_counter()
        u = pools[0].shape[-2]
        longest = self.m.cfg.max_position
        n = min(num_tokens, longest - 1)

        def seq(i: int, length: int, start: int) -> SeqWork:
            # within the model's positions (the RoPE table's rows): a model of a few hundred (llama2.c's 256) too
            length = min(length, longest)
            start = min(start, longest - length)
            return SeqWork(i, (0,) * length, start, (0,) * (-(-(start + length) // u)))

        # Triton specialises integer arguments equal to 1 and divisible by 16: compile every such
        # variant of the step's counts now (one prefill, a few, sixteen; token totals odd and
        # even) rather than mid-serving, where the first batch of two prefills paid ~0.9 s of JIT
        # on an H200 (docs/results/gpu2_8b/README.md)
        batches = [
            [seq(0, n, 0), seq(1, 1, n)],
            [seq(0, 37, 0), seq(1, 50, 0), seq(2, 1, 100), seq(3, 1, 7), seq(4, 1, 300)],
            [seq(i, 16, 0) for i in range(16)] + [seq(16 + i, 1, 64 + i) for i in range(16)],
            [seq(0, 29, 40), seq(1, 1, 55)],  # a prefill chunk that starts past position 0
        ]
        for seqs in batches:
            plan = plan_step(seqs, u, self.block_q)
            plan.slots[:] = -1
            for splits in {1, self.decode_splits(len([s for s in seqs if len(s.token_ids) == 1]))}:
                self.forward(StepTensors.upload(plan, self.device, self.staging), pools, splits)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def warm_fresh(self, max_tokens: int) -> float:
        """Have torch's fused attention make its plan for every prompt length ``_whole_prompts`` takes up to
        ``max_tokens`` now (``paged.fresh_lengths`` from ``SDPA_PROMPT_TOKENS``): cuDNN builds one
        per length it meets, 60 ms on an H100, which a prompt would wait for mid-serving. Seconds taken (0 where
        the fused attention is off)."""
        hd, p = self.hd, self.m.plan
        if not (self.cuda and self._fresh_fits()):
            return 0.0
        t0 = time.perf_counter()
        for rows in paged.fresh_lengths(SDPA_PROMPT_TOKENS, max_tokens):
            q = torch.zeros(rows, p.q_heads, hd, device=self.device, dtype=self.m.dtype)
            kv = torch.zeros(rows, p.kv_heads, hd, device=self.device, dtype=self.m.dtype)
            paged.fresh_attention(q, kv, kv, ((0, rows),), q)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def capture(self, pools: list[torch.Tensor], up_to: Optional[int] = None) -> float:
        """Capture every decode bucket up to max_num_seqs now (at start-up); seconds taken."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        self._graphs_for(pools, 0)
        last = self.bucket(min(up_to or self.max_num_seqs, self.max_num_seqs))
        for b in reversed([b for b in self.buckets if b <= last]):
            if b not in self.graphs:
                self.graphs[b] = self.graph_type(self, b, self.graph_width, pools)
        return time.perf_counter() - t0

    def drop_graphs(self) -> None:
        """Drop the captured graphs; the next decode step captures its bucket's again."""
        if self.graphs or self.lora_graphs:  # no replay of them may still run, and their memory pool goes with them:
            if torch.device(self.device).type == "cuda":  # capturing into a pool whose graphs were
                torch.cuda.synchronize(self.device)  # all released trips the caching allocator's
            self.graph_pool = None  # use_count assert (seen on an H200)
        self.graphs.clear()
        self.lora_graphs.clear()

    def _graphs_for(self, pools: list[torch.Tensor], width: int) -> None:
        """Drop the graphs that cannot run a step on these pools with tables this wide.

        A graph replays the addresses it was captured with: the pools of its capture, whatever
        pools a later step names. One caller driving several pools (a pool per request, as the
        model tests and experiments/models_gpu.py do) had its decode steps read and write the
        first pool's blocks, freed memory by then, and float32 tokens differed from eager ones."""
        key = pools_key(pools)
        if key != self.graph_pools or width > self.graph_width:
            self.drop_graphs()
            self.graph_pools = key
            self.graph_width = max(width, -(-self.m.cfg.max_position // pools[0].shape[-2]))


# A decode graph whose table holds at most this many entries (its size x its width) lands a replay's step arrays in
# one copy: the table rows are staged on the host at the graph's own width, so the copy lands them in the graph's
# table (only each row's first step-width entries are written; the kernels read no entry past a sequence's blocks).
# Larger graphs stage the rows at the step's width and one more copy spreads them into the table (a 64-sequence
# graph's full table would be 655 KB of host copy a step at Qwen3-30B-A3B's 2,560 blocks a row). On an H100,
# Qwen3-30B-A3B's step (context 512; experiments/moe_decode_probe.py, variant ``two_copies``;
# docs/results/2026-12-06-one-copy-h100): batch 1 2.986 -> 2.969 ms (1.47x its bytes bound), batch 2 4.456 ->
# 4.451, the same bits; batch 4 (a 40 KB copy) 6.892 with two copies against 6.908 with one. 8,192: a 32 KB copy
# at most (graphs of 1 and 2 sequences at 2,560 blocks a row, up to 8 at 1,024). 0: never
ONE_COPY_ENTRIES = 8192


def pools_key(pools: Sequence[torch.Tensor]) -> tuple:
    """What a captured step holds of the pools: each layer view's address, shape, strides and dtype."""
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in pools)


class _DecodeGraph:
    """One captured decode step of exactly `size` sequences (shorter batches pad with
    sequences of no keys whose K/V are not stored); with ``lora``, through the adapters each row's slot names
    (``meta.lora``, a graph input; pushkv.model.lora)."""

    def __init__(self, fwd: BatchedForward, size: int, width: int, pools: list[torch.Tensor], lora: bool = False):
        dev, self.fwd, self.size = fwd.device, fwd, size
        ar = torch.arange(size, dtype=torch.int32, device=dev)
        zeros = torch.zeros(size, dtype=torch.int32, device=dev)
        # where a replay's copy lands: ids, positions, slots, seq_lens and LoRA slots (the graph's own inputs, views
        # of it), then the table rows: at the graph's width, its table itself (``one_copy``), else at the step's
        # width, which one more copy spreads into the graph's table
        self.inputs = torch.zeros(size * (5 + width), dtype=torch.int32, device=dev)
        ids, positions, slots, seq_lens, lora_slots = self.inputs[:5 * size].view(5, size)
        slots.fill_(-1)
        self.width, self.one_copy = width, size * width <= ONE_COPY_ENTRIES
        table = self.inputs[5 * size:].view(size, width) if self.one_copy else \
            torch.zeros(size, width, dtype=torch.int32, device=dev)
        self.meta = StepTensors(
            ids=ids, positions=positions, slots=slots,
            seq_lens=seq_lens, q_starts=ar.clone(), q_lens=torch.ones_like(zeros),
            decode_tiles=ar.clone(), decode_q0=zeros.clone(),
            prefill_tiles=zeros[:0], prefill_q0=zeros[:0], sample_rows=ar.clone(),
            block_table=table, block_q=fwd.block_q,
            lora=lora_slots)
        bank = fwd.m.lora_bank
        self.lora_step = LoraStep(bank, self.meta.lora) if lora and bank is not None else None
        self.splits = fwd.decode_splits(size)
        p = fwd.m.plan
        self.scratch = paged.decode_scratch(self.splits, size, p.q_heads, p.kv_heads, fwd.hd, dev)
        self.logits = torch.empty(size, fwd.m.cfg.vocab_size, device=dev, dtype=torch.float32)
        self.staging = Staging()  # the step's arrays, pinned, one copy per replay
        self.staging.take(size * (5 + width))
        self._capture(pools)

    def _forward(self, pools: list[torch.Tensor]) -> None:
        """The step on the static buffers, through the graph's own LoraStep (the rows' slots in ``meta.lora``)."""
        m = self.fwd.m
        outer, m.lora_step = m.lora_step, self.lora_step
        if self.lora_step is not None:  # its masks made again from meta.lora: in the capture too, so the graph
            self.lora_step.fresh()  # makes them each replay, never keeping a warm-up's
        try:
            self.fwd.forward(self.meta, pools, self.splits, self.scratch, self.logits)
        finally:
            m.lora_step = outer

    def _capture(self, pools: list[torch.Tensor]) -> None:
        """Record the step on the pools: the graph keeps their addresses, not the tensors."""
        dev, fwd = self.fwd.device, self.fwd
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm up (Triton compiles, cuBLAS picks) off the capture
            for _ in range(2):
                self._forward(pools)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        if fwd.graph_pool is None:
            fwd.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=fwd.graph_pool):
            self._forward(pools)

    def _launch(self) -> None:
        self.graph.replay()

    def staged(self, plan: StepPlan) -> torch.Tensor:
        """The step's arrays in the pinned staging buffer: ids, positions, slots, seq_lens, LoRA slots (padded to
        the graph's size), then the table rows: at the graph's width where ``one_copy`` (each row's first W entries
        written, the rest as they were: no kernel reads them), else at the step's width; the part to copy."""
        B, S, W = plan.num_seqs, self.size, plan.block_table.shape[1]
        row = self.width if self.one_copy else W
        host = self.staging.take(5 * S + S * row)
        h = host.numpy()
        h[:5 * S].fill(0)
        h[2 * S:3 * S].fill(-1)
        h[0:B] = plan.ids
        h[S:S + B] = plan.positions
        h[2 * S:2 * S + B] = plan.slots
        h[3 * S:3 * S + B] = plan.seq_lens
        h[4 * S:4 * S + B] = plan.lora
        tab = h[5 * S:5 * S + S * row].reshape(S, row)
        tab[:B, :W] = plan.block_table
        tab[B:, :W] = 0
        return host[:5 * S + (S - 1) * row + W]  # (to the last row's W-th entry)

    def run(self, plan: StepPlan) -> torch.Tensor:
        B, S, W = plan.num_seqs, self.size, plan.block_table.shape[1]
        host = self.staged(plan)
        # one copy where the table is small (``one_copy``), else two: the host arrays straight into the graph's
        # inputs, then the table rows into its table (each copy a launch the GPU waits on between replays)
        n = host.numel()
        self.inputs[:n].copy_(host, non_blocking=True)
        if self.fwd.cuda:
            self.staging.copied()
        if not self.one_copy:
            self.meta.block_table[:, :W].copy_(self.inputs[5 * S:5 * S + S * W].view(S, W))
        self._launch()
        return self.logits[:B].clone()  # the next replay overwrites the static buffer
