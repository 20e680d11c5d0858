"""The scheduler core shared by every role: admission, block allocation (blocks
as tokens need them and preemption by recompute: ``preempt.py``), continuous
batching, request state, deadlines. Never touches KV bytes: workers
compute into the pool, writers move it.

Sans-I/O: no socket, no clock, no process. The entry points take the time in
(``now``, monotonic; ``wall``, for request timelines) and append what is to
happen to ``outbox`` in order (``outbox.Send`` a message to a ``Peer``,
``Trace`` an event, ``CompileGrammar`` a structured output's grammar off the loop and ``CancelCompile`` one no
request waits for any more; a ``Kill`` is only ever added by the shell's fault filter, in tests):

- ``handle(msg, frm, now, wall)``: one decoded message from the router, a worker or a writer rank;
- ``refuse_undecodable(frm, reason, payload)``: a frame from the router that did not decode;
- ``compiled(done, now, wall)``: a grammar it asked for (``CompileGrammar``) compiled off the loop, or failed;
- ``tick(now, wall)``: deadlines;
- ``shutdown(reason)``: the process stops; every request still here is refused.

``SchedulerShell`` (``pushkv.scheduler.shell``) owns the sockets and drains
``take_outbox()`` after each; tests call the entry points and read it.

What differs by role lives in one subclass each (``PrefillScheduler``,
``DecodeScheduler``, ``LocalScheduler``), behind thirteen hooks (the "role hooks" below):

- the four every role answers: ``_check_leg(msg)`` (role-specific validation of a new
  request), ``_admitted(r)`` (blocks are reserved: prefill, or wait for the KV),
  ``_prefilled(r, tok, lp)`` (the prefill step ended with first token ``tok``) and
  ``_kv_done(r, answers)`` (every writer rank answered the request's transfer with success);
- nine with a default that a role overrides where it differs: ``_chunkwise`` (a prompt takes
  its blocks chunk by chunk, or whole at admission), ``_chunk_done`` (a prefill
  chunk ended), ``_streaming`` (the step's layer-group marks), ``_step_work`` (what the
  workers get), ``_engine_blocked`` (no step may run: D's inline READ), ``_forget``,
  ``_reuses_prefix``, ``_hit_unit`` and ``_indexes`` (the prefix cache's rules).

``scheduler_for(cfg, inst)`` in ``pushkv.scheduler`` picks the class.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any, Callable, Optional, Union

from pushkv import limits
from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, Role
from pushkv.dispatch import handler_for
from pushkv.kv.layout import blocks_for
from pushkv.protocol.prefix_cache import PrefixCache
from pushkv.scheduler import grammar_wait, lora_table, preempt, prefix, stats, step_answers, writer_answers
from pushkv.scheduler.grammar import GrammarCompiled, Grammars, failure
from pushkv.scheduler.lora_table import LoraTable
from pushkv.scheduler.metrics import EndReason, Finish, InstanceMetrics, Snapshot
from pushkv.scheduler.outbox import Effect, Peer, Send, Trace
from pushkv.scheduler.prefix import index_blocks
from pushkv.scheduler.requests import Request, State, blocks_needed, chunk_tokens, count_work, plan_step, works_of
from pushkv.scheduler.validate import check_generate, readable_head

log = logging.getLogger(__name__)

# admission of a request while others compute keeps this fraction of the pool free (at least one block) for the
# running ones to grow into (vLLM's watermark, applied as its v1 scheduler does: to the waiting and the preempted)
WATERMARK = 0.01
WRITER_STATS_WAIT_S = 0.25  # GetStats: how long to wait for the writers' counters before answering
REMEMBER_IDS = 65536  # transfer ids whose newest generation is kept, to refuse duplicates and stale reissues

WriterAnswer = Union[m.KVSent, m.KVReceived, m.KVFailed]
StepAnswer = Union[m.StepDone, m.StepFailed]
Batch = list[tuple[Request, m.SeqWork]]


class SchedulerCore:
    role: Role  # set by each role's class
    # what this role's writers answer
    writer_answers: tuple[type, ...] = (m.KVSent, m.KVReceived, m.KVFailed)

    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig):
        if inst.role != self.role:
            raise ValueError(f"{type(self).__name__} serves {self.role!r} instances, not {inst.role!r}")
        self.name = f"{inst.name}-scheduler"
        self.cfg = cfg
        self.inst = inst
        self.counters: Counter[str] = Counter()  # the shell's too: its socket-level counts join these
        self.workers = tuple(Peer("worker", r) for r in range(len(inst.worker_endpoints)))
        self.writers = tuple(Peer("writer", r) for r in range(len(inst.writer_endpoints)))
        self.outbox: list[Effect] = []
        self.now = 0.0  # monotonic seconds, from the entry point being handled
        self.wall = 0.0  # wall-clock seconds, the same moment (request timelines cross processes)
        self._handlers: dict[type, Callable[[Any, Peer], None]] = {}
        # ref-counted blocks with a prefix-hash index; with the cache off, a plain allocator
        # (off under dynamic RoPE: a block's keys carry the rotation of the length they were made at)
        self.alloc = PrefixCache(inst.num_blocks, cfg.caches_prefixes(inst))
        self.reqs: dict[tuple[str, int], Request] = {}
        self.by_tid: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.next_seq = 1
        self.next_admit = 1  # running order (Request.admit_seq): the last to begin running is preempted first
        # local instances and D's legs take blocks as their tokens need them and preempt when none is free; P's
        # legs sample one token and never decode (a prompt computed chunk by chunk grows: ``_chunkwise``)
        self.grows = self.role != "prefill"
        self.watermark = max(1, int(WATERMARK * inst.num_blocks))
        self.step_id = 0
        self.step: Optional[Batch] = None
        self.step_started = 0.0
        self.step_answers: dict[int, StepAnswer] = {}
        # the blocks of steps that timed out, by step id, with the ranks that answered since: freed once every rank
        # has (a hung worker that wakes still runs the step and writes into them; D's WRITEs could land there first)
        self.late_steps: dict[int, tuple[list[list[int]], set[int]]] = {}  # (each request's table)
        self.max_len = cfg.max_model_len or cfg.model.max_position
        self.vocab = cfg.model.vocab_size
        self.lora = LoraTable(cfg.model.lora)  # the LoRA adapters this instance serves, by name and slot
        self.grammars = Grammars(cfg.model)  # structured output's compiled grammars
        # grammars compiling off the loop (asked of the shell once each), and the requests held for each
        self.compiling: dict[m.Structured, list[Request]] = {}
        self.max_stop_ids = limits.stop_ids_bound(cfg)
        self.newest: OrderedDict[str, int] = OrderedDict()  # newest accepted generation per transfer id
        self.router_epochs: dict[str, int] = {}  # the newest epoch of each router place (RouterEpoch.router)
        # each router connection's place, as its RouterEpoch said; a connection is forgotten once another of its place
        # has said its epoch (a router holds one connection to us: the one before is gone)
        self.router_places: dict[bytes, str] = {}
        self.writer_counters: dict[int, dict[str, int]] = {}  # last WriterStats per rank
        self._stats_waiting: list[Peer] = []  # routers waiting for a Stats
        self._stats_fresh: set[int] = set()
        self._stats_asked = 0.0
        # /metrics under vLLM's names (the shell serves them): labelled with the first served name
        self.metrics = InstanceMetrics((cfg.served_names() or (cfg.model.name,))[0], inst.engine_id, self.role,
                                       cfg.max_model_len or cfg.model.max_position)

    # -- role hooks -----------------------------------------------------------------
    def _check_leg(self, msg: m.Generate) -> Optional[tuple[str, int]]:
        """Role-specific refusal (reason, HTTP status) of a new request, or None."""
        return None

    def _admitted(self, r: Request) -> None:
        raise NotImplementedError

    def _prefilled(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        raise NotImplementedError

    def _kv_done(self, r: Request, answers: dict[int, WriterAnswer]) -> None:
        raise NotImplementedError

    def _chunk_done(self, r: Request) -> None:
        """A prefill chunk ended and more of the prompt is left (``r.prefilled`` tokens are in)."""

    def _streaming(self, batch: Batch) -> tuple[m.StreamKV, ...]:
        """Prompts of this step whose layer groups the worker marks for the writers as stored."""
        return ()

    def _step_work(self, r: Request, w: m.SeqWork) -> m.SeqWork:
        """What the workers get for ``r`` this step (P: asks for the KV's checksums)."""
        return w

    def _engine_blocked(self) -> bool:
        """True while no step may run and nothing may be admitted (D, pull inline: a READ)."""
        return False

    def _forget(self, r: Request) -> None:
        """The request is released: drop any role state that names it."""

    def _reuses_prefix(self, r: Request) -> bool:
        """May the request take cached blocks for its prompt's prefix (computing only the rest)?"""
        return True

    def _hit_unit(self) -> int:
        """A prefix hit is a whole number of these tokens (a multiple of the block size)."""
        return self.inst.block_size

    def _indexes(self, r: Request) -> bool:
        """May the request's blocks be offered to the prefix cache once their KV is complete?"""
        return True

    def _chunkwise(self, r: Request) -> bool:
        """Does ``r`` take its prefill's blocks chunk by chunk, as each step computes them (vLLM's ``allocate_slots``
        for the tokens scheduled), preempted by recompute where none is free? Else it takes them all at admission: D's
        legs whose KV moves (registered or read whole at admission), P's streamed push (the writers hold its blocks
        from its first chunk, so they could not be given back)."""
        return True

    # -- entry points -------------------------------------------------------------------
    def handles(self, typ: type) -> bool:
        return self._handler(typ) is not None

    def _handler(self, typ: type) -> Optional[Callable[[Any, Peer], None]]:
        return handler_for(self, self._handlers, typ)

    def handle(self, msg: Any, frm: Peer, now: float, wall: float) -> None:
        """Act on one decoded message from ``frm``; what to send lands in ``outbox``."""
        h = self._handler(type(msg))
        if h is None:
            raise TypeError(f"{self.name} has no handler for {type(msg).__name__} (from {frm})")
        self.now, self.wall = now, wall
        h(msg, frm)

    def tick(self, now: float, wall: float) -> None:
        """Deadlines: a writer slow to answer GetStats, a step that never ends."""
        self.now, self.wall = now, wall
        self.metrics.expire(now)  # ends the router's word on never came
        if self._stats_waiting and now - self._stats_asked > WRITER_STATS_WAIT_S:
            stats.answer(self)  # a writer that does not answer must not hold the router's scrape
        if self.step is not None and now - self.step_started > self.cfg.timeouts.step_s:
            batch, self.step = self.step, None
            self.counters["step_timeout"] += 1
            # each request's table apart: requests over one cached prefix hold its blocks once each
            held: list[list[int]] = []
            for r, _ in batch:  # each fails now; its blocks wait for the step's late answers (``late_step_answer``)
                r.in_step = False
                if r.blocks:
                    held.append(r.blocks)
                r.blocks = []
                if r.aborted:  # aborted, or failed already (its stream ended mid-step): told, nothing more to say
                    self._release(r)
                else:
                    self._fail(r, f"forward step exceeded {self.cfg.timeouts.step_s:.0f}s (worker dead or hung)", 503)
            if held:  # (some rank has not answered: a step every rank answered ended in step_answers.take)
                self.late_steps[self.step_id] = (held, set(self.step_answers))  # those that did will not again
                self.counters["late_step_blocks_held"] += sum(map(len, held))
            self.schedule()

    def late_step_answer(self, step_id: int, rank: int) -> bool:
        """A rank's answer to a step that timed out (``tick``): once every rank has answered, no worker can touch
        its blocks any more and they are freed. False: no such step is held (a stale answer)."""
        held = self.late_steps.get(step_id)
        if held is None:
            return False
        tables, ranks = held
        ranks.add(rank)
        if len(ranks) == len(self.workers):
            del self.late_steps[step_id]
            for blocks in tables:  # one reference of each request's
                self.alloc.free(blocks)
            self.counters["late_step_blocks_freed"] += sum(map(len, tables))
            self.schedule()
        return True

    def compiled(self, done: GrammarCompiled, now: float, wall: float) -> None:
        """A grammar asked for (``CompileGrammar``) compiled off the loop, or failed (``grammar_wait``)."""
        grammar_wait.compiled(self, done, now, wall)

    def shutdown(self, reason: str = "") -> None:
        """The process stops: every request still here is refused (503), never silently lost."""
        why = f"scheduler shutting down ({reason})" if reason else "scheduler shutting down"
        for r in list(self.reqs.values()):
            self._reply(r, m.RequestFailed(r.transfer_id, r.generation, why, 503))

    def publish_metrics(self) -> None:
        """Hand /metrics a snapshot of the queue, the running requests and the pool (the shell
        calls it after each entry point; the scrape runs on another thread)."""
        waiting = sum(1 for r in self.reqs.values() if r.state in (State.GRAMMAR, State.WAITING, State.AWAIT_KV))
        running = len(self.running_now())
        waiting += self._running() - running  # (D: KV in, waiting for one of --max-num-seqs to end)
        total = self.alloc.num_blocks
        usage = (total - self.alloc.num_free) / total if total else 0.0
        counters = dict(self.counters)
        counters["prefix_evictions"] = self.alloc.evictions
        self.metrics.publish(Snapshot(waiting, running, usage, total, counters, lora_table.snapshot(self)))

    def take_outbox(self) -> list[Effect]:
        """What the calls so far asked for, in order; the outbox is empty after."""
        out, self.outbox = self.outbox, []
        return out

    # -- refusals: every request the scheduler will not act on is answered here --------
    def refuse_undecodable(self, frm: Peer, reason: str, payload: bytes = b"") -> None:
        """Answer an undecodable request, naming its transfer id when it is readable."""
        tid, gen = readable_head(payload)
        self._send(frm, m.RequestFailed(tid, gen, f"undecodable message: {reason}", 400))

    def _refusal(self, msg: m.Generate) -> Optional[tuple[str, int]]:
        """Why a new request is refused (reason, HTTP status), or None: malformed, another role's,
        refused by this role, a duplicate or stale generation, larger than the whole pool."""
        if msg.leg != self.role:
            return f"{self.role} instance cannot serve a {msg.leg!r} leg", 400
        why = check_generate(msg, self.vocab, self.max_len, self.max_stop_ids)  # every value a step acts on
        if why is not None:
            return why, 400
        if self.lora.slot(msg.lora) < 0:
            return f"LoRA adapter {msg.lora!r} is not served here (adapters: {list(self.lora.names)})", 404
        err = self._check_leg(msg)
        if err is not None:
            return err
        tid, gen = msg.transfer_id, msg.generation
        seen = self.newest.get(tid)
        if seen is not None and gen <= seen:
            what = "duplicate" if gen == seen else "stale generation for"
            return f"{what} transfer id {tid} (generation {gen}; newest {seen})", 409
        old = self.by_tid.get(tid)
        if old is not None and old.generation >= gen:
            return f"duplicate transfer id {tid} (generation {gen})", 409
        need = blocks_needed(msg.leg, len(msg.prompt_token_ids), msg.max_tokens, self.inst.block_size)
        if need > self.alloc.num_blocks:
            return f"request needs {need} KV blocks; the {self.role} pool has {self.alloc.num_blocks}", 413
        return None

    # -- helpers --------------------------------------------------------------------
    def _send(self, to: Peer, msg: m.Msg) -> None:
        self.outbox.append(Send(to, msg))

    def _reply(self, r: Request, msg: m.Msg) -> None:
        self._send(Peer.router(r.identity), msg)

    def _to_workers(self, msg: m.Msg) -> None:
        for w in self.workers:
            self._send(w, msg)

    def _to_writers(self, msg: m.Msg) -> None:
        for w in self.writers:
            self._send(w, msg)

    def _stamp(self, r: Request, stage: str) -> None:
        r.timeline[stage] = self.wall
        self.outbox.append(Trace(stage, r.transfer_id))

    def _count_kv(self, r: Request) -> None:
        self.counters["kv_bytes"] += r.kv.nbytes
        self.counters["kv_descs"] += r.kv.num_descs
        self.counters["kv_transfer_us"] += int(r.kv.transfer_s * 1e6)

    def _release(self, r: Request) -> None:
        """The request is over: free its blocks exactly once and forget it."""
        if self._pinned_by_writers(r):  # failed on our side mid-stream (a step timed out): end the stream
            self._to_writers(m.CancelKV(r.transfer_id, r.generation, "request failed while streaming"))
            r.streamed = False
        if r.blocks:
            self.alloc.free(r.blocks)
            r.blocks = []
        grammar_wait.unhold(self, r)
        r.state = State.DONE
        self.reqs.pop(r.key, None)
        if self.by_tid.get(r.transfer_id) is r:
            del self.by_tid[r.transfer_id]
        if r in self.waiting:
            self.waiting.remove(r)
        self._forget(r)
        lora_table.sweep(self)

    def _fail(self, r: Request, reason: str, status: int = 500) -> None:
        self._failed(r, reason, status)
        self._release(r)

    def _failed(self, r: Request, reason: str, status: int) -> None:
        """The request failed: counted, logged and told; its blocks are the caller's to free (now, or once no
        worker can still touch them)."""
        self.counters["requests_failed"] += 1
        self._observe_finish(r, "error")  # as vLLM's engine ends a request it fails (a KV load's failure)
        log.warning("%s: request failed: %s transfer_id=%s", self.name, reason, r.transfer_id)
        self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, status))

    # -- from the router --------------------------------------------------------------
    def _note_generation(self, r: Request) -> None:
        self.newest[r.transfer_id] = r.generation
        self.newest.move_to_end(r.transfer_id)
        if len(self.newest) > REMEMBER_IDS:
            self.newest.popitem(last=False)

    def on_Generate(self, msg: m.Generate, frm: Peer) -> None:
        err = self._refusal(msg)
        grammar = None
        if err is None and msg.structured is not None:  # compiled here already for this model's tokenizer: at once
            try:
                grammar = self.grammars.matcher(msg.structured)
            except Exception as e:  # a matcher xgrammar could not make of it
                err = (failure(e), 400)
        if err is not None:
            self.counters["rejected"] += 1
            self._send(frm, m.RequestFailed(msg.transfer_id, msg.generation, *err))
            return
        old = self.by_tid.get(msg.transfer_id)
        if old is not None:  # reissue: the new generation replaces the old
            self.counters["reissued"] += 1
            self._abort(old, f"superseded by generation {msg.generation}", notify=True)
        r = Request(msg.transfer_id, msg.generation, msg.leg, msg.prompt_token_ids, msg.max_tokens, frm.identity,
                    frozenset(msg.stop_token_ids), msg.source, msg.pull, seq_id=self.next_seq,
                    sampling=msg.sampling, late=msg.late, prefill_here=msg.prefill_here, cache_salt=msg.cache_salt,
                    grammar=grammar, structured=msg.structured, lora=msg.lora, lora_slot=self.lora.slot(msg.lora),
                    lora_id=self.lora.lora_id(msg.lora), stop_strings=msg.stop_strings)
        self.next_seq += 1
        if msg.arrival:
            r.timeline["arrival"] = msg.arrival
        r.queued_at = self.now
        self._stamp(r, f"{self.role}_queued")
        self.reqs[r.key] = r
        self.by_tid[r.transfer_id] = r
        self._note_generation(r)
        if r.structured is not None and grammar is None:
            grammar_wait.hold(self, r)
        else:
            self.waiting.append(r)
        self.counters["requests"] += 1
        self.schedule()

    def on_Abort(self, msg: m.Abort, frm: Peer) -> None:
        key = (msg.transfer_id, msg.generation)
        # a stop string matched before the last token reached the router, while the leg ended here by length: its
        # held end is counted as the client's choice ended (the router drops the leg's last message, never says more)
        held = bool(msg.finish) and self.metrics.choice_ended(key, msg.finish)
        r = self.reqs.get(key)
        if r is None:
            if not held:
                self.counters["abort_unknown"] += 1
            return
        self.counters["aborted"] += 1
        if msg.finish:  # complete at the router (a stop string): its end is counted as vLLM's frontend counts it
            self._observe_finish(r, msg.finish)
        elif self.role == "prefill" and r.output:  # P's one token is out: vLLM's P (max_tokens=1) has ended
            self._observe_finish(r, "length")
        self._abort(r, msg.reason, notify=False)

    def _abort(self, r: Request, reason: str, notify: bool) -> None:
        if notify:
            self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, 499))
        if r.in_step or r.state in (State.SENDING, State.AWAIT_KV, State.VERIFY) or self._pinned_by_writers(r):
            # blocks stay ours until the step ends / every writer confirms nothing can still read or write them /
            # every worker has checked them (D, --kv-verify: ``on_KVVerified`` frees them)
            r.aborted = reason
            if (not r.in_step and r.state != State.VERIFY) or self._pinned_by_writers(r):
                self._to_writers(m.CancelKV(r.transfer_id, r.generation, reason))
            return
        self._release(r)
        self.schedule()

    def on_ChoiceEnded(self, msg: m.ChoiceEnded, frm: Peer) -> None:
        """How the client's choice ended, for a leg that ended by length while the router searched its text for stop
        strings (``_observe_finish`` held its end): counted so now."""
        if not self.metrics.choice_ended((msg.transfer_id, msg.generation), msg.finish):
            self.counters["choice_end_unknown"] += 1  # (held past its wait, or its instance restarted)

    def on_RouterEpoch(self, msg: m.RouterEpoch, frm: Peer) -> None:
        """A router (re)started at its place: the requests any other connection of that place sent are orphans
        (their client's connection went with the router before), so they are aborted and their blocks freed now, not
        after decoding to max_tokens. A router at another place is another router, alive (a second replica, or a
        rolling update's old pod, draining): its requests are left alone. An older epoch than the place's is a router
        that was replaced. A connection that has not said its place yet (a router's queued requests reach a
        restarted scheduler ahead of its epoch said again, ``again``) is no orphan."""
        place = msg.router
        known = self.router_epochs.get(place, 0)
        if msg.again:
            log.info("%s: router epoch %d said again from %s (the router linked anew)", self.name, msg.epoch,
                     place or "its place")
        if msg.epoch < known:  # (its connection keeps its place)
            self.router_places[frm.identity] = place
            self.counters["router_epoch_stale"] += 1
            log.warning("%s: router epoch %d is older than %d: ignored", self.name, msg.epoch, known)
            return
        if msg.epoch == known:  # the same router on a new connection (it linked again): the one before is gone
            self._forget_router_connections(place, frm.identity, idle_only=True)
            self.router_places[frm.identity] = place
            return
        self.router_places[frm.identity] = place
        first = known == 0
        self.router_epochs[place] = msg.epoch

        def gone(identity: bytes) -> bool:  # a connection of the router before, at this place
            # a connection of no place is not taken for one: every router says its epoch first on each connection,
            # so one of no place is a router whose epoch said again (we restarted) comes after what it queued
            return identity != frm.identity and self.router_places.get(identity) == place

        # the router that would have said how its held ends ended is gone; a router elsewhere still will
        self.metrics.expire(self.now, gone)
        # the queued first, so that freeing blocks admits none of them
        orphans = sorted((r for r in self.reqs.values() if gone(r.identity) and not r.aborted),
                         key=lambda r: r.state not in (State.GRAMMAR, State.WAITING))
        if orphans or not first:
            log.warning("%s: router epoch %d: aborting %d request(s) of the router before", self.name, msg.epoch,
                        len(orphans))
        for r in orphans:
            self.counters["router_epoch_aborted"] += 1
            self._abort(r, "router restarted (a new epoch)", notify=False)
        self._forget_router_connections(place, frm.identity)  # (their requests aborted, their held ends observed)

    def _forget_router_connections(self, place: str, keep: bytes, idle_only: bool = False) -> None:
        """Forget the place of each router connection at ``place`` but ``keep`` (gone: that router's connection to
        us is ``keep`` now), so that ``router_places`` holds no connection of a router that restarted or linked
        again. ``idle_only``: only those holding no request and no held end (the same router's connection before,
        whose requests were not aborted: they keep its place)."""
        busy = {r.identity for r in self.reqs.values()} | self.metrics.held_routers() if idle_only else set()
        for identity in [i for i, p in self.router_places.items() if p == place and i != keep and i not in busy]:
            del self.router_places[identity]

    def on_PeerLost(self, msg: m.PeerLost, frm: Peer) -> None:
        """The router's news of a peer instance gone (or back as a new incarnation): our
        writers end their transfers with it now, not at their deadlines."""
        self.counters["peer_lost"] += 1
        log.warning("%s: %s instance %s lost: %s", self.name, msg.role, msg.engine_id, msg.reason)
        self._to_writers(msg)

    def on_GetStats(self, msg: m.GetStats, frm: Peer) -> None:
        stats.asked(self, msg, frm)

    def on_WriterStats(self, msg: m.WriterStats, frm: Peer) -> None:
        stats.writer_said(self, msg, frm)

    def on_LoadLora(self, msg: m.LoadLora, frm: Peer) -> None:
        lora_table.load(self, msg, frm)

    def on_UnloadLora(self, msg: m.UnloadLora, frm: Peer) -> None:
        lora_table.unload(self, msg, frm)

    def on_LoraChanged(self, msg: m.LoraChanged, frm: Peer) -> None:
        lora_table.answered(self, msg, frm)

    def on_ResetPrefixCache(self, msg: m.ResetPrefixCache, frm: Peer) -> None:
        """Forget every cached prefix (running requests keep their blocks, and index none of them from now where
        their chain's head was forgotten: ``Request.unchained``), then answer as GetStats is answered."""
        self.counters["prefix_resets"] += 1
        self.counters["prefix_reset_blocks"] += self.alloc.reset()
        for r in self.reqs.values():
            r.unchained = r.unchained or r.indexed > 0
        stats.asked(self, m.GetStats(), frm)

    # -- prefix cache (scheduler/prefix.py) ---------------------------------------------------
    def _index_blocks(self, r: Request, upto: int) -> None:
        if self.alloc.enabled and self._indexes(r) and not r.unchained:
            index_blocks(self.alloc, r, upto, self.inst.block_size)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> None:
        # as vLLM's v1 scheduler: the running requests get the blocks their next step needs first (preempting where
        # none is free), and only a pass that preempted none admits from the queue
        # (a prompt computed chunk by chunk is admitted only into a step being built: its first chunk's blocks and
        # share of the token budget are that step's, as vLLM admits from waiting only while its token budget lasts)
        launch = self.step is None and not self._engine_blocked()
        preempted = launch and preempt.grow(self)
        if not preempted:
            self._admit(launch)
        if launch:
            self._launch_step()
            if preempted and self.step is None:  # nothing left to run: no step's end would admit the queue's head
                self._admit(True)
                self._launch_step()

    def _running_full(self) -> bool:
        """vLLM's max_num_seqs bounds the requests running, not only a step's sequences: where as many compute here
        already (a prompt or its decode; P's sent ones and D's that wait for their KV do not), one more waits in the
        queue, and its queue time runs on. D admits on, since its early registration is what push is; its steps still
        take at most that many, in the order their KV landed, and the rest count as waiting (``running_now``)."""
        return self.role != "decode" and self._running() >= self.inst.max_num_seqs

    def _running(self) -> int:
        """Requests that compute here: a prompt, its decode, or (D) its KV's check (``running_now``: the ones
        vllm:num_requests_running counts, at most --max-num-seqs)."""
        return sum(1 for r in self.reqs.values() if r.state in (State.PREFILL, State.RUNNING, State.VERIFY))

    def running_now(self) -> list[Request]:
        """The requests vllm:num_requests_running counts: those that compute here (``_running``), at most
        --max-num-seqs, in running order. Only D ever has more (it admits on): the later ones' KV has landed and they
        wait for a step to take them, as vLLM's D keeps such requests waiting until its running list has room."""
        computing = [r for r in self.reqs.values() if r.state in (State.PREFILL, State.RUNNING, State.VERIFY)]
        if len(computing) <= self.inst.max_num_seqs:
            return computing
        return sorted(computing, key=lambda r: r.admit_seq)[:self.inst.max_num_seqs]

    def _admit(self, launch: bool) -> None:
        """Admit from the queue's head (FIFO) what the blocks allow. A prompt computed chunk by chunk
        (``_chunkwise``) only while a step is being built (``launch``) and its token budget and --max-num-seqs have
        room after the running ones (``step_plan``), as vLLM's: its whole prefill must fit the blocks free
        (``scheduler_reserve_full_isl``, vLLM's default) and the watermark, but it takes only its first chunk's
        (``preempt.grow`` gives it the rest as its chunks run). Any other leg takes its blocks whole at once."""
        plan = self.step_plan() if launch else []
        budget = self.inst.max_batch_tokens - sum(n for _, n in plan)
        seqs = len(plan)
        loras = {r.lora_slot for r, _ in plan if r.lora_slot}
        bs = self.inst.block_size
        i = 0
        while i < len(self.waiting) and not self._engine_blocked() and not self._running_full():
            r = self.waiting[i]
            hits = prefix.hits_for(self, r)
            chunkwise = self._chunkwise(r)
            # while others compute, leave them room to grow (vLLM's watermark), so a new request is not admitted
            # only to be preempted at the next block boundary
            keep = self.watermark if (self.grows or chunkwise) and self._running() else 0
            if chunkwise:
                if not launch or seqs >= self.inst.max_num_seqs or budget <= 0:
                    return  # FIFO: it waits for the next step's room
                bound = self.lora.batch_bound
                if r.lora_slot and bound > 0 and r.lora_slot not in loras and len(loras) >= bound:
                    i += 1  # its adapter would be one too many in this step: the next may go (vLLM skips it too)
                    continue
                n = chunk_tokens(len(r.prefill_ids) - len(hits) * bs, budget, self.inst.prefill_chunk, not seqs)
                if n <= 0 or not self.alloc.can_acquire(hits, blocks_for(len(r.prefill_ids), bs), keep):
                    return  # FIFO: wait for the budget, or for blocks to free
                blocks = self.alloc.acquire(hits, blocks_for(len(hits) * bs + n, bs))
                budget -= n
                seqs += 1
                if r.lora_slot:
                    loras.add(r.lora_slot)
            else:
                need = r.blocks_to_admit(bs)
                if not self.alloc.can_acquire(hits, need, keep):
                    return  # FIFO: wait for blocks to free
                blocks = self.alloc.acquire(hits, need)
            assert blocks is not None  # can_acquire
            self.waiting.pop(i)
            r.blocks = blocks
            self._begins_running(r)
            prefix.took_hits(self, r, len(hits))
            if r.preemptions:  # back after a preemption: it computes its prompt and output so far again, here
                r.state = State.PREFILL
                self._stamp(r, f"{self.role}_readmitted")
                continue
            self.metrics.queued(self.now - r.queued_at)
            r.admitted_at = self.now
            self._stamp(r, f"{self.role}_alloc")
            self._admitted(r)

    def _begins_running(self, r: Request) -> None:
        """``r`` joins the requests that run here, last (vLLM's running list): at its admission, or on D when its KV
        has landed. A step takes the decodes in that order, and the last to join is preempted first."""
        r.admit_seq, self.next_admit = self.next_admit, self.next_admit + 1

    def _decoding(self) -> list[Request]:
        """The decoding requests between steps, in the order they began to run here (``Request.admit_seq``: vLLM's
        running list), the order a step takes them in."""
        return sorted((r for r in self.reqs.values() if r.state == State.RUNNING and not r.in_step),
                      key=lambda r: r.admit_seq)

    def _prefilling(self) -> list[Request]:
        """The prompts to compute between steps, in the order they began to run here (vLLM's running list). An
        aborted prefill still here waits for its writers (a streamed chunk may be read): compute no more of it."""
        return sorted((r for r in self.reqs.values() if r.state == State.PREFILL and not r.in_step and not r.aborted),
                      key=lambda r: r.admit_seq)

    def step_plan(self) -> list[tuple[Request, int]]:
        """What the next step computes of the running requests, as (request, tokens): the decodes first, then the
        prompts' chunks, within --max-num-seqs, --max-batch-tokens (every token counts) and --max-loras."""
        return plan_step(self._prefilling(), self._decoding(), self.inst.max_num_seqs, self.inst.max_batch_tokens,
                         self.inst.prefill_chunk, self.lora.batch_bound)

    def step_decodes(self) -> list[Request]:
        """The decoding requests the next step takes (at most --max-num-seqs and --max-batch-tokens, of at most
        --max-loras adapters)."""
        return [r for r, _ in self.step_plan() if r.state == State.RUNNING]

    def _launch_step(self) -> None:
        bs = self.inst.block_size
        # each has the blocks its tokens need (``preempt.grow``, admission): one that could get none (every other
        # block held by what cannot give it back yet) waits for a later step
        plan = [(r, n) for r, n in self.step_plan() if r.blocks_short(bs, n) <= 0]
        if not plan:
            return
        prompts = sum(1 for r, _ in plan if r.state == State.PREFILL)  # (the most prompts one step computed)
        if prompts > self.counters["prefills_in_step_max"]:
            self.counters["prefills_in_step_max"] = prompts
        batch = [(r, self._step_work(r, w)) for r, w in works_of(plan)]
        self.step_id += 1
        self.step = batch
        self.step_answers = {}
        self.step_started = self.now
        count_work(batch)
        self.metrics.step(sum(len(w.token_ids) for _, w in batch))
        for r, w in batch:
            r.in_step = True
            if w.start_pos == r.cached and r.state == State.PREFILL and not r.preemptions:
                self._stamp(r, "prefill_start")
        self._to_workers(m.ExecuteStep(self.step_id, tuple(w for _, w in batch), self._streaming(batch)))

    # -- from the workers ----------------------------------------------------------------
    def on_StepDone(self, msg: m.StepDone, frm: Peer) -> None:
        step_answers.take(self, msg, frm)

    def on_StepFailed(self, msg: m.StepFailed, frm: Peer) -> None:
        step_answers.take(self, msg, frm)

    def _after_step(self, r: Request, w: m.SeqWork, tok: Optional[int],
                    lp: Optional[m.TokenLogprob] = None) -> None:
        if r.aborted:
            if not self._pinned_by_writers(r):
                self._release(r)
            return
        if r.state == State.PREFILL:
            r.prefilled = w.start_pos + len(w.token_ids)
            self._index_blocks(r, r.prefilled)  # the step ended: these blocks' KV is complete
            if r.prefilled < len(r.prefill_ids):
                self._chunk_done(r)
                return
            if r.recompute:  # a preempted request's prompt and output are back: its token is a decode's
                self._stamp(r, "recompute_end")
                self._emit(r, tok, lp)  # type: ignore[arg-type]  # the last chunk always samples
                return
            self._stamp(r, "prefill_end")
            if r.score_prompt >= 0 and not step_answers.joined_scores(self, r):
                return
            self._prefilled(r, tok, lp)  # type: ignore[arg-type]  # the last chunk always samples
        else:
            self._emit(r, tok, lp)  # type: ignore[arg-type]  # a decode step always samples

    def _pinned_by_writers(self, r: Request) -> bool:
        """A streamed prefill's blocks stay ours until every writer rank answered (a WRITE
        of an earlier chunk may still read them)."""
        return r.streamed and r.state == State.PREFILL

    def _first_token(self, r: Request) -> None:
        """This instance produced ``r``'s first token (P: its prefill's; D: the one it sends first)."""
        r.last_token_at = r.first_at = self.now
        # a D leg computes none of its prompt (unless it prefills it itself): what its prefix cache lacked came by
        # transfer
        moved = len(r.prompt) - r.cached if r.leg == "decode" and not r.prefill_here else 0
        self.metrics.first_token(len(r.prompt), self.now - r.queued_at, r.cached, moved)

    def _first_sent(self, r: Request) -> None:
        """``r``'s first token goes to the client now: stamped and measured (D sends P's early
        under --kv-verify, through ``_emit`` otherwise)."""
        self._stamp(r, "first_token")
        self._first_token(r)

    def _observe_finish(self, r: Request, reason: EndReason) -> None:
        """``r``'s end here, in vllm:request_success_total and the per-request histograms: once per request."""
        if r.counted:
            return
        r.counted = True
        admitted, first = r.admitted_at or r.queued_at, r.first_at or self.now
        f = Finish(reason, len(r.prompt), len(r.output), r.max_tokens, self.now - r.queued_at, first - admitted,
                   self.now - first, r.preemptions)
        if reason == "length" and r.stop_strings:  # a stop string may match on its last token: the router says
            self.metrics.hold(r.key, f, self.now + self.cfg.timeouts.request_s, r.identity)
        else:
            self.metrics.finished(f)

    def _emit(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        r.output.append(tok)
        self._index_blocks(r, r.num_tokens)  # the prompt's KV (and the output's so far) is in the pool
        if len(r.output) == 1:
            self._first_sent(r)
        else:
            self.metrics.token(self.now - r.last_token_at)
            r.last_token_at = self.now
        reason = r.finished()
        lps = (lp,) if lp is not None else ()
        # where the prompt was computed here, its logprobs go with the first token
        prompt = r.prompt_logprobs if len(r.output) == 1 else None
        if reason:
            self._stamp(r, "finished")
            self.counters["requests_completed"] += 1
            self._observe_finish(r, reason)
            steps, seqs, ctx, pre = r.decode_work
            self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (tok,), True, reason, len(r.prompt),
                                             r.sorted_timeline(), r.kv_stats(), lps, r.cached,
                                             steps, seqs, ctx, pre, prompt))
            self._release(r)
        else:
            r.state = State.RUNNING
            # the first token says the prefix-cache hits too: a choice a stop string ends here gets no finish
            self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (tok,), logprobs=lps, prompt_logprobs=prompt,
                                             cached_tokens=r.cached if len(r.output) == 1 else 0))

    # -- from the writers (scheduler/writer_answers.py) -------------------------------------
    def on_KVSent(self, msg: m.KVSent, frm: Peer) -> None:
        writer_answers.take(self, msg, frm)

    def on_KVReceived(self, msg: m.KVReceived, frm: Peer) -> None:
        writer_answers.take(self, msg, frm)

    def on_KVFailed(self, msg: m.KVFailed, frm: Peer) -> None:
        writer_answers.take(self, msg, frm)
