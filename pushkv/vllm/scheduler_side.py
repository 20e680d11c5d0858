"""The connector's scheduler half (vLLM's EngineCore process).

It talks to its instance's writers directly over ZMQ, so vLLM's engine loop
only tells them what happened, when it happens:

- D, at allocation (``update_state_after_alloc``): ``ExpectBlocks`` to every
  writer, which registers the blocks with P's writers at once.
- P, when the request finishes (``request_finished``): ``SendBlocks`` to every
  writer, which WRITEs as soon as D's registration is there; the blocks stay
  allocated (``request_finished`` returns True) until the worker reports the
  request in ``finished_sending``.

The per-step metadata only tells the workers what is pending, for their
bookkeeping (failing it if their writer dies) and for waiting on the writer
instead of spinning when a step is empty.

A D request with ``n`` > 1 is ``n`` requests in vLLM's scheduler, one per choice, with the same
params: the first to be allocated loads the prompt's KV from P; the others wait for it and then take
its blocks from D's prefix cache (one transfer id moves the KV once).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import zmq

from pushkv import messages as m
from pushkv.trace import stamp as mark
from pushkv.trace import stamps_on
from pushkv.vllm import params as P
from pushkv.vllm import wire as w

log = logging.getLogger(__name__)

SPENT_TIDS = 4096  # D: transfer ids loaded once, remembered for siblings (n > 1) that come later


@dataclass
class StepMeta:
    """Scheduler -> workers, once per step (vLLM pickles it to the workers)."""

    idle: bool = True  # no token scheduled this step: workers may wait on their writer
    sends: dict[str, str] = field(default_factory=dict)  # P: req id -> transfer id, new this step
    recvs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # D: req id -> (tid, blocks)
    pending: bool = False  # transfers are outstanding on this instance
    # P, layer streaming: req id -> (tid, its blocks, prompt tokens stored once this step's layers are)
    streams: dict[str, tuple[str, list[int], int]] = field(default_factory=dict)
    # P, layer streaming: req id -> transfer id, streams whose blocks vLLM freed this step (preempted)
    preempted: dict[str, str] = field(default_factory=dict)


class SchedulerSide:
    def __init__(self, settings: P.Settings, block_size: int, num_groups: int, kv_role: str = "kv_both"):
        self.s = settings
        self.block_size = block_size
        self.kv_role = kv_role
        if num_groups != 1:
            raise ValueError(f"pushkv's connector supports one KV cache group, this model has {num_groups}")
        self.ctx: zmq.Context = zmq.Context.instance()
        self.writers: list[zmq.Socket] = []
        for r in range(settings.tp):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(settings.cmd_endpoint(r))
            self.writers.append(sock)
        self.legs: dict[str, P.Leg] = {}  # req id -> its pushkv leg, while we track it
        self.waiting_recv: dict[str, tuple[str, list[int]]] = {}
        self.loaded: set[str] = set()
        self.marking: dict[str, str] = {}  # PUSHKV_VLLM_TIMING: req id -> transfer id until scheduled
        self.loaded_tokens: dict[str, int] = {}  # D: prompt tokens whose KV came from P
        self.pending_send: dict[str, str] = {}
        self._new_sends: dict[str, str] = {}
        self._new_recvs: dict[str, tuple[str, list[int]]] = {}
        # P, layer streaming: req id -> (its blocks so far, its prompt's length)
        self.stream_blocks: dict[str, tuple[list[int], int]] = {}
        # D: transfer id -> the request loading it, until vLLM schedules that request (its blocks
        # are then in D's prefix cache) or it ends; and the transfer ids loaded once (n > 1)
        self.loading: dict[str, str] = {}
        self.spent: OrderedDict[str, int] = OrderedDict()  # -> the prompt tokens it loaded

    def _tell(self, msg: m.Msg) -> None:
        data = m.encode(msg)
        for sock in self.writers:
            sock.send(data)

    def leg(self, request) -> Optional[P.Leg]:
        rid = request.request_id
        if rid not in self.legs:
            try:
                leg = P.parse_leg(request.kv_transfer_params)
            except P.ParamsError as e:
                log.error("pushkv: request %s: %s (served without transfer)", rid, e)
                leg = None
            if leg is None:
                return None
            why = P.leg_refused(leg.role, self.kv_role)
            if why:
                log.error("pushkv: request %s: %s (served without transfer) transfer_id=%s", rid, why,
                          leg.transfer_id)
                return None
            self.legs[rid] = leg
        return self.legs[rid]

    def _unseen_leg(self, request) -> Optional[P.Leg]:
        """The leg of a request the scheduler never asked about (queued behind a full batch, then aborted); its
        params' faults were not logged for it, and are not now (it was never served)."""
        try:
            leg = P.parse_leg(request.kv_transfer_params)
        except P.ParamsError:
            return None
        return leg if leg is not None and not P.leg_refused(leg.role, self.kv_role) else None

    # -- D ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        leg = self.leg(request)
        if leg is not None and leg.role == "decode" and request.request_id not in self.loaded:
            mark("d_arrived", leg.transfer_id)
        if leg is None or leg.role != "decode" or request.request_id in self.waiting_recv:
            return 0, False
        if request.request_id in self.loaded:  # the load is done (or failed): never again
            return 0, False
        owner = self.loading.get(leg.transfer_id)
        if owner is not None and owner != request.request_id:
            return None, False  # a sibling choice (n > 1) loads this prompt: ask again once it is in D's cache
        if leg.transfer_id in self.spent:  # a sibling loaded it: D's prefix cache has its blocks
            self.loaded_tokens[request.request_id] = self.spent[leg.transfer_id]  # (what the answer says)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        leg = self.legs.get(request.request_id)
        if leg is None or leg.role != "decode" or num_external_tokens <= 0:
            return
        n = len(request.prompt_token_ids)
        first = (n - num_external_tokens) // self.block_size  # blocks D already had (prefix cache)
        want = -(-n // self.block_size) - first
        block_ids = list(blocks.get_unhashed_block_ids_all_groups()[0])[:want]
        self.loaded.add(request.request_id)
        self.loading[leg.transfer_id] = request.request_id
        self.spent[leg.transfer_id] = num_external_tokens
        while len(self.spent) > SPENT_TIDS:
            self.spent.popitem(last=False)
        self.loaded_tokens[request.request_id] = num_external_tokens
        self.waiting_recv[request.request_id] = (leg.transfer_id, block_ids)
        self._new_recvs[request.request_id] = (leg.transfer_id, block_ids)
        mark("d_expect_sent", leg.transfer_id)
        self._tell(w.ExpectBlocks(request.request_id, leg.transfer_id, tuple(block_ids), n, leg.source,
                                  self.s.registration_wait_s + self.s.transfer_s, first * self.block_size))

    # -- P ----------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        leg = self.legs.pop(rid, None) or self._unseen_leg(request)
        self.stream_blocks.pop(rid, None)
        if leg is not None and self.loading.get(leg.transfer_id) == rid:
            del self.loading[leg.transfer_id]
        was_loaded = rid in self.loaded
        self.loaded.discard(rid)
        loaded = self.loaded_tokens.pop(rid, 0)
        source = {P.SOURCE_KEY: P.source_dict(self.s.source()), P.ROLE_KEY: self.kv_role}
        if leg is None:
            return False, source if request.kv_transfer_params else None
        if leg.role == "decode":
            if rid in self.waiting_recv:  # ended (aborted) before the KV arrived: P may still WRITE
                self._tell(w.CancelBlocks(rid, leg.transfer_id, "decode request ended before its KV arrived", "decode"))
                return True, None  # freed when the writer reports it (finished_recving)
            if not was_loaded and leg.transfer_id not in self.spent and leg.source is not None:
                # ended before its blocks were allocated (and no sibling choice loads it): it never registers
                self._tell(w.ForgetTransfer(rid, leg.transfer_id, leg.source,
                                            f"decode request ended before D allocated it: {request.status.name}"))
            return False, {"pushkv_transfer_id": leg.transfer_id, "pushkv_loaded_tokens": loaded}
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids:
            self._tell(w.CancelBlocks(rid, leg.transfer_id, f"prefill request ended: {request.status.name}",
                                      "prefill"))
            return False, source
        self.pending_send[rid] = leg.transfer_id
        self._new_sends[rid] = leg.transfer_id
        mark("p_send_sent", leg.transfer_id)
        self._tell(w.SendBlocks(rid, leg.transfer_id, tuple(block_ids), request.num_computed_tokens))
        return True, source

    # -- every step ----------------------------------------------------------------
    def build_meta(self, scheduler_output) -> StepMeta:
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {})
        for tid, rid in list(self.loading.items()):
            if rid in scheduled:  # its KV is in D's prefix cache now: its siblings may hit it
                del self.loading[tid]
        if self.marking:
            for rid in scheduled:
                tid = self.marking.pop(rid, None)
                if tid:
                    mark("d_scheduled", tid)
        meta = StepMeta(idle=scheduler_output.total_num_scheduled_tokens == 0, sends=self._new_sends,
                        recvs=self._new_recvs, pending=bool(self.pending_send or self.waiting_recv),
                        streams=self._streams(scheduler_output) if self.s.stream_groups else {},
                        preempted=self._preempted(scheduler_output) if self.s.stream_groups else {})
        self._new_sends, self._new_recvs = {}, {}
        return meta

    def _streams(self, out) -> dict[str, tuple[str, list[int], int]]:
        """P legs whose prompt this step computes (part of), with their blocks and the prompt
        tokens stored once the step's layers are: what the workers mark per layer group."""
        streams = {}
        counts = out.num_scheduled_tokens
        news = [(r.req_id, list(r.block_ids[0]), r.num_computed_tokens, len(r.prompt_token_ids or ()))
                for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self.stream_blocks:  # not a stream (or its prompt is done)
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: a new block table, whole
                blocks = list(new[0]) if new else []
            else:
                blocks = self.stream_blocks[rid][0] + (list(new[0]) if new else [])
            news.append((rid, blocks, cached.num_computed_tokens[i], self.stream_blocks[rid][1]))
        for rid, blocks, done, prompt in news:
            leg = self.legs.get(rid)
            if leg is None or leg.role != "prefill" or rid not in counts:
                continue
            if done >= prompt:  # the prompt is stored: a decode step of a P leg that asked for more
                self.stream_blocks.pop(rid, None)
                continue
            self.stream_blocks[rid] = (blocks, prompt)
            streams[rid] = (leg.transfer_id, blocks, min(done + counts[rid], prompt))
        return streams

    def _preempted(self, out) -> dict[str, str]:
        """Streamed P legs that vLLM preempted this step: their blocks are freed (the worker holds
        the step until the writer reads them no more); they resume with a new block table."""
        gone = {}
        for rid in getattr(out, "preempted_req_ids", None) or ():
            entry, leg = self.stream_blocks.get(rid), self.legs.get(rid)
            if entry is not None and leg is not None:
                self.stream_blocks[rid] = ([], entry[1])
                gone[rid] = leg.transfer_id
        return gone

    def update_connector_output(self, out) -> None:
        for rid in out.finished_sending or ():
            self.pending_send.pop(rid, None)
        for rid in out.finished_recving or ():
            entry = self.waiting_recv.pop(rid, None)
            if entry and stamps_on():
                mark("d_sched_recvd", entry[0])
                self.marking[rid] = entry[0]

    def has_pending_push_work(self) -> bool:
        return bool(self.pending_send or self._new_sends or self._new_recvs)

    def close(self) -> None:
        for sock in self.writers:
            sock.close(0)


def encode_meta(meta: StepMeta) -> bytes:  # for tests and logs
    return msgspec.json.encode(meta.__dict__)
