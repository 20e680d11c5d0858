"""Which waiting prompts P's next step takes, as P's scheduler builds the step: pure, for the planner.

A prefill instance runs no decodes and, without ``--prefill-chunk``, computes each prompt whole in
one step (``scheduler.requests.build_batch``). The prompts that arrive while a step runs wait for it
to end, and the next step takes them together, in arrival order: the first whole even past the
budget, each next one while the step's tokens stay within ``max_batch_tokens`` and its prompts within
``max_num_seqs``. The first prompt that does not fit waits for a later step, and every prompt behind
it waits too (FIFO). Every prompt of a step waits for the whole step: its KV is stored, and its first
token sampled, when the step ends.
"""
from __future__ import annotations

from typing import Sequence


def next_step(waiting: Sequence[int], max_batch_tokens: int, max_num_seqs: int) -> int:
    """How many prompts at the head of ``waiting`` (each one's tokens to compute, in arrival order)
    the next step takes: at least one while any waits; ``max_batch_tokens`` 0 takes one a step."""
    if max_batch_tokens < 0 or max_num_seqs < 1:
        raise ValueError(f"a prefill step needs max_batch_tokens >= 0 and max_num_seqs >= 1 "
                         f"(got {max_batch_tokens} and {max_num_seqs})")
    taken = tokens = 0
    for n in waiting:
        if taken >= max_num_seqs or (taken and tokens + n > max_batch_tokens):
            break
        taken += 1
        tokens += n
    return taken
