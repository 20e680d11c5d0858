"""A router's epoch reaches a scheduler that restarted at the same address (a single host's fixed endpoints, no
registry to hand the router a new link): the link said its epoch once, at its start, so the restarted scheduler never
learnt the router's place, counted that router's connection as of every place, and a second router restarting on the
host made it abort the first router's requests (nobody told: each waited out its bound). The link now says its epoch
again each time it connects anew, before anything it sends after.

A real ROUTER socket stands for the scheduler (what the link talks to is only the socket: the core's side is
tests/scheduler/test_scheduler_epoch.py)."""
from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio

from pushkv import messages as m
from pushkv.router.links import SchedulerLink
from pushkv.router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(60)

PLACE = "10.0.0.9:8000"


def _scheduler_at(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """The scheduler's socket, bound (again, where it restarts) at ``endpoint``."""
    sched = ctx.socket(zmq.ROUTER)
    sched.setsockopt(zmq.LINGER, 0)
    sched.bind(endpoint)
    return sched


async def _next(sock: zmq.asyncio.Socket) -> m.Msg:
    frames = await asyncio.wait_for(sock.recv_multipart(), 10)
    return m.DEC_ROUTER_TO_SCHED.decode(frames[-1])


async def _epochs_then_stats(sock: zmq.asyncio.Socket) -> list[m.Msg]:
    """What the scheduler hears up to the GetStats the test sent (its last)."""
    heard = [await _next(sock)]
    while not isinstance(heard[-1], m.GetStats):
        heard.append(await _next(sock))
    return heard


def test_the_link_says_its_epoch_again_to_a_scheduler_restarted_at_its_address(tmp_path):
    endpoint = f"ipc://{tmp_path}/sched.sock"

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        sched = _scheduler_at(ctx, endpoint)
        link = SchedulerLink(ctx, "decode", endpoint, lambda role, msg: None, RouterMetrics("push"))
        try:
            link.start(123, PLACE)
            link.send(m.GetStats())
            heard = await _epochs_then_stats(sched)
            # the epoch start queued; said again too where the monitor saw the first connection
            assert heard[0] == m.RouterEpoch(123, PLACE) and heard[-1] == m.GetStats()
            assert heard[1:-1] in ([], [m.RouterEpoch(123, PLACE, again=True)]), heard
            sched.close(0)  # the scheduler restarts at the same address
            sched = _scheduler_at(ctx, endpoint)
            # before: nothing came (the link's next message arrived from a connection of no place)
            assert await _next(sched) == m.RouterEpoch(123, PLACE, again=True)
            link.send(m.GetStats())
            assert await _epochs_then_stats(sched) == [m.GetStats()]
        finally:
            await link.close()
            sched.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(body(), 40))


def test_the_epoch_is_said_again_behind_a_queue_filled_while_the_scheduler_was_away(tmp_path):
    """What the router queued while the scheduler was away filled the link's queue to its bound: on connecting anew
    the epoch said again was refused (zmq.Again, logged) while that queue drained, so the scheduler heard the queued
    requests and never our place. It now waits for room, behind them."""
    endpoint = f"ipc://{tmp_path}/sched.sock"

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        sched = _scheduler_at(ctx, endpoint)
        link = SchedulerLink(ctx, "decode", endpoint, lambda role, msg: None, RouterMetrics("push"))
        seen = asyncio.Event()
        loop = asyncio.get_running_loop()

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "epoch said again" in record.getMessage():
                    loop.call_soon_threadsafe(seen.set)

        handler, links_log = Seen(logging.DEBUG), logging.getLogger("pushkv.router.links")
        links_log.addHandler(handler)
        level = links_log.level
        links_log.setLevel(logging.DEBUG)
        try:
            link.start(123, PLACE)
            link.send(m.GetStats())
            await _epochs_then_stats(sched)
            seen.clear()
            sched.close(0)  # the scheduler goes away; the router queues until the queue is full
            queued = 0
            with pytest.raises(zmq.Again):
                while True:
                    link.send(m.Generate(f"t{queued}", 0, "decode", tuple(range(2000)), 5))
                    queued += 1
            sched = _scheduler_at(ctx, endpoint)
            await asyncio.wait_for(seen.wait(), 10)  # the link saw the connection before the scheduler read a thing
            heard = [await _next(sched)]  # (those sent before the link saw the old connection go are lost)
            while not isinstance(heard[-1], m.RouterEpoch):
                heard.append(await _next(sched))
            assert heard[-1] == m.RouterEpoch(123, PLACE, again=True)
            assert heard[:-1] and all(isinstance(x, m.Generate) for x in heard[:-1]), heard[-3:]
        finally:
            links_log.removeHandler(handler)
            links_log.setLevel(level)
            await link.close()
            sched.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(body(), 40))
