"""A writer's peers: the handshake that makes one, and the forgetting of a dead one.

A part of every writer shell (``shell.py``), pushkv's and the vLLM connector's: the shell
holds one :class:`Peers` and forwards the handshake messages to it.

A handshake is a ZMQ DEALER -> ROUTER exchange of Hellos, once per peer rank: NIXL
metadata, the memory the peer registered and how it is laid out, its wire version and
model (both must match ours, else ``HelloRefused`` names both sides' values). It runs on
the loop, never blocking it: ``start_link`` sends our Hello, the answer arrives as any
message does (``on_hello``), a silent peer fails at its deadline (``expire``), and
``when_connected`` runs a request's continuation once every rank it needs is connected,
while every other message is handled meanwhile. The link stays open afterwards as our
channel to that peer (wake hints; a socket monitor on it tells the vLLM writer when the
peer is gone).

What a Hello carries beside the common fields, and whether two writers' memories are
compatible, is the shell's own (``hello``, ``check_peer``, ``peer_of``): pushkv's pools or
vLLM's KV cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.actor import Channel
from pushkv.kv.layout import MAX_TP
from pushkv.transport.grid import DescGrid
from pushkv.transport.nixl_agent import NixlAgent

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
GENERIC_REFUSAL = "refused"  # all an unauthenticated peer is told
ADDRESS_LIMIT = 1 << 64  # a Hello's addresses are a 64-bit process's
DEVICE_LIMIT = 1 << 16
SINK_BYTES_MAX = 1 << 20  # a keep-warm sink is a small buffer (warm.BEAT_BYTES); ours is far below this
DROPPED = "dropped: "  # a HelloRefused on a connected link: the peer forgot us (the rest says why)


def hello_problem(h: Any) -> str:
    """Why the numbers of a Hello (pushkv's or the vLLM connector's) cannot be a peer's ("" when
    they can): each is bounded before anything is sized, indexed or posted by it."""
    tp, rank = getattr(h, "tp", 1), getattr(h, "rank", 0)
    if not 1 <= tp <= MAX_TP:
        return f"tp={tp} is outside 1..{MAX_TP}"
    if not 0 <= rank < tp:
        return f"rank {rank} is outside 0..{tp - 1}"
    for name in ("pool_base", "sink_addr"):
        if not 0 <= getattr(h, name, 0) < ADDRESS_LIMIT:
            return f"{name}={getattr(h, name)} is not a 64-bit address"
    if not 0 <= getattr(h, "device_id", 0) < DEVICE_LIMIT:
        return f"device_id={h.device_id} is outside 0..{DEVICE_LIMIT - 1}"
    if not 0 <= getattr(h, "sink_bytes", 0) <= SINK_BYTES_MAX:
        return f"sink_bytes={h.sink_bytes} is outside 0..{SINK_BYTES_MAX}"
    return ""

PeerKey = tuple[str, int]  # (engine_id, rank)


@dataclass
class Peer:
    engine_id: str
    rank: int
    tp: int
    agent: str
    pool_base: int  # the base address of the memory it registered
    layout: Any  # how that memory is laid out: a pushkv pool layout, or vLLM's KVMemory
    dev_id: int = 0
    grid: Optional[DescGrid] = None  # its pool's descriptor grid, prepared in NIXL (None: ad-hoc only)
    identity: Optional[bytes] = None  # its DEALER's identity at our handshake ROUTER (it initiated)
    plans: dict = field(default_factory=dict)  # (heads, we send) -> IndexPlan or None (grid.index_plan)
    sink_addr: int = 0  # its keep-warm sink (Hello.sink_addr); 0: none
    sink_bytes: int = 0
    device_uuid: str = ""  # its pool's GPU (Hello.device_uuid)
    post_agent: str = ""  # the agent its WRITEs come from, when not ``agent`` (Hello.post_agent)


@dataclass
class PeerLink:
    """A handshake we initiated: a DEALER to the peer's handshake ROUTER, kept open once
    answered as the channel for wake hints to that peer."""

    engine_id: str
    rank: int
    endpoint: str
    channel: Channel
    deadline: float
    connected: bool = False
    monitor: Optional[zmq.Socket] = None  # EVENT_DISCONNECTED of the link (watch_links)


@dataclass
class PeerWait:
    """Something (a request) waiting for handshakes with ``keys`` ((engine_id, rank))."""

    key: object
    keys: tuple
    then: Callable[[list], None]
    failed: Callable[[str], None]


class PeerHost(Protocol):
    """What :class:`Peers` asks of its shell: the actor's sockets, our identity and NIXL agent,
    what our Hello is and what a peer's means, and the hooks of a peer's life."""

    name: str
    counters: Any
    engine_id: str
    rank: int
    model_id: str
    nixl: NixlAgent
    current: Optional[Channel]
    channels: dict
    poller: Any
    hello_decoder: Any  # what a handshake link carries (our Hello's kind)

    def socket(self, kind: int, endpoint: str, bind: bool, max_msg_bytes: int = 0) -> zmq.Socket: ...
    def add_channel(self, sock: zmq.Socket, decoder: Any, peer: str, routed: bool = False) -> Channel: ...
    def send(self, ch: Channel, msg: Any, identity: Optional[bytes] = None) -> None: ...
    def hello(self) -> Any: ...
    def check_peer(self, h: Any) -> None: ...
    def peer_of(self, h: Any, agent: str) -> Peer: ...
    def peer_added(self, peer: Peer, h: Any) -> None: ...
    def peer_forgotten(self, peer: Peer) -> None: ...
    def peer_gone(self, peer: Peer, reason: str) -> None: ...


class Peers:
    """The peer table and the handshakes of one writer. The shell sets ``handshake`` (our
    ROUTER, or None) in its setup; ``watch_links``: monitor each link for the peer's end
    closing (``peer_gone``)."""

    def __init__(self, host: PeerHost, watch_links: bool = False):
        self.host = host
        self.watch_links = watch_links
        self.table: dict[PeerKey, Peer] = {}
        self.by_agent: dict[str, Peer] = {}
        self.links: dict[PeerKey, PeerLink] = {}  # handshakes we initiated
        self.waits: dict[object, PeerWait] = {}  # requests waiting for handshakes
        self._link_failed: dict[PeerKey, str] = {}  # failures not yet told to waits
        self.handshake: Optional[Channel] = None
        # whether whoever reaches our handshake ROUTER is one of ours (CURVE with the deployment's secret,
        # or an ipc:// file in the 0700 run dir): only then does a refusal say why; anyone else learns
        # nothing of our model or layout from it (the reason goes to our log only)
        self.authenticated = False

    # -- the table, read as a mapping (engine id, rank) -> Peer ------------------------------
    def get(self, key: PeerKey) -> Optional[Peer]:
        return self.table.get(key)

    def __getitem__(self, key: PeerKey) -> Peer:
        return self.table[key]

    def __contains__(self, key: object) -> bool:
        return key in self.table

    def __iter__(self) -> Iterator[PeerKey]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def values(self) -> list[Peer]:
        return list(self.table.values())

    # -- peers -------------------------------------------------------------------------
    def add(self, h: Any) -> Peer:
        """Load a peer from its Hello: ValueError if it differs from us in what must match."""
        host = self.host
        if h.wire_version != m.WIRE_VERSION:
            raise ValueError(f"wire version differs: ours {m.WIRE_VERSION}, {h.engine_id} rank {h.rank}'s "
                             f"{h.wire_version}")
        if h.model_id != host.model_id:
            raise ValueError(f"model differs: ours {host.model_id}, {h.engine_id} rank {h.rank}'s "
                             f"{h.model_id or 'unnamed'} (every instance must serve the same model, geometry "
                             "and dtype)")
        why = hello_problem(h)
        if why:
            raise ValueError(f"{h.engine_id} rank {h.rank}'s Hello: {why}")
        host.check_peer(h)
        old = self.table.get((h.engine_id, h.rank))
        if old is not None:  # the peer restarted (on_hello checked its old link is gone): drop its old metadata
            self.forget(old)
        agent = host.nixl.add_remote(h.agent_metadata)
        peer = host.peer_of(h, agent)
        host.peer_added(peer, h)
        self.table[(h.engine_id, h.rank)] = peer
        self.by_agent[agent] = peer
        if peer.post_agent:  # its WRITEs' notifications come from its poster
            self.by_agent[peer.post_agent] = peer
        log.info("%s: connected to %s rank %d (agent %s)", host.name, h.engine_id, h.rank, agent)
        return peer

    def forget(self, peer: Peer, tell: str = "") -> None:
        """Drop a peer (dead, or restarted): its link, its NIXL metadata; waits on it fail. With
        ``tell``, a peer that handshook with us (it may still live: the router lost sight of it)
        hears that it was dropped, so it handshakes again rather than post to a writer that no
        longer knows it (``on_refused``)."""
        if tell and peer.identity is not None and self.handshake is not None:
            self.host.send(self.handshake, self.refusal(DROPPED + tell), peer.identity)
        self.close_link((peer.engine_id, peer.rank))  # a restarted peer gets a fresh handshake
        self.host.peer_forgotten(peer)
        self.table.pop((peer.engine_id, peer.rank), None)
        self.by_agent.pop(peer.agent, None)
        if peer.post_agent:
            self.by_agent.pop(peer.post_agent, None)
        self.host.nixl.remove_remote(peer.agent)
        if self.waits:
            self._resolve_waits()

    def refusal(self, reason: str) -> m.HelloRefused:
        return m.HelloRefused(self.host.engine_id, self.host.rank, reason)

    # -- a handshake a peer initiated, or the answer to ours ------------------------------
    def on_hello(self, msg: Any, identity: Optional[bytes] = None) -> None:
        host = self.host
        if identity is None:  # the answer on a link we opened
            self._link_answered(msg)
            return
        old = self.table.get((msg.engine_id, msg.rank))
        if old is not None and old.identity != identity and self._peer_live(old):
            # a live peer is never replaced by whoever names it (a Hello with D's engine id made P
            # forget the real D); a restarted one is: its old link is gone, or it was reported dead
            host.counters["peer_displace_refused"] += 1
            log.error("%s: refusing a Hello naming %s rank %d: that peer is connected and alive", host.name,
                      msg.engine_id, msg.rank)
            if self.handshake is not None:
                why = f"{msg.engine_id} rank {msg.rank} is already connected"
                host.send(self.handshake, self.refusal(why if self.authenticated else GENERIC_REFUSAL), identity)
            return
        try:  # a peer initiated the handshake: load its metadata, answer with ours
            peer = self.add(msg)
            peer.identity = identity  # our way back to it over the ROUTER (wake hints)
        except Exception as e:  # refused (or its metadata would not load): the reason, not our NIXL metadata
            log.error("%s: refusing peer %s rank %d: %s", host.name, msg.engine_id, msg.rank, e)
            host.counters["peer_incompatible" if isinstance(e, ValueError) else "peer_metadata_failed"] += 1
            if self.handshake is not None:
                host.send(self.handshake, self.refusal(str(e) if self.authenticated else GENERIC_REFUSAL), identity)
            return
        if self.handshake is not None:
            host.send(self.handshake, host.hello(), identity)

    def on_refused(self, msg: m.HelloRefused, identity: Optional[bytes] = None) -> None:
        """The peer refused our Hello: fail the link now, with its reason, not at the deadline.
        On a connected link: the peer dropped us (``forget(tell=)``); forget it too, so the
        next request with it handshakes again."""
        host = self.host
        link = self._current_link()
        if link is None or identity is not None:
            host.counters["unexpected_hello"] += 1
            return
        if link.connected:
            peer = self.table.get((link.engine_id, link.rank))
            host.counters["peer_dropped_us"] += 1
            log.warning("%s: %s rank %d dropped us (%s): handshaking again on the next request", host.name,
                        link.engine_id, link.rank, msg.reason)
            if peer is not None:
                self.forget(peer)
                host.peer_gone(peer, f"{link.engine_id} rank {link.rank} dropped us: {msg.reason}")
            return
        host.counters["peer_refused_us"] += 1
        self._fail_link(link, f"refused by {msg.engine_id} rank {msg.rank}: {msg.reason}")
        self._resolve_waits()

    def _peer_live(self, peer: Peer) -> bool:
        """Whether a known peer still holds its connection with us: our link to it is up, or the
        handshake ROUTER can still route to the DEALER it handshook from (probed with our Hello,
        which a connected link takes as an unexpected one and ignores)."""
        link = self.links.get((peer.engine_id, peer.rank))
        if link is not None and link.connected:
            return True
        if peer.identity is None or self.handshake is None:
            return False
        sock = self.handshake.sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an identity with no connection raises, not drops
        try:
            sock.send_multipart([peer.identity, m.encode(self.host.hello())], flags=zmq.DONTWAIT)
            return True
        except zmq.Again:  # connected, only slow to read
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise
        finally:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def from_peer(self, identity: Optional[bytes]) -> bool:
        """Whether the message being handled came from a peer we handshook with: over a link of
        ours that its Hello answered, or from the DEALER whose Hello we took."""
        return self.sender(identity) is not None

    def sender(self, identity: Optional[bytes]) -> Optional[Peer]:
        """The peer the message being handled came from (``from_peer``'s rule), or None."""
        if identity is None:
            link = self._current_link()
            return self.table.get((link.engine_id, link.rank)) if link is not None and link.connected else None
        return next((p for p in self.table.values() if p.identity == identity), None)

    def send_to(self, peer: Peer, msg: Any) -> bool:
        """Send ``msg`` to ``peer`` over the handshake link between us (ours to it, or its to our
        ROUTER); False when there is none."""
        link = self.links.get((peer.engine_id, peer.rank))
        if link is not None and link.connected:
            self.host.send(link.channel, msg)
        elif peer.identity is not None and self.handshake is not None:
            self.host.send(self.handshake, msg, peer.identity)
        else:
            return False
        return True

    def _current_link(self) -> Optional[PeerLink]:
        return next((lk for lk in self.links.values() if lk.channel is self.host.current), None)

    def _link_answered(self, msg: Any) -> None:
        link = self._current_link()
        if link is None or link.connected:
            self.host.counters["unexpected_hello"] += 1
            return
        try:
            if msg.engine_id != link.engine_id or msg.rank != link.rank:
                raise ValueError(f"handshake at {link.endpoint} answered by {msg.engine_id} rank {msg.rank}")
            self.add(msg)
            link.connected = True
        except ValueError as e:
            self.host.counters["peer_incompatible"] += 1
            self._fail_link(link, str(e))
        self._resolve_waits()

    # -- links we initiate -----------------------------------------------------------------
    def start_link(self, engine_id: str, rank: int, endpoint: str, now: float) -> None:
        """Send our Hello to a peer's handshake endpoint unless connected or under way; the
        answer arrives on the loop (``on_hello``), a silent peer fails at its deadline."""
        key = (engine_id, rank)
        if key in self.table or key in self.links:
            return
        host = self.host
        sock = host.socket(zmq.DEALER, endpoint, bind=False, max_msg_bytes=limits.CONTROL_MSG_BYTES)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if self.watch_links else None
        ch = host.add_channel(sock, host.hello_decoder, f"handshake-{engine_id}-{rank}")
        self.links[key] = PeerLink(engine_id, rank, endpoint, ch, now + HANDSHAKE_TIMEOUT_S, monitor=monitor)
        host.send(ch, host.hello())
        host.counters["handshakes_started"] += 1

    def when_connected(self, wait_key, engine_id: str, ranks, endpoints, then: Callable[[list[Peer]], None],
                       failed: Callable[[str], None], now: float) -> None:
        """Run ``then(peers)`` once every rank's handshake is done (now, if it is), or
        ``failed(reason)`` when one fails. Never blocks: other transfers go on meanwhile."""
        keys = tuple((engine_id, r) for r in ranks)
        for r in ranks:
            self.start_link(engine_id, r, endpoints[r], now)
        wait = PeerWait(wait_key, keys, then, failed)
        if not self._resolve(wait):
            self.waits[wait_key] = wait

    def when_source_connected(self, wait_key, src: m.PrefillSource, ranks_of: Callable[[int], list[int]],
                              then: Callable[[list[Peer]], None], failed: Callable[[str], None], now: float) -> None:
        """``when_connected`` with the ranks of P instance ``src`` we take KV from (``ranks_of(src.tp)``);
        ``failed(reason)`` at once for a source that cannot be one (a TP size that cannot shard the
        model, a rank with no handshake endpoint)."""
        try:
            ranks = ranks_of(src.tp)
        except ValueError as e:
            self.host.counters["bad_source"] += 1
            failed(f"bad prefill source {src.engine_id!r}: {e}")
            return
        bad = [r for r in ranks if r >= len(src.handshake)]
        if bad:
            failed(f"no handshake endpoint for rank(s) {bad} of {src.engine_id}")
            return
        self.when_connected(wait_key, src.engine_id, ranks, src.handshake, then, failed, now)

    def drop_wait(self, wait_key) -> bool:
        return self.waits.pop(wait_key, None) is not None

    def _resolve(self, wait: PeerWait) -> bool:
        """Run the wait's outcome if it has one; True when it ran."""
        bad = next((self._link_failed[k] for k in wait.keys if k in self._link_failed), None)
        lost = [k for k in wait.keys if k not in self.table and k not in self.links]
        if bad is None and lost:  # connected, then forgotten (its instance died) before the rest answered
            bad = f"lost {lost[0][0]} rank {lost[0][1]} during the handshake"
        if bad is not None:
            wait.failed(bad)
            return True
        if all(k in self.table for k in wait.keys):
            wait.then([self.table[k] for k in wait.keys])
            return True
        return False

    def _resolve_waits(self) -> None:
        for wk, wait in list(self.waits.items()):
            if self.waits.get(wk) is wait and self._resolve(wait):
                self.waits.pop(wk, None)
        self._link_failed.clear()  # the next request tries the handshake again

    def _fail_link(self, link: PeerLink, reason: str) -> None:
        log.error("%s: handshake with %s rank %d failed: %s", self.host.name, link.engine_id, link.rank, reason)
        self._link_failed[(link.engine_id, link.rank)] = reason
        self.close_link((link.engine_id, link.rank))

    def close_link(self, key: PeerKey) -> None:
        link = self.links.pop(key, None)
        if link is None:
            return
        if link.monitor is not None:
            link.channel.sock.disable_monitor()
            link.monitor.close(0)
        self.host.channels.pop(link.channel.sock, None)
        self.host.poller.unregister(link.channel.sock)
        link.channel.sock.close(0)

    def close_links(self) -> None:
        for key in list(self.links):
            self.close_link(key)

    def expire(self, now: float) -> None:
        """Fail handshakes past their deadline; with ``watch_links``, forget peers whose link closed."""
        if not self.links:
            return
        host = self.host
        late = [lk for lk in self.links.values() if not lk.connected and lk.deadline <= now]
        for link in late:
            host.counters["handshake_timeout"] += 1
            self._fail_link(link, f"handshake with {link.engine_id} rank {link.rank} at {link.endpoint} "
                                  f"timed out after {HANDSHAKE_TIMEOUT_S:.0f}s")
        if late:
            self._resolve_waits()
        for key, link in list(self.links.items()):
            if link.monitor is None or not link.connected or not link.monitor.poll(0):
                continue
            peer = self.table.get(key)
            if peer is not None:
                host.counters["peer_link_closed"] += 1
                reason = f"writer {peer.agent} lost (its connection closed)"
                log.error("%s: %s", host.name, reason)
                self.forget(peer)
                host.peer_gone(peer, reason)
