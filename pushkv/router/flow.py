"""The asyncio shell around each request's state machine (``request.Request``).

A ``RequestRun`` reads its queue (what the server routes to it from the scheduler links, and
what the balancer delivers) and the request's deadline, feeds each input to its pure
``request.Request`` and carries out the actions it answers (sends, the balancer's bookkeeping)
until the client's last event, ``Finished`` or ``Failed``. It writes none of the request's facts:
what the legs are per path, how a request ends and its ledger are ``request.py``'s.

Which P and which D serve a request is the ``Balancer``'s choice (``balance.py`` over the pure
``policy.py``); a request no D can hold waits there until one can.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Callable, ClassVar, Optional

from pushkv import messages as m
from pushkv.config import DeploymentConfig
from pushkv.router import request as R
from pushkv.router.balance import Balancer, Refused
from pushkv.router.ledger import Ledger, Outcome
from pushkv.router.links import SchedulerLink
from pushkv.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class RequestRun:
    """Feeds a ``request.Request`` what its legs, the balancer and its deadline say, and carries
    out what it answers: sends, the balancer's bookkeeping, and the client's events."""

    def __init__(self, cfg: DeploymentConfig, balancer: Optional[Balancer], transfer_id: str,
                 prompt_token_ids: list[int], max_tokens: int, stop_token_ids: tuple[int, ...], arrival: float,
                 metrics: RouterMetrics, sampling: Optional[m.SamplingParams] = None,
                 local_link: Optional[SchedulerLink] = None, cache_salt: str = "",
                 structured: Optional[m.Structured] = None, lora: str = "", stop_strings: bool = False,
                 client_id: str = "", lora_root: str = ""):
        self.balancer = balancer
        self.local_link = local_link
        self.metrics = metrics
        wall = time.time()
        spec = R.Spec(
            mode=cfg.mode, transfer_id=transfer_id, prompt=tuple(prompt_token_ids), max_tokens=max_tokens,
            stop=stop_token_ids, request_s=cfg.timeouts.request_s,
            sampling=sampling if sampling != m.SamplingParams() else None,
            local_engine=cfg.local.engine_id or "local", wall_offset=wall - time.monotonic(), cache_salt=cache_salt,
            structured=structured, lora=lora, stop_strings=stop_strings, client_id=client_id,
        )
        self.req = R.Request(spec, arrival, arrival_wall=wall)
        self.lora_root = lora_root or lora  # the prefix index's root for its adapter (router/loras.py: Loras.root)
        self.hash_cache: dict[int, list[int]] = {}  # the balancer's: block size -> the prompt's block hashes
        self.queue: asyncio.Queue[tuple[R.Source, object]] = asyncio.Queue()
        self.links: dict[str, SchedulerLink] = {}  # leg -> the link its Generate went out on
        self.deadline = math.inf  # what the request armed
        self.started = False

    ACTIONS: ClassVar[dict[type, Callable[..., Optional[object]]]] = {}  # action type -> how it is done

    # -- what the balancer and the HTTP side read (balance.RequestRun) ---------------------------
    @property
    def client_id(self) -> str:
        """The client's own id for the request (X-Request-Id), which /v1/abort takes too: the spec's."""
        return self.req.spec.client_id

    @property
    def transfer_id(self) -> str:
        return self.req.transfer_id

    @property
    def ledger(self) -> Ledger:
        return self.req.ledger

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.req.spec.prompt

    @property
    def decode_tokens(self) -> int:
        return self.req.decode_tokens

    @property
    def cache_salt(self) -> str:
        return self.req.spec.cache_salt

    @property
    def lora(self) -> str:
        return self.req.spec.lora

    @property
    def reuses_prefix(self) -> bool:
        """A request that asked prompt logprobs is computed whole: no prefix-cache hit is assumed for it."""
        s = self.req.spec.sampling
        return s is None or s.prompt_logprobs < 0

    @property
    def output_ids(self) -> list[int]:
        return self.req.ledger.output_ids

    @property
    def done(self) -> bool:
        return self.req.ledger.done

    @property
    def cached(self) -> dict[str, int]:
        return self.req.ledger.cached

    @property
    def timeline(self) -> dict[str, float]:
        return self.req.ledger.timeline

    @property
    def prefill_work(self) -> tuple[int, int, int]:
        return self.req.ledger.prefill_work

    @property
    def decode_work(self) -> tuple[int, int, int, int]:
        return self.req.ledger.decode_work

    # -- inputs from outside the handler ------------------------------------------
    def deliver(self, leg: R.Source, msg: object) -> None:
        self.queue.put_nowait((leg, msg))

    def inject_failure(self, status: int, reason: str, outcome: Outcome) -> None:
        """The abort endpoint, shutdown, an instance down (``outcome``: what /metrics counts it as)."""
        self.queue.put_nowait((R.ROUTER, R.Cancel(status, reason, outcome)))

    # -- feeding the machine and carrying out what it says --------------------------
    def _feed(self, msg: object, leg: R.Source = R.ROUTER) -> list[R.Event]:
        """One input, and every input its actions bring back (the balancer's answers, a refused
        send), at once: nothing awaits in here, so a cancellation never lands halfway."""
        events: list[R.Event] = []
        inputs: list[tuple[R.Source, object]] = [(leg, msg)]
        while inputs:
            leg, msg = inputs.pop(0)
            try:
                actions = self.req.on(msg, time.monotonic(), leg)
            except R.IllegalInput as e:
                if leg == R.ROUTER:  # the router's own input out of turn: a bug, and loud
                    raise
                log.error("dropped: %s", e)  # a scheduler's message out of turn changes nothing
                continue
            for i, a in enumerate(actions):
                answer = self._do(a, events)
                if isinstance(answer, R.SendFailed):  # the rest of this batch is moot
                    unsent = tuple(b.leg for b in actions[i + 1:] if isinstance(b, R.Send))
                    answer = R.SendFailed(answer.leg, answer.error, unsent)
                if answer is not None:
                    inputs.append((R.ROUTER, answer))
                if isinstance(answer, R.SendFailed):
                    break
        return events

    def _do(self, a: R.Action, events: list[R.Event]) -> Optional[object]:
        """Carry out one action; what it brings back (the balancer's answer, a refused send) is the
        request's next input."""
        if isinstance(a, (R.Tokens, R.Finished, R.Failed)):
            events.append(a)
            return None
        return self.ACTIONS[type(a)](self, a)

    @property
    def _balancer(self) -> Balancer:
        assert self.balancer is not None, "a disaggregated action in local mode"
        return self.balancer

    def _arm(self, a: R.Arm) -> None:
        self.deadline = a.at

    def _disarm(self, a: R.Disarm) -> None:
        self.deadline = math.inf

    def _place(self, a: R.Place) -> object:
        try:
            v = self._balancer.request(self)
        except Refused as e:
            return R.Rejected(e.status, e.reason)
        return R.Queued() if v is None else self._balancer.placed(v)

    def _place_decode(self, a: R.PlaceDecode) -> object:
        engine = self._balancer.request_decode(self)
        return R.DecodeQueued() if engine is None else R.DecodePlaced(engine)

    def _prefill_done(self, a: R.PrefillDone) -> None:
        self._balancer.prefill_done(self)

    def _kv_arrived(self, a: R.KVArrived) -> None:
        self._balancer.kv_arrived(self)

    def _release(self, a: R.Release) -> None:
        self._balancer.release(self)

    def _send(self, a: R.Send) -> Optional[R.SendFailed]:
        link = self.links.get(a.leg)
        try:
            if link is None:
                link = self.local_link if a.leg == "local" else self._balancer.links[a.engine_id]
                assert link is not None, f"no link for the {a.leg} leg"
                self.links[a.leg] = link
            link.send(a.msg)
        except Exception as e:
            if isinstance(a.msg, m.Generate):
                return R.SendFailed(a.leg, str(e))
            log.error("%s to %s failed transfer_id=%s: %s", type(a.msg).__name__, a.leg, self.transfer_id, e)
            return None
        if isinstance(a.msg, m.Abort):
            self.metrics.aborts_sent.labels(role=a.leg).inc()
            log.debug("abort %s leg transfer_id=%s: %s", a.leg, self.transfer_id, a.msg.reason)  # (counted above)
        return None

    # -- the handler's side ---------------------------------------------------------------
    def start(self) -> Optional[R.Failed]:
        """Send the legs, or queue the request at the balancer; the refusal if it was refused
        (429 / 503 / 413) or a link refused the send."""
        if self.started:
            return None
        self.started = True
        return next((e for e in self._feed(R.Start()) if isinstance(e, R.Failed)), None)

    async def _next(self) -> tuple[R.Source, object]:
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation
        # (client gone) that lands in the same iteration as a queue item
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                return R.ROUTER, R.Tick()
            async with asyncio.timeout(None if math.isinf(remaining) else remaining):
                return await self.queue.get()
        except TimeoutError:
            return R.ROUTER, R.Tick()

    async def events(self) -> AsyncIterator[R.Event]:
        """Yield the request's events; ends after one Finished or Failed."""
        refusal = self.start()
        if refusal is not None:
            yield refusal
            return
        while not self.req.over:
            leg, msg = await self._next()
            for ev in self._feed(msg, leg):
                yield ev

    def stop_early(self, reason: str) -> None:
        """A stop string ended the choice: it is complete, its legs are aborted."""
        self._feed(R.Stopped())
        self.close(reason)

    def shown(self, finish: str) -> None:
        """The client was given the choice's end (``finish``): the token leg's instance hears how it ended."""
        self._feed(R.Shown(finish))

    def close(self, reason: str = "", outcome: Outcome = "aborted") -> None:
        """Release the request and abort every leg that was sent and has not ended; if it had not
        ended, it ends with ``outcome`` (no await: safe while cancelled)."""
        self._feed(R.Close(reason, outcome))


RequestRun.ACTIONS = {
    R.Send: RequestRun._send, R.Arm: RequestRun._arm, R.Disarm: RequestRun._disarm,
    R.Place: RequestRun._place, R.PlaceDecode: RequestRun._place_decode,
    R.PrefillDone: RequestRun._prefill_done, R.KVArrived: RequestRun._kv_arrived, R.Release: RequestRun._release,
}
