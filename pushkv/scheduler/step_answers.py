"""The scheduler core's answers from its worker ranks to a step (``StepDone``, ``StepFailed``): one per rank, then
each request of the step goes on with its sampled token, its prompt logprobs and (--kv-verify) its KV's checksums,
or every one fails with the step. The core's ``on_StepDone`` and ``on_StepFailed`` call ``take``; pure, as the
core is."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from pushkv import messages as m
from pushkv.kv import checksum
from pushkv.prompt_logprobs import join as join_prompt_logprobs
from pushkv.scheduler.outbox import Peer
from pushkv.scheduler.requests import Request

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import Batch, SchedulerCore, StepAnswer

log = logging.getLogger("pushkv.scheduler.core")


def take(core: "SchedulerCore", msg: "StepAnswer", frm: Peer) -> None:
    """One worker rank's answer to the step; once every rank has answered, each request of the step goes on (or
    fails with the step), and the core schedules the next."""
    if core.step is None or msg.step_id != core.step_id:
        if not core.late_step_answer(msg.step_id, frm.rank):
            core.counters["stale_step_answer"] += 1
        return
    core.step_answers[frm.rank] = msg
    if len(core.step_answers) < len(core.workers):
        return
    batch, core.step = core.step, None
    failed = [a for a in core.step_answers.values() if isinstance(a, m.StepFailed)]
    if failed:
        for r, _ in batch:
            r.in_step = False
            if r.aborted:  # aborted, or failed already (its stream ended mid-step): told, nothing more to say
                if not core._pinned_by_writers(r):  # (else freed once every writer has answered its cancel)
                    core._release(r)
                continue
            core._fail(r, f"forward step failed: {failed[0].reason}")
    else:
        _take_checksums(core, batch)
        done = core.step_answers[0]
        assert isinstance(done, m.StepDone)
        sampled = iter(done.sampled)  # one token per sampled seq, in batch order
        logprobs = iter(done.logprobs or ())
        scores = iter(done.prompt_logprobs)  # one per seq that scored its prompt chunk
        for r, w in batch:
            r.in_step = False
            if w.score_prompt >= 0 and not _took_scores(core, r, next(scores, None)):
                if w.sample:
                    next(sampled)
                    next(logprobs, None)
                continue
            if w.sample:
                core._after_step(r, w, next(sampled), next(logprobs, None))
            else:
                core._after_step(r, w, None, None)
    core.schedule()


def _take_checksums(core: "SchedulerCore", batch: "Batch") -> None:
    """--kv-verify: each rank summed its own heads; one struct per request, every head."""
    asked = [r for r, w in batch if w.checksum]
    if not asked:
        return
    per_rank = [a.checksums if isinstance(a, m.StepDone) and len(a.checksums) == len(asked)
                else (None,) * len(asked) for a in core.step_answers.values()]
    for i, r in enumerate(asked):
        try:
            r.checksums = checksum.merge([sums[i] for sums in per_rank])
        except ValueError as e:
            log.error("%s: checksums of transfer_id=%s not merged: %s", core.name, r.transfer_id, e)
            r.checksums = None
        if r.checksums is None:
            core.counters["kv_checksums_missing"] += 1


def _took_scores(core: "SchedulerCore", r: Request, part: Optional[m.PromptLogprobs]) -> bool:
    """A scored chunk's prompt logprobs, kept until the prompt's end; False: the step gave none
    for it, and the request failed (its answer would lack them)."""
    if part is None and not r.aborted:
        core.counters["prompt_logprobs_missing"] += 1
        core._fail(r, "the forward step returned no prompt logprobs for it")
        return False
    if part is not None:
        r.prompt_parts.append(part)
    return True


def joined_scores(core: "SchedulerCore", r: Request) -> bool:
    """The prompt is in: its chunks' prompt logprobs as one (``r.prompt_logprobs``); False: they
    do not follow one another, and the request failed."""
    try:
        r.prompt_logprobs = join_prompt_logprobs(r.prompt_parts)
    except ValueError as e:
        core.counters["prompt_logprobs_missing"] += 1
        core._fail(r, f"prompt logprobs of the forward steps do not fit the prompt: {e}")
        return False
    r.prompt_parts = []
    if r.prompt_logprobs.count != len(r.prompt) - 1:
        core.counters["prompt_logprobs_missing"] += 1
        core._fail(r, f"prompt logprobs cover {r.prompt_logprobs.count} of the prompt's {len(r.prompt) - 1} "
                      "scored positions")
        return False
    return True
