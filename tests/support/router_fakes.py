"""Fake schedulers for router tests: a thread with a zmq ROUTER socket.

Each fake answers every Generate with what its ``script`` returns: a list of
``(gate, reply)`` pairs; a reply goes out once its gate (a threading.Event,
or None) is set. Every message in and out is appended to a log shared by all
fakes of a test, so tests can assert the order across legs.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional

import aiohttp
import zmq

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.router.server import Router
from pushkv.router.text import ByteTokenizer

POLL_MS = 5
WAIT_S = 5.0

Script = Callable[[m.Generate], list]


class OrderLog:
    def __init__(self):
        self.entries: list[tuple[str, str, m.Msg]] = []  # (role, "recv"|"send", msg)
        self.cond = threading.Condition()

    def add(self, role: str, direction: str, msg: m.Msg) -> None:
        with self.cond:
            self.entries.append((role, direction, msg))
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[list], bool], timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.entries), timeout)

    def index(self, role: str, direction: str, kind: type) -> int:
        with self.cond:
            for i, (r, d, msg) in enumerate(self.entries):
                if r == role and d == direction and isinstance(msg, kind):
                    return i
        return -1

    def received(self, role: str, kind: type) -> list:
        with self.cond:
            return [msg for r, d, msg in self.entries if r == role and d == "recv" and isinstance(msg, kind)]


class FakeScheduler(threading.Thread):
    def __init__(self, role: str, endpoint: str, log: OrderLog, script: Optional[Script] = None):
        super().__init__(name=f"fake-{role}", daemon=True)
        self.role = role
        self.endpoint = endpoint
        self.log = log
        self.script = script or (lambda g: [])
        self.pending: list[tuple[bytes, Optional[threading.Event], m.Msg]] = []
        self.stop_flag = threading.Event()
        self.bound = threading.Event()
        self.stats: Optional[m.Stats] = None  # set: GetStats is answered with it

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self.bound.set()
        try:
            while not self.stop_flag.is_set():
                if sock.poll(POLL_MS):
                    ident, payload = sock.recv_multipart()
                    msg = m.DEC_ROUTER_TO_SCHED.decode(payload)
                    self.log.add(self.role, "recv", msg)
                    if isinstance(msg, m.Generate):
                        self.pending += [(ident, gate, reply) for gate, reply in self.script(msg)]
                    elif isinstance(msg, (m.GetStats, m.ResetPrefixCache)) and self.stats is not None:
                        self.pending.append((ident, None, self.stats))
                keep = []
                for ident, gate, reply in self.pending:
                    if gate is None or gate.is_set():
                        self.log.add(self.role, "send", reply)  # before: the peer may react at once
                        sock.send_multipart([ident, m.encode(reply)])
                    else:
                        keep.append((ident, gate, reply))
                self.pending = keep
        finally:
            sock.close(0)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(5)


def tokens(g: m.Generate, ids, finished=False, reason="", timeline=()) -> m.TokensGenerated:
    return m.TokensGenerated(g.transfer_id, g.generation, tuple(ids), finished, reason,
                             len(g.prompt_token_ids), tuple(timeline))


def stage(name: str) -> tuple[str, float]:
    return (name, time.time())


def make_cfg(tmp_path, mode: str, **kw) -> DeploymentConfig:
    def inst(role):
        return InstanceConfig(role=role, engine_id=f"{role}-engine",
                              sched_endpoint=f"ipc://{tmp_path}/{role}.sched",
                              handshake_endpoints=(f"ipc://{tmp_path}/{role}.hs0",))
    return DeploymentConfig(mode=mode, port=0, model=preset("tiny"), prefill=inst("prefill"),
                            decode=inst("decode"), local=inst("local"), **kw)


class Harness:
    def __init__(self, cfg, scripts):
        self.cfg = cfg
        self.log = OrderLog()
        self.fakes = {role: FakeScheduler(role, cfg.instance(role).sched_endpoint, self.log, script)
                      for role, script in scripts.items()}
        self.router = Router(cfg, tokenizer=None if cfg.skip_tokenizer_init else ByteTokenizer())
        self.http: aiohttp.ClientSession = None

    async def __aenter__(self):
        for f in self.fakes.values():
            f.start()
            assert f.bound.wait(WAIT_S)
        await self.router.start()
        self.http = aiohttp.ClientSession(base_url=self.router.url, timeout=aiohttp.ClientTimeout(total=20))
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.router.stop()
        for f in self.fakes.values():
            f.stop()

    async def wait(self, pred, timeout=WAIT_S):
        ok = await asyncio.to_thread(self.log.wait_for, pred, timeout)
        assert ok, f"condition not met; log={[(r, d, type(x).__name__) for r, d, x in self.log.entries]}"

    async def wait_abort(self, role):
        await self.wait(lambda e: any(r == role and d == "recv" and isinstance(x, m.Abort) for r, d, x in e))
