"""The scheduler's side of the prefix cache (pure): which cached blocks a prompt takes at
admission, and which of a request's blocks are offered to the cache once their KV is complete.
Whether a role uses the cache at all is the scheduler's hooks' to say."""
from __future__ import annotations

from pushkv.protocol.prefix_cache import PrefixCache, block_hashes, root_of
from pushkv.scheduler.requests import Request


def prefix_hits(alloc: PrefixCache, r: Request, block_size: int, unit: int) -> list[int]:
    """Cached blocks of the prompt's longest cached prefix, a whole number of ``unit`` tokens.
    The last prompt token is always computed (its logits give the first token), so a block
    holding it is never a hit: a step then writes only into blocks the request owns alone."""
    if not r.hashes:
        r.hashes = block_hashes(r.prompt, block_size, root_of(r.cache_salt))
    hits = alloc.match(r.hashes[:(len(r.prompt) - 1) // block_size])
    return hits[:len(hits) * block_size // unit * unit // block_size]


def index_blocks(alloc: PrefixCache, r: Request, upto: int, block_size: int) -> None:
    """Offer the request's full blocks below token ``upto`` (KV complete) to the cache."""
    bs = block_size
    full = min(upto // bs, len(r.blocks))
    if full <= r.indexed:
        return
    if len(r.hashes) < full:
        seq = r.prompt if full * bs <= len(r.prompt) else tuple(r.prompt) + tuple(r.output)
        parent = r.hashes[-1] if r.hashes else root_of(r.cache_salt)
        r.hashes.extend(block_hashes(seq[:full * bs], bs, parent, start=len(r.hashes) * bs))
    for i in range(r.indexed, full):
        alloc.insert(r.blocks[i], r.hashes[i])
    r.indexed = full
