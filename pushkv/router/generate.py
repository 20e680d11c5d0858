"""One HTTP generation request (completions or chat, n choices, streamed or not)
served from its ``RequestRun``s: one run per choice, each its own transfer id
(``<id>`` for n=1, ``<id>-<i>`` otherwise) and its own sampling stream.

``serve`` is the one entry: it starts the runs (a refusal is a plain HTTP error even
for a stream), then answers unary or streamed. Every refusal and failure a client
sees is shaped by ``refusal`` / ``_error_body`` here.

A choice that hits a stop string is done at once: its run closes, which aborts
its legs, and its events stop being read.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Optional

from aiohttp import web

from pushkv.router import api, output
from pushkv.router.flow import RequestRun
from pushkv.router.request import Failed, Finished, Tokens

log = logging.getLogger(__name__)


def _error_body(status: int, reason: str) -> dict:
    return api.error_body(reason, api.error_type(status), status)


def refusal(status: int, reason: str) -> web.Response:
    """A request refused or failed before its response began."""
    return web.json_response(_error_body(status, reason), status=status)


async def serve(router, request: web.Request, params: api.CompletionParams,
                runs: list[RequestRun]) -> web.StreamResponse:
    """Start every choice's run, then answer; a client that goes away aborts them all."""
    gen = Generation(router, params, runs)
    try:
        for run in runs:  # placement first, so a refusal is a plain HTTP error even for a stream
            refused = run.start()
            if refused is not None:
                for r in runs:
                    r.record.outcome = refused.outcome
                return refusal(refused.status, refused.reason)
        if params.stream:
            return await gen.stream(request)
        return await gen.unary()
    except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes
        gen.client_gone()
        raise


class Fanout:
    """Events of every run, tagged with the choice index, as they arrive."""

    def __init__(self, runs: list[RequestRun]):
        self.runs = runs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.get_running_loop().create_task(self._pump(i, r)) for i, r in enumerate(runs)]
        self.live = len(runs)

    async def _pump(self, i: int, run: RequestRun) -> None:
        try:
            async for ev in run.events():
                await self.queue.put((i, ev))
        finally:
            self.queue.put_nowait((i, None))

    def stop(self, i: int, reason: str) -> None:
        """Choice i is complete early (stop string): abort its legs, stop reading it."""
        self.runs[i].stop_early(reason)
        self.tasks[i].cancel()

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        while self.live:
            i, ev = await self.queue.get()
            if ev is None:
                self.live -= 1
                continue
            yield i, ev

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass


