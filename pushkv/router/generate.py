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
from typing import AsyncIterator, Awaitable, Callable, Optional

from aiohttp import web

from pushkv.floods import Kinds
from pushkv.router import api, output, render, responses, text
from pushkv.router.flow import RequestRun
from pushkv.router.request import Failed, Finished, Tokens
from pushkv.router.tasks import cancel_and_wait

log = logging.getLogger(__name__)
GONE = Kinds()  # clients that went away mid-request: logged as floods.py says (a load test's cancels repeat them)


def _error_body(status: int, reason: str) -> dict:
    return api.error_body(reason, api.error_type(status), status)


def refusal(status: int, reason: str) -> web.Response:
    """A request refused or failed before its response began."""
    return web.json_response(_error_body(status, reason), status=status)


async def serve(request: web.Request, params: api.CompletionParams, runs: list[RequestRun], tok: text.Tokenizer,
                model: str) -> web.StreamResponse:
    """Start every choice's run, then answer; a client that goes away aborts them all. ``model``: the name the
    response reports."""
    gen = Generation(params, runs, tok, model)
    try:
        refused = start_all(runs)  # placement first, so a refusal is a plain HTTP error even for a stream
        if refused is not None:
            return refused
        resp = await (gen.stream(request) if params.stream else gen.unary())
        if not params.stream:  # (a stream's went with its head)
            resp.headers["X-Request-Id"] = gen.header_id(request)
        return resp
    except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes
        gen.client_gone()
        raise


def start_all(runs: list[RequestRun]) -> Optional[web.Response]:
    """Place every choice's run; where one is refused, every choice ends with it and the refusal is the answer."""
    for run in runs:
        refused = run.start()
        if refused is not None:
            for r in runs:  # the refusal ends every choice, the ones placed already too
                r.close(outcome=refused.outcome)
            return refusal(refused.status, refused.reason)
    return None


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
        await cancel_and_wait(self.tasks)


