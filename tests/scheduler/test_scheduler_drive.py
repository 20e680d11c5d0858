"""The scheduler core driven at random, seeded (plain calls, as tests/scheduler/test_scheduler_roles.py drives it):
every role and transfer (local; P pull, push unstreamed, layer- and chunk-streamed with late legs; D push and pull with
legs that prefill there), small pools that preempt mid-prefill and mid-decode, chunked or not, tight token budgets,
TP 1 and 2, the prefix cache on and off; arrivals from two routers, the client's aborts, a router restarted at its
place, steps that fail or time out (and answer late), streams the writers end, writers' answers in any order.

What must hold whatever the order: each step's sequences have the blocks their tokens need and no block twice; every
request the router did not abort ends with exactly one message that says so (a RequestFailed, P's PrefillFinished, or
the finished TokensGenerated); once everything has answered, no request is left and every block is free."""
from __future__ import annotations

import random

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.scheduler.outbox import Peer
from tests.scheduler.test_scheduler_roles import P_SRC, deliver, wired

BS = 16
SETUPS = [("local", "local", "layer"), ("prefill", "pull", "layer"), ("prefill", "push", "off"),
          ("prefill", "push", "layer"), ("prefill", "push", "chunk"), ("decode", "push", "layer"),
          ("decode", "pull", "layer")]