class Generation:
    def __init__(self, router, params: api.CompletionParams, runs: list[RequestRun]):
        self.router = router
        self.tok = router.tokenizer
        self.params = params
        self.runs = runs
        self.chat = params.chat
        self.request_id = output.completion_id(runs[0].transfer_id.split("-")[0], self.chat)
        self.model = params.model or router.served[0]
        self.created = output.now_s()
        self.outs = [output.ChoiceOutput(i, self.tok, params.stop, params.sampling.min_tokens)
                     for i in range(params.n)]
        self.want_logprobs = params.sampling.logprobs >= 0
        self.offsets = [len(params.prompt_text) if params.echo else 0] * params.n

    # -- bookkeeping -------------------------------------------------------
    def _apply(self, i: int, ev, fan: Fanout) -> Optional[output.Delta]:
        out = self.outs[i]
        if isinstance(ev, Tokens):
            delta = out.add(ev.token_ids, ev.logprobs)
            if delta.finish_reason:  # a stop string: this choice is complete now
                fan.stop(i, "stop string matched")
            return delta
        if isinstance(ev, Finished):
            return out.finish(ev.finish_reason)
        return None

    def _logprobs(self, i: int, delta: output.Delta) -> Optional[dict]:
        if not self.want_logprobs:
            return None
        if self.chat:
            return output.chat_logprobs(self.tok, delta.token_ids, delta.logprobs)
        lp = output.completion_logprobs(self.tok, delta.token_ids, delta.logprobs, self.offsets[i])
        self.offsets[i] += sum(len(s) for s in lp["tokens"])
        return lp

    def _usage(self) -> dict:
        run = self.runs[0]
        leg = "prefill" if "prefill" in run.cached else next(iter(run.cached), "")
        return output.usage(len(self.params.prompt_token_ids), sum(len(o.token_ids) for o in self.outs),
                            run.cached.get(leg) if leg else None)

    def _extension(self) -> dict:
        run = self.runs[0].req
        ext = {"transfer_id": run.transfer_id,
               "timeline": dict(sorted(run.timeline.items(), key=lambda kv: kv[1]))}
        if run.engines:  # which instance served each leg
            ext["instances"] = dict(run.engines)
        ext["path"] = run.path
        d = run.kv.get("decode")
        if d is not None and d.reserved_blocks:  # D blocks x seconds held before the KV arrived
            ext["reserved_block_s"] = d.reserved_block_s
            ext["reserved_blocks"] = d.reserved_blocks
            ext["allocation"] = "late" if run.late else "early"
        if run.kv:  # each leg's KVTransferStats: bytes, descriptors, posted -> done as that side measured it
            ext["kv"] = {leg: {"bytes": k.nbytes, "descs": k.num_descs, "transfer_s": k.transfer_s,
                               "rendezvous": k.rendezvous, "parts": k.parts, "stream": k.stream}
                         for leg, k in run.kv.items()}
        return ext

    def _fail(self) -> None:
        """One choice failed (its run says how): the others are aborted with it."""
        for run in self.runs:
            if not run.record.outcome:
                run.record.outcome = "aborted"

    def client_gone(self) -> None:
        for run in self.runs:
            if run.record.outcome != "ok":
                run.record.outcome = "aborted"
        log.info("client went away transfer_id=%s", self.runs[0].transfer_id.split("-")[0])

    # -- unary ------------------------------------------------------------------
    async def unary(self) -> web.Response:
        fan = Fanout(self.runs)
        try:
            async for i, ev in fan.events():
                if isinstance(ev, Failed):
                    self._fail()
                    return refusal(ev.status, ev.reason)
                self._apply(i, ev, fan)
        finally:
            await fan.close()
        if not all(o.done for o in self.outs):
            raise RuntimeError("request run ended without an outcome")
        choices = []
        for o in self.outs:
            lp = None
            if self.want_logprobs:
                d = output.Delta(o.text, o.token_ids, o.logprobs)
                lp = self._logprobs(o.index, d)
            if self.chat:
                choices.append(output.chat_choice(o.index, o.text, o.finish_reason, lp))
            else:
                prefix = self.params.prompt_text if self.params.echo else ""
                choices.append(output.completion_choice(o.index, prefix + o.text, o.token_ids, o.finish_reason, lp))
        return web.json_response(output.body(self.request_id, self.created, self.model, choices, self.chat, False,
                                             self._usage(), self._extension()))

    # -- streaming ----------------------------------------------------------------
    def _chunk(self, choice: dict, usage_: Optional[dict] = None, ext: Optional[dict] = None) -> bytes:
        return output.sse(output.body(self.request_id, self.created, self.model, [choice] if choice else [],
                                      self.chat, True, usage_, ext))

    def _stream_delta(self, i: int, delta: output.Delta) -> bytes:
        lp = self._logprobs(i, delta)
        if self.chat:
            d = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            return self._chunk(output.chat_chunk_choice(i, d, delta.finish_reason, lp))
        choice = output.completion_choice(i, delta.text, delta.token_ids, delta.finish_reason, lp)
        if delta.finish_reason and self.params.n == 1:  # the last chunk carries usage (pushkv's habit)
            return self._chunk(choice, self._usage(), self._extension())
        return self._chunk(choice)

    def _opening(self, i: int) -> bytes:
        if self.chat:
            return self._chunk(output.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None))
        if self.params.echo:
            return self._chunk(output.completion_choice(i, self.params.prompt_text, [], None))
        return b""

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": self.request_id,
        })
        await resp.prepare(request)
        fan = Fanout(self.runs)
        try:
            started = [False] * self.params.n
            failed = False
            async for i, ev in fan.events():
                if isinstance(ev, Failed):
                    self._fail()
                    await resp.write(output.sse(_error_body(ev.status, ev.reason)))
                    failed = True
                    break
                delta = self._apply(i, ev, fan)
                if delta is not None and (delta.text or delta.token_ids or delta.finish_reason):
                    if not started[i]:  # with the first output, as vLLM: a client's TTFT stays true
                        started[i] = True
                        opening = self._opening(i)
                        if opening:
                            await resp.write(opening)
                    await resp.write(self._stream_delta(i, delta))
            if not failed and self.params.include_usage:
                await resp.write(self._chunk({}, self._usage()))
            await resp.write(output.SSE_DONE)
            await resp.write_eof()
        except ConnectionError:  # the client closed the stream under us
            self.client_gone()
        finally:
            await fan.close()
        return resp
