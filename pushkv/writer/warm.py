"""Warm: how hot a writer's loop runs, and the keep-warm WRITEs (a part the shell holds,
``shell.py``).

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
from typing import Any, Iterable, Optional, Protocol

from pushkv import faults
from pushkv import messages as m
from pushkv.transport.nixl_agent import NixlAgent
from pushkv.writer.memory import Memory
from pushkv.writer.peers import Peer, Peers
from pushkv.writer.poll import poll_ms, spin_s
from pushkv.writer.posting import InFlight

log = logging.getLogger(__name__)

BEAT_MS = 1.0
BEAT_BYTES = 256 << 10
HINT_SPIN_MAX_S = 30.0  # a wake hint keeps us hot at most this long, whatever size it names


class WarmHost(Protocol):
    """What :class:`WarmUp` asks of its shell: its NIXL agent, memory and GPU (set in its
    setup), the peer table."""

    name: str
    counters: Any
    rank: int
    nixl: NixlAgent
    memory: Memory
    peers: Peers
    device_uuid: str  # our pool's GPU ("" on the CPU)


class WarmUp:
    def __init__(self, host: WarmHost, enabled: bool, beat_ms: float = BEAT_MS):
        """``enabled``: spin while a transfer with us is expected; ``beat_ms``: the keep-warm
        period (0: no beats; a test that wants none passes it)."""
        self.host = host
        self.enabled = enabled
        self.beat_ms = beat_ms
        self.expected: dict[tuple[str, int], float] = {}  # transfers peers announced -> spin until
        self.warm: dict[Any, float] = {}  # transfers expected -> warm until (a cap)
        self.sink: Optional[Any] = None  # our keep-warm sink (warm on): peers' beats land here, never in the pool
        self._beat_keys: dict[str, set] = {}  # peer agent -> warm keys whose WRITE to it is coming
        self._beats: dict[str, object] = {}  # peer agent -> its beat's handle, in flight
        self._last_beat: dict[str, float] = {}

    def wants_sink(self) -> bool:
        return self.enabled and self.beat_ms > 0

    def release_beats(self) -> None:
        for h in self._beats.values():
            self.host.nixl.release(h)
        self._beats.clear()

    def peer_forgotten(self, peer: Peer) -> None:
        self._beat_keys.pop(peer.agent, None)
        self._last_beat.pop(peer.agent, None)
        h = self._beats.pop(peer.agent, None)
        if h is not None:
            self.host.nixl.release(h)

    # -- wake hints over the handshake link ---------------------------------------------
    def wake_peer(self, peer: Peer, transfer_id: str, generation: int, nbytes: int) -> None:
        """Ask ``peer`` to drive NIXL progress: a transfer with it is about to be posted."""
        self.host.peers.send_to(peer, m.TransferStarting(transfer_id, generation, self.host.rank, nbytes))

    def on_transfer_starting(self, msg: m.TransferStarting, identity: Optional[bytes] = None) -> None:
        # only a handshaken peer may make us spin, and no longer than a transfer into our memory
        # could take (a hint with nbytes = 2**62, from anyone, held a core for good)
        host = self.host
        if not host.peers.from_peer(identity):
            self._refuse_hint("wake_hint_not_a_peer", msg)
            return
        if not 0 <= msg.nbytes <= host.memory.nbytes:
            self._refuse_hint("wake_hint_bad_nbytes", msg)
            return
        faults.point(host.name, "transfer_starting")  # a peer posted a transfer with us (a streamed part: mid-stream)
        now = time.monotonic()
        host.counters["wake_hints"] += 1
        self.expected[(msg.transfer_id, msg.generation)] = now + min(spin_s(msg.nbytes), HINT_SPIN_MAX_S)

    def _refuse_hint(self, counter: str, msg: m.TransferStarting) -> None:
        counters = self.host.counters
        counters[counter] += 1
        n = counters[counter]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood of them cannot flood the log
            log.warning("%s: wake hint dropped (%s, %d so far): nbytes=%d transfer_id=%.64s", self.host.name, counter,
                        n, msg.nbytes, msg.transfer_id)

    def transfer_arrived(self, transfer_id: str, generation: int) -> None:
        """The transfer a peer announced ended on our side: stop driving progress for it."""
        self.expected.pop((transfer_id, generation), None)

    # -- warm: a hot loop while a transfer with us is expected --------------------------
    def warm_for(self, key, until: float) -> None:
        """Spin (when warm is on) until ``key``'s transfer is done or ``until`` (the cap: a
        lost request cannot keep us spinning); the first cap of a key holds."""
        if self.enabled:
            self.warm.setdefault(key, until)

    def cool(self, key) -> None:
        self.warm.pop(key, None)
        if self._beat_keys:
            for agent in [a for a, keys in self._beat_keys.items() if key in keys]:
                self._beat_keys[agent].discard(key)
                if not self._beat_keys[agent]:
                    del self._beat_keys[agent]

    # -- keep-warm WRITEs ---------------------------------------------------------------
    def beat_for(self, key, agent: str) -> None:
        """While ``key`` stays warm, keep our WRITE path to ``agent`` warm (``beat``)."""
        host = self.host
        peer = host.peers.by_agent.get(agent)
        if key in self.warm and peer is not None and peer.sink_addr and self.beat_ms > 0:
            if host.device_uuid and peer.device_uuid == host.device_uuid:
                # P and D share the GPU: the beats' copies ran beside P's prefill and slowed it
                # 15 % (8k prompt, qwen3-8b, H200: 299.7 against 260.9 ms), for a post that costs
                # little on one device anyway
                host.counters["warm_beats_same_gpu_skipped"] += 1
                return
            self._beat_keys.setdefault(agent, set()).add(key)

    def beat(self, now: float) -> None:
        """Every ``beat_ms``, a WRITE of BEAT_BYTES from the start of our memory into each
        expected peer's sink (memory no request owns, so the bytes matter to no one): what a
        post costs depends on how long ago the last one was, and a real WRITE is coming."""
        if not (self._beat_keys or self._beats):
            return
        host = self.host
        for agent, h in list(self._beats.items()):
            pending, failure = host.nixl.reap([h], "keep-warm WRITE failed")
            if not pending:
                del self._beats[agent]
                if failure:
                    host.counters["warm_beats_failed"] += 1
        for agent in list(self._beat_keys):
            peer = host.peers.by_agent.get(agent)
            if agent in self._beats or peer is None or now - self._last_beat.get(agent, 0.0) < self.beat_ms / 1e3:
                continue
            self._last_beat[agent] = now
            n = min(BEAT_BYTES, peer.sink_bytes, host.memory.nbytes)
            try:
                self._beats[agent] = host.nixl.post("WRITE", [(0, 0, n)], host.memory.base_addr, agent,
                                                    peer.sink_addr, remote_dev=peer.dev_id)
                host.counters["warm_beats"] += 1
            except Exception as e:  # a dead peer: its transfers fail on their own deadlines
                host.counters["warm_beats_failed"] += 1
                log.debug("%s: keep-warm WRITE to %s failed: %s", host.name, agent, e)

    # -- the poll timeout -----------------------------------------------------------------
    def poll_timeout_ms(self, now: float, inflight: Iterable[InFlight], pending: bool, last_activity: float) -> int:
        """How long the loop may sleep: 0 (spinning) while a transfer is young, announced or
        expected, else ``poll.py``'s rates for ``pending`` work and since ``last_activity``."""
        for table in (self.expected, self.warm):  # overstayed (slow, lost): no more spinning for it
            if table:
                for k in [k for k, t in table.items() if t <= now]:
                    del table[k]
        p = poll_ms(now, expected_until=max(self.expected.values(), default=None),
                    inflight_until=max((fl.posted + spin_s(fl.nbytes) for fl in inflight), default=None),
                    warm_until=max(self.warm.values(), default=None), pending=pending, last_activity=last_activity)
        if p.ms == 0:
            if p.why == "warm":
                self.host.counters["warm_spins"] += 1
            return _spin()
        return p.ms


def _spin() -> int:
    """Poll again at once, but let a runnable process on this core go first: on a
    crowded host the peer whose progress we wait for may be the one waiting for the core."""
    os.sched_yield()
    return 0
