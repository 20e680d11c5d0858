"""The scheduler core shared by every role: admission, block allocation,
continuous batching, request state, deadlines. Never touches KV bytes: workers
compute into the pool, writers move it.

What differs by role lives in one subclass each (``PrefillScheduler``,
``DecodeScheduler``, ``LocalScheduler``), behind four hooks:

- ``_check_leg(msg)``: role-specific validation of a new request;
- ``_admitted(r)``: blocks are reserved; what happens next (prefill, or wait for KV);
- ``_prefilled(r, tok, lp)``: the prefill step ended with first token ``tok`` (and its logprob, if asked);
- ``_kv_done(r, answers)``: every writer rank answered the request's transfer with success.

``scheduler_for(cfg, inst)`` in ``pushkv.scheduler`` picks the class.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Optional, Union

import msgspec
import zmq

from pushkv import faults
from pushkv import limits
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.protocol.prefix_cache import ROOT_HASH, PrefixCache, block_hashes
from pushkv.kv import checksum
from pushkv.scheduler.requests import Request, State, build_batch
from pushkv.scheduler.validate import check_generate

log = logging.getLogger(__name__)

WRITER_STATS_WAIT_S = 0.25  # GetStats: how long to wait for the writers' counters before answering
REMEMBER_IDS = 65536  # transfer ids whose newest generation is kept, to refuse duplicates and stale reissues

WriterAnswer = Union[m.KVSent, m.KVReceived, m.KVFailed]


class SchedulerCore(Actor):
    role = ""  # set by each role's class
    writer_answers: tuple[type, ...] = (m.KVSent, m.KVReceived, m.KVFailed)  # what this role's writers answer

    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig):
        if inst.role != self.role:
            raise ValueError(f"{type(self).__name__} serves {self.role!r} instances, not {inst.role!r}")
        super().__init__(f"{inst.name}-scheduler", cfg.control_endpoint, cfg.trace_endpoint, cfg.secret_file,
                         limits.msg_cap_bytes(cfg))
        self.cfg = cfg
        self.inst = inst
        # ref-counted blocks with a prefix-hash index; with the cache off, a plain allocator
        self.alloc = PrefixCache(inst.num_blocks, inst.prefix_cache)
        self.reqs: dict[tuple[str, int], Request] = {}
        self.by_tid: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.next_seq = 1
        self.step_id = 0
        self.step: Optional[list[tuple[Request, m.SeqWork]]] = None
        self.step_started = 0.0
        self.step_answers: dict[int, m.Msg] = {}
        self.max_len = cfg.max_model_len or cfg.model.max_position
        self.vocab = cfg.model.vocab_size
        self.max_stop_ids = limits.stop_ids_bound(cfg)
        self.newest: OrderedDict[str, int] = OrderedDict()  # newest accepted generation per transfer id
        self.writer_counters: dict[int, dict[str, int]] = {}  # last WriterStats per rank
        self._stats_waiting: list[bytes] = []  # router identities waiting for a Stats
        self._stats_fresh: set[int] = set()
        self._stats_asked = 0.0

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

    def _streaming(self, batch: list[tuple[Request, m.SeqWork]]) -> tuple[m.StreamKV, ...]:
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

    # -- lifecycle ---------------------------------------------------------------
    def setup(self) -> None:
        # what reaches us from outside: the router's Generate, at most the largest legal one (x2)
        front = self.socket(zmq.ROUTER, self.inst.sched_endpoint, bind=True, max_msg_bytes=limits.generate_cap_bytes(self.cfg))
        self.front = self.add_channel(front, m.DEC_ROUTER_TO_SCHED, "router", routed=True)
        self.workers = []
        for r, ep in enumerate(self.inst.worker_endpoints):
            ch = self.add_channel(self.socket(zmq.DEALER, ep, bind=False), m.DEC_WORKER_TO_SCHED, f"{self.inst.name}-worker-{r}")
            ch.index = r
            self.workers.append(ch)
        self.writers = []
        for r, ep in enumerate(self.inst.writer_endpoints):
            ch = self.add_channel(self.socket(zmq.DEALER, ep, bind=False), m.DEC_WRITER_TO_SCHED, f"{self.inst.name}-writer-{r}")
            ch.index = r
            self.writers.append(ch)

    def teardown(self) -> None:
        for r in list(self.reqs.values()):
            reason = f"scheduler shutting down ({self.stop_reason})" if self.stop_reason else "scheduler shutting down"
            self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, 503))

    # -- helpers --------------------------------------------------------------------
    def _reply(self, r: Request, msg: m.Msg) -> None:
        self.send(self.front, msg, r.identity)

    def _stamp(self, r: Request, stage: str) -> None:
        r.timeline[stage] = time.time()
        self.trace_event(stage, r.transfer_id)

    def _kv_stats(self, r: Request) -> Optional[m.KVTransferStats]:
        kv = r.kv
        if r.leg == "local" or not kv.nbytes:
            return None
        return m.KVTransferStats(kv.nbytes, kv.num_descs, kv.transfer_s, r.rendezvous or ("pull" if r.pull is not None else ""),
                                 r.reserved_block_s, len(r.blocks) if r.reserved_block_s else 0, kv.parts, kv.stream)

    def _count_kv(self, r: Request) -> None:
        self.counters["kv_bytes"] += r.kv.nbytes
        self.counters["kv_descs"] += r.kv.num_descs
        self.counters["kv_transfer_us"] += int(r.kv.transfer_s * 1e6)

    def _timeline(self, r: Request) -> tuple[tuple[str, float], ...]:
        return tuple(sorted(r.timeline.items(), key=lambda kv: kv[1]))

    def _release(self, r: Request) -> None:
        """The request is over: free its blocks exactly once and forget it."""
        if self._pinned_by_writers(r):  # failed on our side mid-stream (a step timed out): end the stream
            self._to_writers(m.CancelKV(r.transfer_id, r.generation, "request failed while streaming"))
            r.streamed = False
        if r.blocks:
            self.alloc.free(r.blocks)
            r.blocks = []
        r.state = State.DONE
        self.reqs.pop(r.key, None)
        if self.by_tid.get(r.transfer_id) is r:
            del self.by_tid[r.transfer_id]
        if r in self.waiting:
            self.waiting.remove(r)
        self._forget(r)

    def _fail(self, r: Request, reason: str, status: int = 500) -> None:
        self.counters["requests_failed"] += 1
        log.warning("%s: request failed: %s transfer_id=%s", self.name, reason, r.transfer_id)
        self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, status))
        self._release(r)

    def _to_writers(self, msg: m.Msg) -> None:
        for ch in self.writers:
            self.send(ch, msg)

    # -- from the router --------------------------------------------------------------
    def _validate(self, msg: m.Generate) -> Optional[tuple[str, int]]:
        if msg.leg != self.role:
            return f"{self.role} instance cannot serve a {msg.leg!r} leg", 400
        why = check_generate(msg, self.vocab, self.max_len, self.max_stop_ids)  # every value a step acts on
        if why is not None:
            return why, 400
        err = self._check_leg(msg)
        if err is not None:
            return err
        seen = self.newest.get(msg.transfer_id)
        if seen is not None and msg.generation <= seen:
            what = "duplicate" if msg.generation == seen else "stale generation for"
            return f"{what} transfer id {msg.transfer_id} (generation {msg.generation}; newest {seen})", 409
        return None

    def _note_generation(self, r: Request) -> None:
        self.newest[r.transfer_id] = r.generation
        self.newest.move_to_end(r.transfer_id)
        if len(self.newest) > REMEMBER_IDS:
            self.newest.popitem(last=False)

    def on_bad_frame(self, ch, identity, reason: str, payload: bytes = b"") -> None:
        """Answer an undecodable request, naming its transfer id when it is readable."""
        if ch is not self.front or identity is None:
            return
        tid, gen = "", 0
        try:
            head = msgspec.msgpack.decode(payload)
            if isinstance(head, list) and len(head) >= 2 and isinstance(head[1], str):
                tid = head[1]
                gen = head[2] if len(head) >= 3 and type(head[2]) is int else 0
        except (msgspec.DecodeError, RecursionError):
            pass
        self.send(self.front, m.RequestFailed(tid, gen, f"undecodable message: {reason}", 400), identity)

    def on_Generate(self, msg: m.Generate, identity: bytes) -> None:
        err = self._validate(msg)
        if err is None:
            old = self.by_tid.get(msg.transfer_id)
            if old is not None and old.generation >= msg.generation:
                err = (f"duplicate transfer id {msg.transfer_id} (generation {msg.generation})", 409)
            elif old is not None:  # reissue: the new generation replaces the old
                self.counters["reissued"] += 1
                self._abort(old, f"superseded by generation {msg.generation}", notify=True)
        if err is not None:
            self.counters["rejected"] += 1
            self.send(self.front, m.RequestFailed(msg.transfer_id, msg.generation, err[0], err[1]), identity)
            return
        r = Request(msg.transfer_id, msg.generation, msg.leg, msg.prompt_token_ids, msg.max_tokens, identity,
                    frozenset(msg.stop_token_ids), msg.source, msg.pull, seq_id=self.next_seq,
                    sampling=msg.sampling, late=msg.late, prefill_here=msg.prefill_here)
        self.next_seq += 1
        need = r.blocks_needed(self.inst.block_size)
        if need > self.alloc.num_blocks:
            self.counters["rejected"] += 1
            self.send(self.front, m.RequestFailed(msg.transfer_id, msg.generation,
                      f"request needs {need} KV blocks; the {self.role} pool has {self.alloc.num_blocks}", 413), identity)
            return
        if msg.arrival:
            r.timeline["arrival"] = msg.arrival
        self._stamp(r, f"{self.role}_queued")
        self.reqs[r.key] = r
        self.by_tid[r.transfer_id] = r
        self._note_generation(r)
        self.waiting.append(r)
        self.counters["requests"] += 1
        self.schedule()

    def on_Abort(self, msg: m.Abort, identity: bytes) -> None:
        r = self.reqs.get((msg.transfer_id, msg.generation))
        if r is None:
            self.counters["abort_unknown"] += 1
            return
        self.counters["aborted"] += 1
        self._abort(r, msg.reason, notify=False)

    def _abort(self, r: Request, reason: str, notify: bool) -> None:
        if notify:
            self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, 499))
        if r.in_step or r.state in (State.SENDING, State.AWAIT_KV) or self._pinned_by_writers(r):
            # blocks stay ours until the step ends / every writer confirms nothing
            # can still read or write them
            r.aborted = reason
            if not r.in_step or self._pinned_by_writers(r):
                self._to_writers(m.CancelKV(r.transfer_id, r.generation, reason))
            return
        self._release(r)
        self.schedule()

    def on_PeerLost(self, msg: m.PeerLost, identity: bytes) -> None:
        """The router's news of a peer instance gone (or back as a new incarnation): our
        writers end their transfers with it now, not at their deadlines."""
        self.counters["peer_lost"] += 1
        log.warning("%s: %s instance %s lost: %s", self.name, msg.role, msg.engine_id, msg.reason)
        self._to_writers(msg)

    def on_GetStats(self, msg: m.GetStats, identity: bytes) -> None:
        """Answer with our counters and the writers' (``writer.<rank>.<name>``), asked afresh."""
        self._stats_waiting.append(identity)
        if len(self._stats_waiting) == 1:
            self._stats_asked, self._stats_fresh = time.monotonic(), set()
            self._to_writers(m.GetStats())
        if not self.writers:
            self._answer_stats()

    def on_WriterStats(self, msg: m.WriterStats) -> None:
        self.writer_counters[self.current.index] = dict(msg.counters)
        self._stats_fresh.add(self.current.index)
        if self._stats_waiting and len(self._stats_fresh) >= len(self.writers):
            self._answer_stats()

    def _answer_stats(self) -> None:
        running = sum(1 for r in self.reqs.values() if r.state == State.RUNNING)
        counters = dict(self.counters)
        counters["prefix_evictions"] = self.alloc.evictions
        for rank, wc in self.writer_counters.items():
            counters.update({f"writer.{rank}.{k}": v for k, v in wc.items()})
        stats = m.Stats(self.inst.engine_id, self.role, self.alloc.num_blocks, self.alloc.num_free,
                        running, len(self.waiting), counters, self.alloc.num_cached)
        waiting, self._stats_waiting = self._stats_waiting, []
        for identity in waiting:
            self.send(self.front, stats, identity)

    # -- prefix cache ---------------------------------------------------------------------
    def _prefix_hits(self, r: Request) -> list[int]:
        """Cached blocks of the prompt's longest cached prefix. The last prompt token is always
        computed (its logits give the first token), so a block holding it is never a hit: a step
        then writes only into blocks the request owns alone."""
        if not self.alloc.enabled or not self._reuses_prefix(r):
            return []
        bs, unit = self.inst.block_size, self._hit_unit()
        if not r.hashes:
            r.hashes = block_hashes(r.prompt, bs)
        hits = self.alloc.match(r.hashes[:(len(r.prompt) - 1) // bs])
        return hits[:len(hits) * bs // unit * unit // bs]

    def _count_hits(self, r: Request, hit_blocks: int) -> None:
        r.cached = hit_blocks * self.inst.block_size
        r.prefilled = r.cached
        r.indexed = hit_blocks
        if not self.alloc.enabled or not self._reuses_prefix(r):
            return
        self.counters["prefix_queries"] += 1
        self.counters["prefix_query_tokens"] += len(r.prompt)
        if hit_blocks:
            self.counters["prefix_hits"] += 1
            self.counters["prefix_hit_tokens"] += r.cached

    def _index_blocks(self, r: Request, upto: int) -> None:
        """Offer the request's full blocks below token ``upto`` (KV complete) to the prefix cache."""
        bs = self.inst.block_size
        full = min(upto // bs, len(r.blocks))
        if full <= r.indexed or not self.alloc.enabled or not self._indexes(r):
            return
        if len(r.hashes) < full:
            seq = r.prompt if full * bs <= len(r.prompt) else tuple(r.prompt) + tuple(r.output)
            parent = r.hashes[-1] if r.hashes else ROOT_HASH
            r.hashes.extend(block_hashes(seq[:full * bs], bs, parent, start=len(r.hashes) * bs))
        for i in range(r.indexed, full):
            self.alloc.insert(r.blocks[i], r.hashes[i])
        r.indexed = full

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> None:
        self._admit()
        if self.step is None and not self._engine_blocked():
            self._launch_step()

    def _admit(self) -> None:
        while self.waiting and not self._engine_blocked():
            r = self.waiting[0]
            hits = self._prefix_hits(r)
            blocks = self.alloc.acquire(hits, r.blocks_needed(self.inst.block_size))
            if blocks is None:
                return  # FIFO: wait for blocks to free
            self.waiting.pop(0)
            r.blocks = blocks
            self._count_hits(r, len(hits))
            self._stamp(r, f"{self.role}_alloc")
            faults.point(self.name, "after_alloc")
            self._admitted(r)

    def _launch_step(self) -> None:
        # an aborted prefill still here waits for its writers (a streamed chunk may be read): compute no more of it
        prefills = [r for r in self.reqs.values() if r.state == State.PREFILL and not r.in_step and not r.aborted]
        running = [r for r in self.reqs.values() if r.state == State.RUNNING and not r.in_step]
        if not prefills and not running:
            return
        batch = build_batch(prefills, running, self.inst.max_num_seqs, self.inst.max_batch_tokens,
                            self.inst.prefill_chunk)
        batch = [(r, self._step_work(r, w)) for r, w in batch]
        self.step_id += 1
        self.step = batch
        self.step_answers = {}
        self.step_started = time.monotonic()
        self._count_work(batch)
        for r, w in batch:
            r.in_step = True
            if w.start_pos == r.cached and r.state == State.PREFILL:
                self._stamp(r, "prefill_start")
        cmd = m.ExecuteStep(self.step_id, tuple(w for _, w in batch), self._streaming(batch))
        for ch in self.workers:
            self.send(ch, cmd)

    @staticmethod
    def _count_work(batch) -> None:
        """What this step computes, added to each of its requests (the router fits its costs on it)."""
        pre_tokens = pre_ctx = seqs = ctx = 0
        for r, w in batch:
            if r.state == State.PREFILL:
                pre_tokens += len(w.token_ids)
                pre_ctx += w.start_pos
            else:
                seqs += 1
                ctx += w.start_pos + 1
        for r, _w in batch:
            if r.state == State.PREFILL:
                r.prefill_work[0] += 1
                r.prefill_work[1] += pre_tokens
                r.prefill_work[2] += pre_ctx
            else:
                dw = r.decode_work
                dw[0] += 1
                dw[1] += seqs
                dw[2] += ctx
                dw[3] += pre_tokens

    # -- from the workers ----------------------------------------------------------------
    def on_StepDone(self, msg: m.StepDone) -> None:
        self._step_answer(msg)

    def on_StepFailed(self, msg: m.StepFailed) -> None:
        self._step_answer(msg)

    def _step_answer(self, msg) -> None:
        if self.step is None or msg.step_id != self.step_id:
            self.counters["stale_step_answer"] += 1
            return
        self.step_answers[self.current.index] = msg
        if len(self.step_answers) < len(self.workers):
            return
        batch, self.step = self.step, None
        failed = [a for a in self.step_answers.values() if isinstance(a, m.StepFailed)]
        if failed:
            for r, _ in batch:
                r.in_step = False
                self._fail(r, f"forward step failed: {failed[0].reason}")
        else:
            self._take_checksums(batch)
            sampled = iter(self.step_answers[0].sampled)  # one token per sampled seq, in batch order
            logprobs = iter(self.step_answers[0].logprobs or ())
            for r, w in batch:
                r.in_step = False
                tok, lp = (next(sampled), next(logprobs, None)) if w.sample else (None, None)
                self._after_step(r, w, tok, lp)
        self.schedule()

    def _take_checksums(self, batch) -> None:
        """--kv-verify: each rank summed its own heads; one struct per request, every head."""
        asked = [r for r, w in batch if w.checksum]
        if not asked:
            return
        per_rank = [a.checksums if len(a.checksums) == len(asked) else (None,) * len(asked)
                    for a in self.step_answers.values()]
        for i, r in enumerate(asked):
            try:
                r.checksums = checksum.merge([sums[i] for sums in per_rank])
            except ValueError as e:
                log.error("%s: checksums of transfer_id=%s not merged: %s", self.name, r.transfer_id, e)
                r.checksums = None
            if r.checksums is None:
                self.counters["kv_checksums_missing"] += 1

    def _after_step(self, r: Request, w: m.SeqWork, tok: Optional[int], lp: Optional[m.TokenLogprob] = None) -> None:
        if r.aborted:
            if not self._pinned_by_writers(r):
                self._release(r)
            return
        if r.state == State.PREFILL:
            r.prefilled = w.start_pos + len(w.token_ids)
            self._index_blocks(r, r.prefilled)  # the step ended: these blocks' KV is complete
            if r.prefilled < len(r.prompt):
                self._chunk_done(r)
                return
            self._stamp(r, "prefill_end")
            self._prefilled(r, tok, lp)
        else:
            self._emit(r, tok, lp)

    def _pinned_by_writers(self, r: Request) -> bool:
        """A streamed prefill's blocks stay ours until every writer rank answered (a WRITE
        of an earlier chunk may still read them)."""
        return r.streamed and r.state == State.PREFILL

    def _emit(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        r.output.append(tok)
        self._index_blocks(r, r.num_tokens)  # the prompt's KV (and the output's so far) is in the pool
        if len(r.output) == 1:
            self._stamp(r, "first_token")
        reason = r.finished()
        lps = (lp,) if lp is not None else ()
        if reason:
            self._stamp(r, "finished")
            self.counters["requests_completed"] += 1
            self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (tok,), True, reason, len(r.prompt),
                                             self._timeline(r), self._kv_stats(r), lps, r.cached,
                                             *r.decode_work))
            self._release(r)
        else:
            r.state = State.RUNNING
            self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (tok,), logprobs=lps))
            if len(r.output) == 3:
                faults.point(self.name, "decoding")

    # -- from the writers --------------------------------------------------------------------
    def on_KVSent(self, msg: m.KVSent) -> None:
        self._writer_answer(msg)

    def on_KVReceived(self, msg: m.KVReceived) -> None:
        self._writer_answer(msg)

    def on_KVFailed(self, msg: m.KVFailed) -> None:
        self._writer_answer(msg)

    def _writer_answer(self, msg: WriterAnswer) -> None:
        """Collect one terminal answer per writer rank; act once all have answered."""
        if not isinstance(msg, self.writer_answers):  # another role's answer: it would end a transfer wrongly
            self.counters["wrong_writer_answer"] += 1
            log.error("%s: %s from a writer; this role's writers answer %s transfer_id=%s", self.name,
                      type(msg).__name__, [t.__name__ for t in self.writer_answers], msg.transfer_id)
            return
        r = self.reqs.get((msg.transfer_id, msg.generation))
        if r is None or not (r.state in (State.SENDING, State.AWAIT_KV) or self._pinned_by_writers(r)):
            self.counters["stale_writer_answer"] += 1
            return
        rank = self.current.index
        if not isinstance(r.answers.get(rank), m.KVFailed):  # a rank's failure is never overwritten
            r.answers[rank] = msg
        for stage, t in getattr(msg, "timeline", ()):  # the writers' own stages (first rank wins)
            r.timeline.setdefault(stage, t)
        if isinstance(msg, m.KVSent) and msg.rendezvous:
            r.rendezvous = msg.rendezvous
        if isinstance(msg, (m.KVSent, m.KVReceived)) and msg.nbytes:
            r.kv.add(msg.nbytes, msg.num_descs, msg.transfer_s)
        if isinstance(msg, m.KVSent):
            r.kv.parts += msg.parts
            r.kv.stream = r.kv.stream or msg.stream
        if isinstance(msg, m.KVFailed) and len(self.writers) > 1:
            others = m.CancelKV(r.transfer_id, r.generation, msg.reason)
            for ch in self.writers:
                if ch is not self.current:
                    self.send(ch, others)
        if len(r.answers) < len(self.writers):
            return
        answers, r.answers = r.answers, {}
        failures = [a for a in answers.values() if isinstance(a, m.KVFailed)]
        lost = next((a.lost for a in failures if a.lost), "")
        if self._pinned_by_writers(r):  # a stream ended before its prefill: no writer reads the blocks now
            r.streamed = False
            if r.in_step:  # the chunk computing now still writes them: free when its step ends
                if not r.aborted:
                    r.aborted = f"KV stream failed: {failures[0].reason}" if failures else "KV stream ended"
                    status, reason = (503, f"{lost}; retry") if lost else (502, r.aborted)
                    self.counters["requests_failed"] += 1
                    self._reply(r, m.RequestFailed(r.transfer_id, r.generation, reason, status))
                return
            if not failures and not r.aborted:  # writers answer a stream's end only when it failed
                failures = [m.KVFailed(r.transfer_id, r.generation, "KV stream ended before prefill")]
        if r.aborted:
            self._release(r)
        elif lost:  # the other instance died: answered as the router answers it (503, retry)
            self._fail(r, f"{lost}; retry", 503)
        elif failures:
            self._fail(r, f"KV transfer failed: {failures[0].reason}", 502)
        else:
            self._kv_done(r, answers)
        self.schedule()

    # -- deadlines ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self._stats_waiting and now - self._stats_asked > WRITER_STATS_WAIT_S:
            self._answer_stats()  # a writer that does not answer must not hold the router's scrape
        if self.step is not None and now - self.step_started > self.cfg.timeouts.step_s:
            batch, self.step = self.step, None
            self.counters["step_timeout"] += 1
            for r, _ in batch:
                r.in_step = False
                self._fail(r, f"forward step exceeded {self.cfg.timeouts.step_s:.0f}s (worker dead or hung)", 503)
            self.schedule()