class Generation:
    """One HTTP request's choices, through ``output.ChoiceOutput`` (text) and its endpoint's renderer
    (shapes). Its runs' ledgers are read, never written: how each choice ended is the run's."""

    def __init__(self, params: api.CompletionParams, runs: list[RequestRun], tok: text.Tokenizer, model: str):
        self.params = params
        self.runs = runs
        self.render = render.for_endpoint(tok, params)
        # the client's id where it gave one (not for /v1/responses, whose ids name kept responses)
        own = params.client_id if params.responses is None else ""
        self.request_id = self.render.request_id(own or runs[0].transfer_id.split("-")[0])
        self.model = model
        self.created = output.now_s()
        self.outs = [output.ChoiceOutput(i, tok, params.stop, params.sampling.min_tokens, hide=params.echo_only,
                                         stop_ids=params.stop_token_ids, skip_special=params.skip_special_tokens,
                                         include_stop=params.include_stop_str_in_output,
                                         reason_ids=params.stop_reason_ids,
                                         spaces_between_special=params.spaces_between_special_tokens)
                     for i in range(params.choices)]

    # -- bookkeeping -------------------------------------------------------
    def _apply(self, i: int, ev, fan: Fanout) -> Optional[output.Delta]:
        out = self.outs[i]
        if isinstance(ev, Tokens):
            delta = out.add(ev.token_ids, ev.logprobs, ev.prompt_logprobs)
            if delta.finish_reason:  # a stop string: this choice is complete now
                fan.stop(i, "stop string matched")
            return delta
        if isinstance(ev, Finished):
            delta = out.finish(ev.finish_reason)
            self.runs[i].shown(out.finish_reason or ev.finish_reason)  # (its instance counts the end so)
            return delta
        return None

    def _usage(self) -> dict:
        """Every prompt's tokens once (its n choices share it, as vLLM counts), every choice's output."""
        prompts, n = self.params.prompts(), self.params.n
        cached = [self._cached(self.runs[p * n]) for p in range(len(prompts))]
        return output.usage(sum(len(ids) for ids, _ in prompts), sum(o.completion_tokens for o in self.outs),
                            None if None in cached else sum(c for c in cached if c is not None),
                            self.render.usage_details(self.outs))

    @staticmethod
    def _cached(run: RequestRun) -> Optional[int]:
        """The prompt tokens the instance that prefilled the run took from its prefix cache, where known."""
        cached = run.ledger.cached
        leg = "prefill" if "prefill" in cached else next(iter(cached), "")
        return cached.get(leg) if leg else None

    def _extension(self) -> dict:
        led = self.runs[0].ledger
        ext: dict[str, object] = {"transfer_id": self.runs[0].transfer_id,
                                  "timeline": dict(sorted(led.timeline.items(), key=lambda kv: kv[1]))}
        if led.engines:  # which instance served each leg
            ext["instances"] = dict(led.engines)
        ext["path"] = led.path
        d = led.kv.get("decode")
        if d is not None and d.reserved_blocks:  # D blocks x seconds held before the KV arrived
            ext["reserved_block_s"] = d.reserved_block_s
            ext["reserved_blocks"] = d.reserved_blocks
            ext["allocation"] = "late" if led.late else "early"
        if led.kv:  # each leg's KVTransferStats: bytes, descriptors, posted -> done as that side measured it
            ext["kv"] = {leg: {"bytes": k.nbytes, "descs": k.num_descs, "transfer_s": k.transfer_s,
                               "rendezvous": k.rendezvous, "parts": k.parts, "stream": k.stream}
                         for leg, k in led.kv.items()}
        return ext

    def header_id(self, request: web.Request) -> str:
        """The response's X-Request-Id: the client's as it sent it (vLLM's --enable-request-id-headers), else the
        response's id."""
        return request.headers.get("X-Request-Id") or self.request_id

    def client_gone(self) -> None:
        """Logged only: closing the runs (the server's, whatever ended the request) ends each choice
        still open as aborted."""
        n = GONE.seen("gone")
        if n:
            log.info("client went away transfer_id=%s (%d so far)", self.runs[0].transfer_id.split("-")[0], n)

    # -- unary ------------------------------------------------------------------
    async def unary(self) -> web.Response:
        fan = Fanout(self.runs)
        try:
            async for i, ev in fan.events():
                if isinstance(ev, Failed):  # the others end as aborted when the server closes them
                    return refusal(ev.status, ev.reason)
                self._apply(i, ev, fan)
        finally:
            await fan.close()
        if not all(o.done for o in self.outs):
            raise RuntimeError("request run ended without an outcome")
        if isinstance(self.render, responses.ResponsesRenderer):
            answer = self.render.unary_body(self.request_id, self.created, self.model, self.outs, self._usage(),
                                            self._extension())
            if self.params.keep_response is not None:  # stored (responses.Store)
                self.params.keep_response(answer)
            return web.json_response(answer)
        choices = [self.render.choice(o) for o in self.outs]
        body = self.render.body(self.request_id, self.created, self.model, choices, False, self._usage(),
                                self._extension())
        return web.json_response({**body, **self.render.response_fields(self.outs)})

    # -- streaming ----------------------------------------------------------------
    def _chunk(self, choice: Optional[dict], usage_: Optional[dict] = None, ext: Optional[dict] = None,
               fields: Optional[dict] = None) -> bytes:
        body = self.render.body(self.request_id, self.created, self.model, [choice] if choice else [], True, usage_,
                                ext)
        return output.sse({**body, **fields} if fields else body)

    def _choice_usage(self, i: int, opening: bool = False) -> Optional[dict]:
        """vLLM's continuous_usage_stats: choice i's prompt and its output so far, in each of its chunks (its
        opening chunk, the role or the echo, before any output: 0)."""
        if not self.params.continuous_usage:
            return None
        return output.usage(len(self.params.prompts()[i // self.params.n][0]),
                            0 if opening else self.outs[i].completion_tokens, None,
                            self.render.usage_details([] if opening else [self.outs[i]]))

    def _stream_delta(self, i: int, delta: output.Delta) -> bytes:
        """A delta's chunk; usage only as vLLM's (continuous_usage_stats), the request's total going in the
        chunk after the last (include_usage)."""
        choice = self.render.chunk_choice(i, delta)
        if choice is None:  # nothing to show
            return b""
        ext = self._extension() if delta.finish_reason and self.render.extension_in_last_chunk() else None
        return self._chunk(choice, self._choice_usage(i), ext)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """The choices' output as server-sent events: chat and completion chunks, or (/v1/responses) OpenAI's typed
        events. A client that goes away ends the stream; the runs are closed either way."""
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": self.header_id(request),
        })
        await resp.prepare(request)
        fan = Fanout(self.runs)
        try:
            if isinstance(self.render, responses.ResponsesRenderer):
                await self.typed_events(lambda kind, body: resp.write(output.sse_event(kind, body)), fan)
            else:
                await self._chunks(resp, fan)
            await resp.write_eof()
        except ConnectionError:  # the client closed the stream under us
            self.client_gone()
        finally:
            await fan.close()
        return resp

    async def typed_events(self, write: Callable[[str, dict], Awaitable[object]], fan: Fanout) -> None:
        """A /v1/responses stream: OpenAI's typed events (router/responses.py), each handed to ``write`` (the SSE
        stream, or a background response's log); no [DONE]. The last response, completed or failed, is kept where
        the request keeps it."""
        assert isinstance(self.render, responses.ResponsesRenderer)
        events = responses.ResponseEvents(self.render, self.request_id, self.created, self.model)
        for kind, opening in events.start():
            await write(kind, opening)
        async for i, ev in fan.events():
            if isinstance(ev, Failed):
                for kind, body in events.failed(ev.status, ev.reason):
                    if self.params.keep_response and (self.params.responses or {}).get("background"):
                        self.params.keep_response(body["response"])
                    await write(kind, body)
                return
            delta = self._apply(i, ev, fan)
            if delta is None:
                continue
            for kind, body in events.delta(delta):
                await write(kind, body)
            if delta.finish_reason:
                for kind, body in events.finish(delta.finish_reason, self._usage(), self._extension()):
                    if kind in ("response.completed", "response.incomplete") and self.params.keep_response:
                        self.params.keep_response(body["response"])
                    await write(kind, body)

    async def background_answer(self) -> dict:
        """A background /v1/responses request's final response, kept where the request keeps it: as ``unary``'s,
        or ``failed`` with the reason where a choice failed."""
        assert isinstance(self.render, responses.ResponsesRenderer)
        fan = Fanout(self.runs)
        try:
            async for i, ev in fan.events():
                if isinstance(ev, Failed):
                    code = "server_error" if ev.status >= 500 else "invalid_request"
                    answer = responses.response(self.request_id, self.created, self.model, self.render.settings, [],
                                                "failed", None, error={"code": code, "message": ev.reason})
                    break
                self._apply(i, ev, fan)
            else:
                answer = self.render.unary_body(self.request_id, self.created, self.model, self.outs, self._usage(),
                                                self._extension())
        finally:
            await fan.close()
        if self.params.keep_response is not None:
            self.params.keep_response(answer)
        return answer

    async def _chunks(self, resp: web.StreamResponse, fan: Fanout) -> None:
        """A completion or chat stream: a chunk a delta, usage where asked, then [DONE]."""
        started = [False] * self.params.choices
        last: dict[int, output.Delta] = {}  # a choice's last tokens, waiting for its finish_reason

        async def send(i: int, delta: output.Delta) -> None:
            if not started[i]:  # with the first output, as vLLM: a client's TTFT stays true
                started[i] = True
                for n, opening in enumerate(self.render.openings(self.outs[i])):  # (vLLM's prompt ids: the first's)
                    await resp.write(self._chunk(opening, self._choice_usage(i, opening=True), None,
                                                 None if n else self.render.opening_fields()))
            chunk = self._stream_delta(i, delta)
            if chunk:
                await resp.write(chunk)

        failed = False
        async for i, ev in fan.events():
            if isinstance(ev, Failed):
                for j in sorted(last):
                    await send(j, last.pop(j))
                await resp.write(output.sse(_error_body(ev.status, ev.reason)))
                failed = True
                break
            delta = self._apply(i, ev, fan)
            if delta is None:
                continue
            if isinstance(ev, Tokens) and ev.last and not delta.finish_reason:
                last[i] = delta  # its Finished comes next: vLLM's finish_reason rides on the last token's chunk
                continue
            if i in last:
                delta = output.joined(last.pop(i), delta)
            if delta.text or delta.token_ids or delta.finish_reason:
                await send(i, delta)
        for j in sorted(last):  # closed before its Finished came
            await send(j, last.pop(j))
        if not failed and self.params.include_usage:
            await resp.write(self._chunk({}, self._usage()))
        await resp.write(output.SSE_DONE)
