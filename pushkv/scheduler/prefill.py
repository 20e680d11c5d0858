"""P's scheduler: prefill, then hand the finished blocks to the writers.

Push: ``SendKV`` (the writers WRITE once D's registration is there) and the
router hears ``PrefillFinished`` when every writer reports the WRITE done.
Pull: ``HoldKV`` (the writers keep the blocks under a lease) and the router hears
``PrefillFinished`` with P's block ids at once, to relay to D.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from pushkv import messages as m
from pushkv.kv.layout import transfer_of
from pushkv.scheduler.core import SchedulerCore, WriterAnswer
from pushkv.scheduler.requests import Request, State


class PrefillScheduler(SchedulerCore):
    role = "prefill"
    writer_answers = (m.KVSent, m.KVFailed)

    def __init__(self, cfg, inst):
        super().__init__(cfg, inst)
        self.transfer = transfer_of(cfg)  # what the writers stream (they say the same in KVSent.stream)

    def _admitted(self, r: Request) -> None:
        r.state = State.PREFILL

    def _chunkwise(self, r: Request) -> bool:
        """A prompt nothing streams before its prefill ends (pull, or a late request: the KV is held once computed;
        push with --push-stream off: one WRITE at prefill end) takes its blocks chunk by chunk, as vLLM's P, and may be
        preempted by recompute until it ends. A streamed push (--push-stream chunk or layer) takes its whole prompt's
        at admission, as before: from its first streamed chunk or layer group the writers may be reading its blocks
        into D's, so it could never give them back, and its pool admitted past what it can finish would stall."""
        return self.transfer.stream == "off" or self._holds(r)

    def _step_work(self, r: Request, w: m.SeqWork) -> m.SeqWork:
        """--kv-verify: the step that stores the prompt's last tokens also sums the KV, so the
        checksums are ready with the first token (and travel with the WRITE or the relay)."""
        last = r.state == State.PREFILL and w.start_pos + len(w.token_ids) >= len(r.prompt)
        if self.cfg.kv_verify == "off" or not last:
            return w
        return msgspec.structs.replace(w, checksum=self.cfg.kv_verify)

    def _chunk_done(self, r: Request) -> None:
        """Streaming push: the chunk's blocks may leave for D while the next chunk computes.
        From the first, the writers may be reading the blocks: they stay ours until every
        writer rank answers (``SchedulerCore._pinned_by_writers``)."""
        if self.transfer.stream != "chunk" or self._holds(r) or r.aborted:
            return
        self._stream_started(r)
        self._to_writers(m.StreamKV(r.transfer_id, r.generation, tuple(r.blocks), r.prefilled))

    def _streaming(self, batch) -> tuple[m.StreamKV, ...]:
        """Layer-streamed push: each prompt this step computes, with the tokens it holds after
        it; the workers tell their writers as each layer group is stored, so the writers may
        read the blocks from this step on."""
        if self.transfer.stream != "layer":
            return ()
        out = []
        for r, w in batch:
            if r.state == State.PREFILL and not self._holds(r) and not r.aborted:
                self._stream_started(r)
                out.append(m.StreamKV(r.transfer_id, r.generation, tuple(r.blocks), w.start_pos + len(w.token_ids)))
        return tuple(out)

    def _stream_started(self, r: Request) -> None:
        if not r.streamed:
            r.streamed = True
            self._stamp(r, "stream_start")

    def _prefilled(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        r.state = State.SENDING
        r.output = [tok]
        self._first_token(r)
        if lp is not None or r.prompt_logprobs is not None:
            # the first token's logprob and the prompt's are P's to give: D never sees these logits
            lps = (lp,) if lp is not None else ()
            self._reply(r, m.TokensGenerated(r.transfer_id, r.generation, (tok,), logprobs=lps,
                                             prompt_logprobs=r.prompt_logprobs))
        if self._holds(r):
            lease = self.cfg.timeouts.lease_s
            if r.late:
                self.counters["late_allocations"] += 1
            # a late push request keeps push's transfer: D registers after the relay and we WRITE
            # P WRITEs after D registers: pull's "write" variant, and push's late request (push WRITEs)
            self._to_writers(m.HoldKV(r.transfer_id, r.generation, tuple(r.blocks), len(r.prompt), tok, lease,
                                      write=self.transfer.direction == "write"))
            src = m.PrefillSource(self.inst.engine_id, self.inst.tp, self.inst.handshake_endpoints)
            pull = m.PullParams(src, tuple(r.blocks), len(r.prompt), tok, self.now + lease, r.checksums)
            self._reply(r, m.PrefillFinished(r.transfer_id, r.generation, tok, pull, r.sorted_timeline(),
                                             None, r.cached, *r.prefill_work))
            self._observe_finish(r, "length")  # P's leg: one token, as vLLM's P runs max_tokens=1
        else:
            self._to_writers(m.SendKV(r.transfer_id, r.generation, tuple(r.blocks), len(r.prompt), tok, r.checksums))
            self._stamp(r, "send_kv")

    def _holds(self, r: Request) -> bool:
        """Pull's protocol for this request: hold the KV and relay P's blocks through the router."""
        return self.cfg.mode == "pull" or r.late

    def _kv_done(self, r: Request, answers: dict[int, WriterAnswer]) -> None:
        """Every writer rank says the WRITE (push) or D's READ (pull) is done: the blocks are free."""
        self._stamp(r, "kv_sent")
        self.counters["kv_transfers"] += 1
        self.counters["kv_blocks"] += len(r.blocks)
        self._count_kv(r)
        if r.rendezvous:
            self.counters[f"rendezvous_{r.rendezvous}"] += 1
        if not self._holds(r):
            self._reply(r, m.PrefillFinished(r.transfer_id, r.generation, r.output[0], None, r.sorted_timeline(),
                                             r.kv_stats(self.transfer.describe), r.cached, *r.prefill_work))
            self._observe_finish(r, "length")  # P's leg: one token, as vLLM's P runs max_tokens=1
        self._release(r)