class Drive:
    def __init__(self, seed: int):
        rng = self.rng = random.Random(seed)
        self.role, self.mode, stream = rng.choice(SETUPS)
        nb, chunk = rng.randint(8, 16), rng.choice([0, 10, 16, 32])
        tp = rng.choice([1, 2])
        inst = InstanceConfig(role=self.role, engine_id=f"{self.role}-engine", tp=tp, num_blocks=nb,
                              prefix_cache=rng.random() < 0.5, prefill_chunk=chunk or (16 if stream == "chunk" else 0),
                              max_batch_tokens=rng.choice([8, 16, 40, 8192]), max_num_seqs=rng.randint(1, 4),
                              worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                              writer_endpoints=tuple(f"x{r}" for r in range(tp)))
        prefill = inst if self.role == "prefill" else InstanceConfig(
            role="prefill", engine_id=P_SRC.engine_id, tp=2, handshake_endpoints=P_SRC.handshake)
        roles = {"prefill": prefill} | ({} if self.role == "prefill" else {self.role: inst})
        self.s, self.wire = wired(DeploymentConfig(mode=self.mode, push_stream=stream, model=preset("small"), **roles),
                                  inst)
        self.what = (seed, self.role, self.mode, stream, inst)
        self.routers = [Peer.router(b"a0"), Peer.router(b"b0")]
        self.epochs = 0
        deliver(self.s, self.routers[0], m.RouterEpoch(5, "a:8000"))
        deliver(self.s, self.routers[1], m.RouterEpoch(7, "b:8000"))
        self.owner: dict[str, Peer] = {}
        self.ended: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.transfers: dict[str, m.Msg] = {}  # the writers' work not answered yet, by transfer id
        self.cancels: set[str] = set()
        self.late: list[int] = []  # steps that timed out, their answers not given yet
        self.now = 0.0

    # -- what the core sends ------------------------------------------------------------
    def read(self) -> None:
        for x in self.wire.take("router"):
            if isinstance(x, m.RequestFailed) or isinstance(x, m.PrefillFinished) or (
                    isinstance(x, m.TokensGenerated) and x.finished):
                assert x.transfer_id not in self.ended, (self.what, "told twice", x, self.ended[x.transfer_id])
                self.ended[x.transfer_id] = type(x).__name__
        for x in self.wire.take("writer"):
            if isinstance(x, (m.SendKV, m.HoldKV, m.ExpectKV, m.ReadKV)):
                self.transfers[x.transfer_id] = x
            elif isinstance(x, m.CancelKV):
                self.cancels.add(x.transfer_id)
        self.s.alloc.check()

    # -- what the others do -------------------------------------------------------------
    def arrive(self, n: int) -> None:
        rng, tid = self.rng, f"t{n}"
        size = rng.randint(1, BS * self.s.inst.num_blocks // 2)
        first = rng.choice([1, 1, 100])  # (the same prompt again: prefix hits)
        prompt = tuple((first + i) % 300 for i in range(size))
        kw: dict = {}
        if self.role == "decode":
            if rng.random() < 0.5:
                kw = dict(prefill_here=True)
            elif self.mode == "pull":
                kw = dict(pull=m.PullParams(P_SRC, tuple(range(size // BS + 1)), size, 42, 1e9))
            else:
                kw = dict(source=P_SRC)
        elif self.role == "prefill" and self.mode == "push" and rng.random() < 0.3:
            kw = dict(late=True)
        who = self.owner[tid] = rng.choice(self.routers)
        max_tokens = 1 if self.role == "prefill" else rng.randint(1, 30)
        stops = (7,) if rng.random() < 0.3 else ()
        deliver(self.s, who, m.Generate(tid, 0, self.role, prompt, max_tokens, stop_token_ids=stops, **kw))

    def abort(self) -> None:
        live = sorted(t for t in self.owner if t not in self.ended and t not in self.aborted)
        if live:
            tid = self.rng.choice(live)
            self.aborted.add(tid)
            deliver(self.s, self.owner[tid], m.Abort(tid, 0, "client gone"))

    def router_restarts(self) -> None:
        """Router a restarts where it served: its requests are orphans, router b's run on."""
        self.epochs += 1
        old, self.routers[0] = self.routers[0], Peer.router(f"a{self.epochs}".encode())
        self.aborted |= {t for t, who in self.owner.items() if who == old}
        deliver(self.s, self.routers[0], m.RouterEpoch(10 + self.epochs, "a:8000"))

    def step(self, fail: bool = False) -> None:
        (x, *rest) = [x for x in self.wire.take("worker") if isinstance(x, m.ExecuteStep)]
        assert len(rest) == len(self.s.workers) - 1, (self.what, rest)
        for w in x.seqs:
            assert len(w.block_table) * BS >= w.start_pos + len(w.token_ids), (self.what, w)
            assert len(set(w.block_table)) == len(w.block_table), (self.what, w)
        sampled = tuple(self.rng.choice([42, 7, 9]) for w in x.seqs if w.sample)
        for rank, ch in enumerate(self.s.workers):
            deliver(self.s, ch, m.StepFailed(x.step_id, "CUDA error") if fail and rank == 0 else
                    m.StepDone(x.step_id, sampled))

    def step_times_out(self) -> None:
        (x, *_) = [x for x in self.wire.take("worker") if isinstance(x, m.ExecuteStep)]
        self.late.append(x.step_id)
        self.now += self.s.cfg.timeouts.step_s + 1
        self.s.tick(self.now, self.now)

    def late_answer(self) -> None:
        step_id = self.late.pop(0)
        for ch in self.s.workers:
            deliver(self.s, ch, m.StepDone(step_id, ()))

    def stream_ends(self) -> None:
        streamed = sorted(r.transfer_id for r in self.s.reqs.values() if r.streamed)
        if streamed:
            tid = self.rng.choice(streamed)
            for w in self.s.writers:
                deliver(self.s, w, m.KVFailed(tid, 0, "peer gone"))

    def transfer_done(self, tid: str) -> None:
        del self.transfers[tid]
        for w in self.s.writers:
            deliver(self.s, w, m.KVSent(tid, 0, 1, 1, 0.001) if self.role == "prefill" else m.KVReceived(tid, 0, 42))

    def cancelled(self, tid: str) -> None:
        self.cancels.discard(tid)
        self.transfers.pop(tid, None)
        if tid in self.s.by_tid:
            for w in self.s.writers:
                deliver(self.s, w, m.KVFailed(tid, 0, "cancelled"))

    # -- the run ------------------------------------------------------------------------
    def run(self, moves: int = 300) -> None:
        rng, s = self.rng, self.s
        for i in range(moves):
            self.now += 0.01
            s.now = s.wall = self.now
            op = rng.random()
            if op < 0.01 and s.step is not None:
                self.read()
                self.step_times_out()
            elif op < 0.02 and self.late:
                self.late_answer()
            elif op < 0.025:
                self.stream_ends()
            elif op < 0.03:
                self.router_restarts()
            elif op < 0.25 and i < moves - 60:
                self.arrive(i)
            elif op < 0.31:
                self.abort()
            elif op < 0.7 and s.step is not None:
                self.read()
                self.step(fail=rng.random() < 0.03)
            elif op < 0.85 and self.transfers:
                self.transfer_done(rng.choice(sorted(self.transfers)))
            elif self.cancels:
                self.cancelled(rng.choice(sorted(self.cancels)))
            self.read()
        for _ in range(5000):  # everything answers, in order, until nothing is left
            self.read()
            if not s.reqs and not self.late:
                break
            if s.step is not None:
                self.step()
            elif self.cancels:
                self.cancelled(min(self.cancels))
            elif self.transfers:
                self.transfer_done(min(self.transfers))
            elif self.late:
                self.late_answer()
            else:
                stuck = [(r.transfer_id, r.state, len(r.blocks), r.prefilled) for r in s.reqs.values()]
                raise AssertionError((self.what, "nothing left to answer, yet requests are here", stuck))
        self.read()
        assert not s.reqs and not s.waiting and s.alloc.num_free == s.alloc.num_blocks, self.what
        assert set(self.owner) - self.aborted <= set(self.ended), (self.what, "never ended")


@pytest.mark.parametrize("first", range(0, 120, 20))
def test_every_request_ends_once_and_every_block_comes_back_whatever_the_order(first):
    for seed in range(first, first + 20):
        Drive(seed).run()
