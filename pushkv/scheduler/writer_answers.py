"""The scheduler core's answers from its writer ranks (``KVSent``, ``KVReceived``, ``KVFailed``): one terminal answer
per rank collected for a request's transfer, then the transfer ends, fails or goes on (the role's ``_kv_done``).
The core's ``on_KVSent``, ``on_KVReceived`` and ``on_KVFailed`` call ``take``; pure, as the core is."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pushkv import messages as m
from pushkv.scheduler.outbox import Peer
from pushkv.scheduler.requests import Request, State, failures_of

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore, WriterAnswer

log = logging.getLogger("pushkv.scheduler.core")


def take(core: "SchedulerCore", msg: "WriterAnswer", frm: Peer) -> None:
    """Collect one terminal answer per writer rank; act once all have answered."""
    if not isinstance(msg, core.writer_answers):  # another role's answer: it would end a transfer wrongly
        core.counters["wrong_writer_answer"] += 1
        log.error("%s: %s from a writer; this role's writers answer %s transfer_id=%s", core.name,
                  type(msg).__name__, [t.__name__ for t in core.writer_answers], msg.transfer_id)
        return
    r = core.reqs.get((msg.transfer_id, msg.generation))
    if r is None or not (r.state in (State.SENDING, State.AWAIT_KV) or core._pinned_by_writers(r)):
        core.counters["stale_writer_answer"] += 1
        return
    _note_answer(core, r, msg, frm.rank)
    if len(r.answers) < len(core.writers):
        return
    answers, r.answers = r.answers, {}
    if core._pinned_by_writers(r) and r.in_step:  # the chunk computing now still writes the blocks
        _stream_over_mid_step(core, r, answers)  # they are freed when its step ends
        return
    _transfer_over(core, r, answers)
    core.schedule()


def _note_answer(core: "SchedulerCore", r: Request, msg: "WriterAnswer", rank: int) -> None:
    """One writer rank's answer: what it moved, and on failure the other ranks' cancel."""
    r.note_answer(msg, rank)
    if isinstance(msg, m.KVFailed) and len(core.writers) > 1:
        others = m.CancelKV(r.transfer_id, r.generation, msg.reason)
        for w in core.writers:
            if w.rank != rank:
                core._send(w, others)


def _stream_over_mid_step(core: "SchedulerCore", r: Request, answers: dict[int, m.Msg]) -> None:
    """P: a stream ended before its prefill while a chunk computes: no writer reads the
    blocks now; the request fails at once (unless aborted already) and is freed when the
    step ends."""
    r.streamed = False
    if r.aborted:
        return
    failures, lost = failures_of(answers)
    r.aborted = f"KV stream failed: {failures[0].reason}" if failures else "KV stream ended"
    status, reason = (503, f"{lost}; retry") if lost else (502, r.aborted)
    core.counters["requests_failed"] += 1
    core._observe_finish(r, "error")
    core._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, status))


def _transfer_over(core: "SchedulerCore", r: Request, answers: dict[int, m.Msg]) -> None:
    """Every writer rank answered ``r``'s transfer: free it, fail it, or go on (``_kv_done``)."""
    failures, lost = failures_of(answers)
    if core._pinned_by_writers(r):  # a stream ended before its prefill: no writer reads the blocks now
        r.streamed = False
        if not failures and not r.aborted:  # writers answer a stream's end only when it failed
            failures = [m.KVFailed(r.transfer_id, r.generation, "KV stream ended before prefill")]
    if r.aborted:
        core._release(r)
    elif lost:  # the other instance died: answered as the router answers it (503, retry)
        core._fail(r, f"{lost}; retry", 503)
    elif failures:
        core._fail(r, f"KV transfer failed: {failures[0].reason}", 502)
    else:
        core._kv_done(r, answers)  # type: ignore[arg-type]  # every answer a success
