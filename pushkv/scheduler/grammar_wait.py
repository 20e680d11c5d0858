"""The scheduler core's requests held for their structured output's grammar: a request whose spec is not compiled
here waits out of the queue (``State.GRAMMAR``, no blocks) for the one compile of its spec, asked of the shell
(``CompileGrammar``, compiled on its threads); when it ends (``compiled``) they queue by arrival, or fail (400).
When the last of them leaves first, the compile is no longer asked for (``CancelCompile``).
The core's ``compiled`` entry point, ``on_Generate`` and ``_release`` call these; pure, as the core is."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from pushkv.scheduler.grammar import GrammarCompiled, failure
from pushkv.scheduler.outbox import CancelCompile, CompileGrammar
from pushkv.scheduler.requests import Request, State

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore


def compiled(core: "SchedulerCore", done: GrammarCompiled, now: float, wall: float) -> None:
    """A grammar asked for (``CompileGrammar``) compiled off the loop: the requests held for it queue for
    blocks in their order of arrival, or fail (400) when it did not compile. Those released meanwhile
    (aborted, superseded, refused at shutdown) are gone from its list: nothing attaches to them."""
    core.now, core.wall = now, wall
    if done.grammar is not None:
        core.grammars.add(done.spec, done.grammar)
    for r in core.compiling.pop(done.spec, []):
        why = done.error
        if not why:
            try:
                r.grammar = core.grammars.matcher_of(done.spec, done.grammar)
            except Exception as e:
                why = failure(e)
        if why:
            core.counters["grammar_failed"] += 1
            core._fail(r, why, 400)
            continue
        r.state = State.WAITING
        core._stamp(r, "grammar_compiled")
        enqueue(core.waiting, r)
    core.schedule()


def enqueue(waiting: list[Request], r: Request) -> None:
    """``r``'s place in the queue once its grammar compiled: by arrival, not by compile, but behind the preempted
    requests at the queue's front (vLLM puts a preempted request back at the front of waiting, where a request held
    for its grammar, in the queue at its arrival's place, stays behind it)."""
    fresh = next((i for i, q in enumerate(waiting) if not q.preemptions), len(waiting))
    bisect.insort(waiting, r, lo=fresh, key=lambda q: q.seq_id)


def hold(core: "SchedulerCore", r: Request) -> None:
    """Its grammar is not compiled here: it waits, out of the queue, for the one compile of its spec (asked
    of the shell by the first request that needs it); every request beside it goes on meanwhile."""
    assert r.structured is not None
    r.state = State.GRAMMAR
    held = core.compiling.get(r.structured)
    if held is None:
        held = core.compiling[r.structured] = []
        core.counters["grammar_compiles"] += 1
        core.outbox.append(CompileGrammar(r.structured))
    held.append(r)


def unhold(core: "SchedulerCore", r: Request) -> None:
    """``r`` leaves (released while it waits for its grammar) and no longer waits for the compile. Where it was the
    last, the compile is no longer asked for: a request of the spec later asks again, and the shell drops the
    compile if it has not started (``CancelCompile``; one under way ends, and its grammar is kept)."""
    if r.state == State.GRAMMAR and r.structured is not None:
        held = core.compiling.get(r.structured)
        if held is not None:
            held[:] = [q for q in held if q is not r]
            if not held:
                del core.compiling[r.structured]
                core.counters["grammar_compiles_cancelled"] += 1
                core.outbox.append(CancelCompile(r.structured))
