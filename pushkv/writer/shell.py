"""The shell every writer shares, pushkv's (``base.py``) and the vLLM connector's: an actor
that holds three parts and calls them.

- ``peers`` (``peers.Peers``): the peer table and the handshakes;
- ``posting`` (``posting.Posting``): NIXL posts, notifications, transfers in flight;
- ``warmup`` (``warm.WarmUp``): wake hints, warm spinning, keep-warm beats, the poll timeout.

Here are only what joins them: the handshake and control messages forwarded to the part
that owns them, one turn of the loop (``tick``), one teardown, and the hooks a role fills
in (what our Hello is and what a peer's means, ``transfer_finished``, ``expire``,
``has_pending``). The roles' decisions are the pure sides (``sides.py``,
``receive_side.py``); a writer shell carries out their effects.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Optional

import zmq

from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.protocol import actions as A
from pushkv.security import is_network
from pushkv.supervisor.lifecycle import parent_death_signal
from pushkv.transport.nixl_agent import NixlAgent
from pushkv.writer import sides
from pushkv.writer.memory import Memory
from pushkv.writer.peers import Peer, Peers
from pushkv.writer.posting import InFlight, Posting
from pushkv.writer.warm import BEAT_MS, WarmUp

log = logging.getLogger(__name__)


class WriterShell(Actor):
    """A role sets ``engine_id``, ``rank``, ``model_id`` before the loop runs, and ``nixl``,
    ``memory`` (and ``peers.handshake``, our ROUTER) in its setup."""

    engine_id: str
    rank: int
    model_id: str
    nixl: NixlAgent
    hello_decoder: Any = m.DEC_HANDSHAKE  # what a handshake link carries (our Hello's kind)

    def __init__(self, name: str, *args: Any, warm: bool = False, beat_ms: float = BEAT_MS, watch_links: bool = False,
                 stuck_s: float = 60.0, **kwargs: Any):
        super().__init__(name, *args, **kwargs)
        self.memory = Memory(0, 0, None)  # what NIXL registered, once the role's setup did
        self.device_uuid = ""  # our memory's GPU ("" on the CPU)
        self.stuck_s = stuck_s  # an InFlight older than this is abandoned (a peer that vanished mid-transfer)
        self.last_activity = 0.0  # a message or transfer moved: the poll stays fast a while
        self.parent_pid = 0  # watch_parent: the process whose death ends ours
        self.peers = Peers(self, watch_links)
        self.posting = Posting(self)
        self.warmup = WarmUp(self, warm, beat_ms)

    # -- what the role says ------------------------------------------------------------
    def hello(self) -> Any:
        raise NotImplementedError

    def check_peer(self, h: Any) -> None:
        """Raise ValueError when ``h``'s memory cannot pair with ours."""

    def peer_of(self, h: Any, agent: str) -> Peer:
        raise NotImplementedError

    def grid_of_peer(self, h: Any) -> Any:
        """The descriptor grid of the peer's memory (None: none; its transfers build descriptors)."""
        return None

    def peer_added(self, peer: Peer, h: Any) -> None:
        self.posting.peer_added(peer, h)

    def peer_forgotten(self, peer: Peer) -> None:
        self.warmup.peer_forgotten(peer)

    def peer_gone(self, peer: Peer, reason: str) -> None:
        """A watched link closed (``watch_links``), or the peer dropped us: its process is gone."""

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        raise NotImplementedError

    def handles_ended(self, handles: list, now: float) -> None:
        """These handles' transfers ended (done, failed or abandoned): a link queue's room."""

    def release_links(self) -> None:
        """After ``handles_ended`` and the ends' ``transfer_finished``: a link queue's rooms go out."""

    def expire(self, now: float) -> None:
        """The role's own deadlines."""

    def has_pending(self) -> bool:
        """Something waits on a deadline or a notification: poll at the pending rate."""
        return False

    # -- setup ----------------------------------------------------------------------------
    def bind_handshake(self, endpoint: str, max_msg_bytes: int = 0) -> None:
        """Our handshake ROUTER, where peers' Hellos arrive. A refusal says why only to whoever
        reaches it over an authenticated channel (CURVE, or an ipc:// file in the 0700 run dir)."""
        hs = self.socket(zmq.ROUTER, endpoint, bind=True, max_msg_bytes=max_msg_bytes)
        self.peers.handshake = self.add_channel(hs, self.hello_decoder, "peer-handshake", routed=True)
        self.peers.authenticated = self.security is not None or not is_network(endpoint)

    # -- effects every shell carries out alike ----------------------------------------------
    def count_or_tell(self, e: Any, tell: Callable[[Peer, m.Msg], None]) -> bool:
        """Carry out a side's ``A.Count`` or ``sides.Tell`` (by ``tell``, to a peer still
        connected); False for any other effect."""
        if isinstance(e, A.Count):
            self.counters[e.name] += 1
        elif isinstance(e, sides.Tell):
            peer = self.peers.get(e.peer)
            if peer is not None:
                tell(peer, e.msg)
        else:
            return False
        return True

    # -- messages, to the part that owns them --------------------------------------------
    def on_Hello(self, msg: Any, identity: Optional[bytes] = None) -> None:
        self.peers.on_hello(msg, identity)

    def on_HelloRefused(self, msg: m.HelloRefused, identity: Optional[bytes] = None) -> None:
        self.peers.on_refused(msg, identity)

    def on_TransferStarting(self, msg: m.TransferStarting, identity: Optional[bytes] = None) -> None:
        self.warmup.on_transfer_starting(msg, identity)

    def on_Register(self, msg: m.Register, identity: Optional[bytes] = None) -> None:
        self.posting.on_control(msg, identity)

    def on_CancelTransfer(self, msg: m.CancelTransfer, identity: Optional[bytes] = None) -> None:
        self.posting.on_control(msg, identity)

    def on_WriteFailed(self, msg: m.WriteFailed, identity: Optional[bytes] = None) -> None:
        self.posting.on_control(msg, identity)

    # -- the loop ---------------------------------------------------------------------------
    def watch_parent(self, pid: int) -> None:
        """End with process ``pid`` (the one that started us): SIGTERM at its death, even by
        SIGKILL, where the kernel offers it; its pid checked every tick besides."""
        self.parent_pid = pid
        if not parent_death_signal(signal.SIGTERM):
            log.warning("%s: cannot ask for a signal at process %d's death; its pid is watched", self.name, pid)

    def tick(self, now: float) -> None:
        """Every writer's turn of the loop: keep-warm beats, NIXL's notifications, the
        transfers in flight, the handshakes, then the role's own deadlines (``expire``)."""
        self.warmup.beat(time.perf_counter())
        self.posting.poll_notifs(now)
        if self.posting.inflight:
            self.posting.check(now)
        self.peers.expire(now)
        self.expire(now)
        if self.parent_pid and os.getppid() != self.parent_pid:
            log.error("%s: process %d that started us is gone; exiting", self.name, self.parent_pid)
            self.stopping = True

    def poll_timeout_ms(self) -> int:
        return self.warmup.poll_timeout_ms(time.monotonic(), self.posting.inflight.values(), self.has_pending(),
                                           self.last_activity)

    def teardown(self) -> None:
        """Every writer's end: its handshake links closed, its transfers and beats released,
        its memory deregistered from NIXL."""
        self.peers.close_links()
        if getattr(self, "nixl", None) is not None:
            self.posting.release_all()
            self.warmup.release_beats()
            self.nixl.deregister()
