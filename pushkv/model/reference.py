"""Dense, non-paged reference forward used by tests to validate the paged path.

Shares the model's weights and linear blocks but none of its KV handling: a growing
per-layer K/V list, its own RoPE (angles computed per position) and an explicit
softmax(QK^T) attention with the causal / sliding-window rule written out.
"""
from __future__ import annotations

import math

import torch

from pushkv.model.masks import visible
from pushkv.model.rope import inv_freq
from pushkv.model.transformer import Model, rms_norm


def _rope(x: torch.Tensor, positions: torch.Tensor, cfg) -> torch.Tensor:
    """x [N, heads, hd]; rotate pairs (i, i + hd/2) by position * inv_freq[i] (the scheme's
    frequencies, pushkv.model.rope, for a sequence that ends with these positions), times YaRN's
    attention factor where it has one."""
    hd = x.shape[-1]
    half = hd // 2
    freq = inv_freq(cfg.rope_theta, hd, cfg.rope_scaling, int(positions[-1]) + 1)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]
    scale = cfg.rope_scaling.attention_factor if cfg.rope_scaling.rope_type == "yarn" else 1.0
    cos = (ang.cos() * scale).to(x.dtype)[:, None, :]
    sin = (ang.sin() * scale).to(x.dtype)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _attention(q, keys, vals, qpos: torch.Tensor, window: int) -> torch.Tensor:
    """q [T, H, hd], keys/vals [S, KH, hd] for positions 0..S-1 -> [T, H * hd]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    vals = vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) / math.sqrt(q.shape[-1])
    kpos = torch.arange(keys.shape[0])[None, :]
    allowed = visible(qpos[:, None], kpos, window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), vals.float())
    return out.to(q.dtype).reshape(q.shape[0], -1)


def _step(model: Model, cache: list[list[torch.Tensor]], ids: list[int], start: int, every: bool = False
          ) -> torch.Tensor:
    """The last new position's logits (``every``: each new position's, [len(ids), vocab])."""
    cfg, eps = model.cfg, model.cfg.rms_eps
    p = model.plan
    positions = torch.arange(start, start + len(ids))
    x = model.w.embed[torch.tensor(ids)]
    for layer, lw in enumerate(model.w.layers):
        h = rms_norm(x, lw.input_norm, eps)
        qkv = h @ lw.qkv.T
        q, k, v = (qkv if lw.qkv_bias is None else qkv + lw.qkv_bias).split(
            [p.q_heads * cfg.head_dim, p.kv_heads * cfg.head_dim, p.kv_heads * cfg.head_dim], -1)
        q = q.reshape(len(ids), p.q_heads, cfg.head_dim)
        k = k.reshape(len(ids), p.kv_heads, cfg.head_dim)
        v = v.reshape(len(ids), p.kv_heads, cfg.head_dim)
        if lw.q_norm is not None and lw.k_norm is not None:  # both or neither (cfg.qk_norm)
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        q, k = _rope(q, positions, cfg), _rope(k, positions, cfg)
        cache[layer][0] = torch.cat((cache[layer][0], k))
        cache[layer][1] = torch.cat((cache[layer][1], v))
        attn = _attention(q, cache[layer][0], cache[layer][1], positions, model.layer_window(layer))
        x = model.attn_out(lw, x, attn)
        x = model.mlp(lw, x)
    return model.head(x) if every else model.head(x[-1:])[0]


@torch.inference_mode()
def prompt_logits(model: Model, prompt_ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of the prompt, [len(prompt_ids), vocab]: row i is the
    model's distribution of token i + 1."""
    cfg, p = model.cfg, model.plan
    empty = torch.empty(0, p.kv_heads, cfg.head_dim, dtype=model.dtype)
    return _step(model, [[empty, empty] for _ in range(cfg.num_layers)], list(prompt_ids), 0, every=True)


@torch.inference_mode()
def dense_logits(model: Model, prompt_ids: list[int], max_tokens: int) -> list[torch.Tensor]:
    """Logits of every greedy step: prompt at once, then one token at a time."""
    cfg, p = model.cfg, model.plan
    empty = torch.empty(0, p.kv_heads, cfg.head_dim, dtype=model.dtype)
    cache = [[empty, empty] for _ in range(cfg.num_layers)]
    out, ids, start = [], list(prompt_ids), 0
    for _ in range(max_tokens):
        logits = _step(model, cache, ids, start)
        out.append(logits)
        start += len(ids)
        ids = [int(logits.argmax())]
    return out


def generate_dense(model: Model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after prompt_ids, computed without the paged KV pool."""
    return [int(l.argmax()) for l in dense_logits(model, prompt_ids, max_tokens)]
