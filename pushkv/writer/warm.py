"""Warm: how hot a writer's loop runs, and the keep-warm WRITEs.

The loop drives UCX itself (no progress thread); how often it looks is ``poll.py``'s
``poll_ms``: spin while a transfer is young, announced or, with warm on, expected; back off
for a stuck one; else the pending or idle rate. Spinning yields the core first (a crowded
host's peer may be the one waiting for it).

- **Wake hints**: ``wake_peer`` tells a peer over the handshake link that a transfer with it
  is about to be posted (``TransferStarting``); the peer spins for the transfer's expected time.
- **Warm** (``warm_for`` / ``cool``): while a transfer with us is expected, spin (capped by the
  request's own deadline).
- **Keep-warm beats** (``beat_for``): while a WRITE to a peer is expected, a WRITE of
  ``BEAT_BYTES`` into the peer's sink every ``BEAT_MS``: a post after 20 ms without one costs
  ~15x a post right after another even with the loop spinning; a 1 ms beat keeps it at the
  back-to-back cost (nixl_probe --heartbeat-ms). The sink is memory no request owns.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from pushkv import faults
from pushkv import messages as m
from pushkv.writer.peers import Peer
from pushkv.writer.poll import poll_ms, spin_s
from pushkv.writer.posting import PostingWriter

log = logging.getLogger(__name__)

BEAT_MS = 1.0
BEAT_BYTES = 256 << 10
HINT_SPIN_MAX_S = 30.0  # a wake hint keeps us hot at most this long, whatever size it names


class WarmWriter(PostingWriter):
    device_uuid = ""  # our pool's GPU ("" on the CPU)

    def init_warm(self, warm: bool, beat_ms: float = BEAT_MS) -> None:
        """``warm``: spin while a transfer with us is expected; ``beat_ms``: the keep-warm
        period (0: no beats; a test that wants none passes it)."""
        self.warm = warm
        self.beat_ms = beat_ms
        self._expected: dict[tuple[str, int], float] = {}  # transfers peers announced -> spin until
        self._warm: dict[Any, float] = {}  # transfers expected -> warm until (a cap)
        self.sink: Optional[Any] = None  # our keep-warm sink (warm on): peers' beats land here, never in the pool
        self._beat_keys: dict[str, set] = {}  # peer agent -> warm keys whose WRITE to it is coming
        self._beats: dict[str, object] = {}  # peer agent -> its beat's handle, in flight
        self._last_beat: dict[str, float] = {}

    def wants_sink(self) -> bool:
        return self.warm and self.beat_ms > 0

    def release_beats(self) -> None:
        for h in self._beats.values():
            self.nixl.release(h)
        self._beats.clear()

    def peer_forgotten(self, peer: Peer) -> None:
        super().peer_forgotten(peer)
        self._beat_keys.pop(peer.agent, None)
        self._last_beat.pop(peer.agent, None)
        h = self._beats.pop(peer.agent, None)
        if h is not None:
            self.nixl.release(h)

    # -- wake hints over the handshake link ---------------------------------------------
    def wake_peer(self, peer: Peer, transfer_id: str, generation: int, nbytes: int) -> None:
        """Ask ``peer`` to drive NIXL progress: a transfer with it is about to be posted."""
        self.send_to_peer(peer, m.TransferStarting(transfer_id, generation, self.rank, nbytes))

    def on_TransferStarting(self, msg: m.TransferStarting, identity: Optional[bytes] = None) -> None:
        # only a handshaken peer may make us spin, and no longer than a transfer into our memory
        # could take (a hint with nbytes = 2**62, from anyone, held a core for good)
        if not self.from_peer(identity):
            self._refuse_hint("wake_hint_not_a_peer", msg)
            return
        if not 0 <= msg.nbytes <= self.memory.nbytes:
            self._refuse_hint("wake_hint_bad_nbytes", msg)
            return
        faults.point(self.name, "transfer_starting")  # a peer posted a transfer with us (a streamed part: mid-stream)
        now = time.monotonic()
        self.counters["wake_hints"] += 1
        self._expected[(msg.transfer_id, msg.generation)] = now + min(spin_s(msg.nbytes), HINT_SPIN_MAX_S)

    def _refuse_hint(self, counter: str, msg: m.TransferStarting) -> None:
        self.counters[counter] += 1
        n = self.counters[counter]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood of them cannot flood the log
            log.warning("%s: wake hint dropped (%s, %d so far): nbytes=%d transfer_id=%.64s", self.name, counter, n,
                        msg.nbytes, msg.transfer_id)

    def transfer_arrived(self, transfer_id: str, generation: int) -> None:
        """The transfer a peer announced ended on our side: stop driving progress for it."""
        self._expected.pop((transfer_id, generation), None)

    # -- warm: a hot loop while a transfer with us is expected --------------------------
    def warm_for(self, key, until: float) -> None:
        """Spin (when warm is on) until ``key``'s transfer is done or ``until`` (the cap: a
        lost request cannot keep us spinning); the first cap of a key holds."""
        if self.warm:
            self._warm.setdefault(key, until)

    def cool(self, key) -> None:
        self._warm.pop(key, None)
        if self._beat_keys:
            for agent in [a for a, keys in self._beat_keys.items() if key in keys]:
                self._beat_keys[agent].discard(key)
                if not self._beat_keys[agent]:
                    del self._beat_keys[agent]

    # -- keep-warm WRITEs ---------------------------------------------------------------
    def beat_for(self, key, agent: str) -> None:
        """While ``key`` stays warm, keep our WRITE path to ``agent`` warm (``beat``)."""
        peer = self.peers_by_agent.get(agent)
        if key in self._warm and peer is not None and peer.sink_addr and self.beat_ms > 0:
            if self.device_uuid and peer.device_uuid == self.device_uuid:
                # P and D share the GPU: the beats' copies ran beside P's prefill and slowed it
                # 15 % (8k prompt, qwen3-8b, H200: 299.7 against 260.9 ms), for a post that costs
                # little on one device anyway
                self.counters["warm_beats_same_gpu_skipped"] += 1
                return
            self._beat_keys.setdefault(agent, set()).add(key)

    def beat(self, now: float) -> None:
        """Every ``beat_ms``, a WRITE of BEAT_BYTES from the start of our memory into each
        expected peer's sink (memory no request owns, so the bytes matter to no one): what a
        post costs depends on how long ago the last one was, and a real WRITE is coming."""
        if not (self._beat_keys or self._beats):
            return
        for agent, h in list(self._beats.items()):
            pending, failure = self.nixl.reap([h], "keep-warm WRITE failed")
            if not pending:
                del self._beats[agent]
                if failure:
                    self.counters["warm_beats_failed"] += 1
        for agent in list(self._beat_keys):
            peer = self.peers_by_agent.get(agent)
            if agent in self._beats or peer is None or now - self._last_beat.get(agent, 0.0) < self.beat_ms / 1e3:
                continue
            self._last_beat[agent] = now
            n = min(BEAT_BYTES, peer.sink_bytes, self.memory.nbytes)
            try:
                self._beats[agent] = self.nixl.post("WRITE", [(0, 0, n)], self.memory.base_addr, agent,
                                                    peer.sink_addr, remote_dev=peer.dev_id)
                self.counters["warm_beats"] += 1
            except Exception as e:  # a dead peer: its transfers fail on their own deadlines
                self.counters["warm_beats_failed"] += 1
                log.debug("%s: keep-warm WRITE to %s failed: %s", self.name, agent, e)

    # -- the loop ---------------------------------------------------------------------------
    def teardown(self) -> None:
        """Every writer's end: its handshake links closed, its transfers and beats released,
        its memory deregistered from NIXL."""
        for key in list(self.links):
            self.close_link(key)
        if getattr(self, "nixl", None) is not None:
            self.release_inflight()
            self.release_beats()
            self.nixl.deregister()

    def tick(self, now: float) -> None:
        """Every writer's turn of the loop: keep-warm beats, NIXL's notifications, the
        transfers in flight, the handshakes, then the role's own deadlines (``expire``)."""
        self.beat(time.perf_counter())
        self.poll_notifs(now)
        if self.inflight:
            self.check_inflight(now)
        if self.links:
            self.expire_links(now)
        self.expire(now)

    def expire(self, now: float) -> None:
        """The role's own deadlines."""

    # -- the poll timeout -----------------------------------------------------------------
    def has_pending(self) -> bool:
        """Something waits on a deadline or a notification: poll at the pending rate."""
        return False

    def poll_timeout_ms(self) -> int:
        now = time.monotonic()
        for table in (self._expected, self._warm):  # overstayed (slow, lost): no more spinning for it
            if table:
                for k in [k for k, t in table.items() if t <= now]:
                    del table[k]
        p = poll_ms(now, expected_until=max(self._expected.values(), default=None),
                    inflight_until=max((fl.posted + spin_s(fl.nbytes) for fl in self.inflight.values()), default=None),
                    warm_until=max(self._warm.values(), default=None),
                    pending=self.has_pending(), last_activity=self._last_activity)
        if p.ms == 0:
            if p.why == "warm":
                self.counters["warm_spins"] += 1
            return self._spin()
        return p.ms

    @staticmethod
    def _spin() -> int:
        """Poll again at once, but let a runnable process on this core go first: on a
        crowded host the peer whose progress we wait for may be the one waiting for the core."""
        os.sched_yield()
        return 0
