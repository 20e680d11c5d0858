"""The scheduler core's blocks as tokens need them, and preemption by recompute (local instances, D's legs, and a
prompt P computes chunk by chunk: ``SchedulerCore._chunkwise``). Pure, as the core is; its ``schedule`` calls
``grow`` before each step, as vLLM's v1 scheduler allocates its running requests' slots before it admits.

A prompt computed chunk by chunk is admitted into a step being built with its first chunk's blocks (its whole prefill
must fit the blocks free, vLLM's ``scheduler_reserve_full_isl``); any other leg with all its prefill's blocks and its
next token's slot (``Request.blocks_to_admit``). Before a step, each request the step takes gets the blocks its
tokens need: a prompt's next chunk, a decode's next token where it starts a block (the oldest running first; one
that --max-num-seqs, --max-batch-tokens or --max-loras leaves out of the step gets none, as vLLM allocates only for
what it schedules);
where none is free, the last to begin running of the requests computing here is preempted (vLLM's ``running[-1]``;
``Request.admit_seq``: its admission, or on D its KV's arrival), until the block comes or the one preempted is the
one that asked. Preempted, a request's blocks go back (its full blocks
stay in the prefix cache where they were indexed) and it waits at the front of the queue; readmitted, it prefills
its prompt and output so far (``Request.prefill_ids``, chunked as any prompt, its cached blocks taken), and its last
chunk samples output token len(output) as a decode step would. What it sent stays sent: no second first token, TTFT
or prompt logprobs."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pushkv.scheduler.outbox import Trace
from pushkv.scheduler.requests import Request, State

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore

log = logging.getLogger("pushkv.scheduler.core")


def grow(core: "SchedulerCore") -> bool:
    """Before a step: the blocks each request the step takes needs for its tokens (``SchedulerCore.step_plan``: a
    decode's next token, a prompt's next chunk), the oldest running first, preempting where none is free. Only those
    the step takes: one that --max-num-seqs, --max-batch-tokens or --max-loras leaves out (D runs more than
    --max-num-seqs at once) gets its blocks when a step takes it, as vLLM allocates only for the requests it
    schedules. A preemption can let a request left out into the step: the step's requests are read again after each.
    True: a request was preempted (that pass admits none, as vLLM's)."""
    bs = core.inst.block_size
    preempted = False
    stuck: set[tuple[str, int]] = set()
    while True:
        for r, n in sorted(core.step_plan(), key=lambda rn: rn[0].admit_seq):
            short = r.blocks_short(bs, n)
            if short <= 0 or r.key in stuck:
                continue
            got = core.alloc.allocate(short)
            if got is not None:
                r.blocks += got
                continue
            victims = [v for v in core.reqs.values() if preemptible(core, v)]
            if not victims:  # every other block is held by what cannot give it back yet (a transfer, a KV check)
                stuck.add(r.key)
                continue
            preempt(core, max(victims, key=lambda v: v.admit_seq))
            preempted = True
            break  # the step's requests may differ now: read them again
        else:
            return preempted


def preemptible(core: "SchedulerCore", r: Request) -> bool:
    """Computing here (prefilling or decoding), between steps, and nothing else may touch its blocks."""
    return (r.state in (State.PREFILL, State.RUNNING) and bool(r.blocks) and not r.in_step and not r.aborted
            and not core._pinned_by_writers(r))


def preempt(core: "SchedulerCore", r: Request) -> None:
    """Preemption by recompute: its blocks go back and it waits at the front of the queue."""
    core.counters["preemptions"] += 1
    log.info("%s: preempted (no free KV block): %d blocks freed, %d tokens to compute again transfer_id=%s",
             core.name, len(r.blocks), len(r.prompt) + len(r.output), r.transfer_id)
    core.outbox.append(Trace("preempted", r.transfer_id))
    core.alloc.free(r.blocks)
    r.blocks = []
    r.state = State.WAITING
    r.preemptions += 1
    r.prefilled = r.indexed = 0
    r.recompute = r.prompt + tuple(r.output) if r.output else ()
    r.prompt_parts = []  # (a prefill's chunks' prompt logprobs: they are scored again)
    core.waiting.insert(0, r)
