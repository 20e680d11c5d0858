"""The scheduler's side of the prefix cache (pure): which cached blocks a prompt takes at
admission, and which of a request's blocks are offered to the cache once their KV is complete.
Whether a role uses the cache at all is the scheduler's hooks' to say (``_reuses_prefix``, ``_hit_unit``,
``_indexes``); the core's admission calls ``hits_for`` and ``took_hits``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pushkv.protocol.prefix_cache import PrefixCache, block_hashes, root_of
from pushkv.scheduler.lora_table import prefix_key
from pushkv.scheduler.requests import Request

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore


def may_hit(core: "SchedulerCore", r: Request) -> bool:
    """May ``r`` take its prompt's prefix from the cache? Not where prompt logprobs are computed
    for it: positions whose KV came from the cache have no logits (vLLM skips the hit too)."""
    return core.alloc.enabled and core._reuses_prefix(r) and r.score_prompt < 0


def hits_for(core: "SchedulerCore", r: Request) -> list[int]:
    """The cached blocks ``r`` would take at admission (none where it may not hit)."""
    if not may_hit(core, r):
        return []
    return prefix_hits(core.alloc, r, core.inst.block_size, core._hit_unit())


def took_hits(core: "SchedulerCore", r: Request, hit_blocks: int) -> None:
    """``r`` was admitted with ``hit_blocks`` cached blocks: its computed and indexed marks, and the counters.
    A preempted request's readmission counts its hits apart (``recompute_hit_tokens``): its prompt was looked up
    once, and the cached tokens it reports are its first admission's."""
    r.unchained = False  # it computes on from the hit: its chain is whole again
    if r.preemptions:
        r.prefilled = hit_blocks * core.inst.block_size
        r.indexed = hit_blocks
        core.counters["recompute_hit_tokens"] += r.prefilled
        return
    r.cached = hit_blocks * core.inst.block_size
    r.prefilled = r.cached
    r.indexed = hit_blocks
    if core.alloc.enabled and r.score_prompt >= 0:
        core.counters["prefix_skipped_prompt_logprobs"] += 1
    if not may_hit(core, r):
        return
    core.counters["prefix_queries"] += 1
    core.counters["prefix_query_tokens"] += len(r.prompt)
    if hit_blocks:
        core.counters["prefix_hits"] += 1
        core.counters["prefix_hit_tokens"] += r.cached


def _root(r: Request) -> int:
    """Where the request's chain of block hashes starts: its salt's root, its adapter's name and weights' id in it."""
    return root_of(r.cache_salt, prefix_key(r.lora, r.lora_id))


def prefix_hits(alloc: PrefixCache, r: Request, block_size: int, unit: int) -> list[int]:
    """Cached blocks of the prompt's longest cached prefix, a whole number of ``unit`` tokens.
    The last prompt token is always computed (its logits give the first token), so a block
    holding it is never a hit: a step then writes only into blocks the request owns alone.
    After a preemption the prefix is of the prompt and output so far (``prefill_ids``): the hashes of its
    output's full blocks are there where they were indexed."""
    if not r.hashes:
        r.hashes = block_hashes(r.prompt, block_size, _root(r))
    hits = alloc.match(r.hashes[:(len(r.prefill_ids) - 1) // block_size])
    return hits[:len(hits) * block_size // unit * unit // block_size]


def index_blocks(alloc: PrefixCache, r: Request, upto: int, block_size: int) -> None:
    """Offer the request's full blocks below token ``upto`` (KV complete) to the cache."""
    bs = block_size
    full = min(upto // bs, len(r.blocks))
    if full <= r.indexed:
        return
    if len(r.hashes) < full or alloc.journal is not None:  # the tokens of the blocks, where they are read
        seq = r.prompt if full * bs <= len(r.prompt) else tuple(r.prompt) + tuple(r.output)
    if len(r.hashes) < full:
        parent = r.hashes[-1] if r.hashes else _root(r)
        r.hashes.extend(block_hashes(seq[:full * bs], bs, parent, start=len(r.hashes) * bs))
    if alloc.journal is None:
        for i in range(r.indexed, full):
            alloc.insert(r.blocks[i], r.hashes[i])
    else:  # KV events: each block's parent, tokens and (a prompt's first) salt too
        for i in range(r.indexed, full):
            alloc.insert(r.blocks[i], r.hashes[i], r.hashes[i - 1] if i else None, seq[i * bs:(i + 1) * bs],
                         r.cache_salt if i == 0 else "", (r.lora_id, r.lora) if r.lora else None)
    r.indexed = full
