"""Messages bounded as wholes on every socket.

``MAXMSGSIZE`` (set on each socket, ``pushkv.limits``) bounds one frame; a peer could still send
64 frames of 4 MiB as one 264 MB message, and ``recv_multipart`` would hold it all. Here a message is
read frame by frame: every frame is taken off the socket (a message is atomic, the rest must go),
but past the channel's shape (how many frames its messages have, how many bytes in all) no frame is
kept, and the whole message is dropped, counted and logged once per interval.

A channel's shape follows from its socket type: a ROUTER's messages carry the sender's identity and
may carry a REQ's empty delimiter, a SUB's a topic, a DEALER's may carry a delimiter; the bytes are
the socket's own ``MAXMSGSIZE`` for the payload, plus a little for those envelope frames.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Optional

import zmq

log = logging.getLogger(__name__)

ENVELOPE_BYTES = 1024  # identity (<= 255 by ZMTP), delimiter, topic
UNBOUNDED_BYTES = 4 << 20  # a socket without MAXMSGSIZE: limits.CONTROL_MSG_BYTES
LOG_EVERY_S = 10.0
FRAMES_BY_TYPE: dict[int, int] = {zmq.ROUTER: 3, zmq.SUB: 2, zmq.XSUB: 2, zmq.DEALER: 2}  # else 1


class Shape:
    """The most frames and bytes one message on a socket may have."""

    __slots__ = ("frames", "nbytes")

    def __init__(self, frames: int, nbytes: int):
        self.frames = frames
        self.nbytes = nbytes

    @classmethod
    def of(cls, sock: zmq.Socket) -> "Shape":
        cap = int(sock.getsockopt(zmq.MAXMSGSIZE))
        frames = FRAMES_BY_TYPE.get(int(sock.type), 1)
        return cls(frames, (cap if cap > 0 else UNBOUNDED_BYTES) + ENVELOPE_BYTES)


def judge(sizes_so_far: int, nframes: int, shape: Shape) -> str:
    """Why a message of ``nframes`` frames and ``sizes_so_far`` bytes is past ``shape`` ("" if it is not)."""
    if nframes > shape.frames:
        return "frames"
    if sizes_so_far > shape.nbytes:
        return "bytes"
    return ""


class Drops:
    """Counts dropped messages into a process's counters and logs them at most once per
    ``LOG_EVERY_S`` per socket (a flood of them must not become a flood of log lines)."""

    def __init__(self, owner: str, counters: Optional[Counter] = None):
        self.owner = owner
        self.counters: Counter = counters if counters is not None else Counter()
        self._logged: dict[str, float] = {}
        self._since: Counter = Counter()

    def drop(self, peer: str, why: str, nframes: int, nbytes: int, shape: Shape) -> None:
        self.counters[f"msg_dropped_{why}"] += 1
        self._since[peer] += 1
        now = time.monotonic()
        if now - self._logged.get(peer, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[peer] = now
            log.error("%s: dropped a message from %s: %d frames, %d bytes (its shape: at most %d frames, %d bytes); "
                      "%d dropped from it since the last such line", self.owner, peer, nframes, nbytes, shape.frames,
                      shape.nbytes, self._since.pop(peer))


class _Gather:
    """One message's frames as they come off a socket, kept while the message fits ``shape``."""

    __slots__ = ("shape", "frames", "n", "total", "why")

    def __init__(self, first: bytes, shape: Shape):
        self.shape = shape
        self.frames: Optional[list[bytes]] = [first]
        self.n, self.total, self.why = 1, len(first), ""

    def add(self, part: bytes) -> None:
        self.n, self.total = self.n + 1, self.total + len(part)
        self.why = self.why or judge(self.total, self.n, self.shape)
        if self.why:
            self.frames = None
        elif self.frames is not None:
            self.frames.append(part)

    def result(self) -> tuple[Optional[list[bytes]], str, int, int]:
        self.why = self.why or judge(self.total, self.n, self.shape)
        return (None if self.why else self.frames), self.why, self.n, self.total


def recv_bounded(sock: zmq.Socket, shape: Shape, flags: int = 0) -> tuple[Optional[list[bytes]], str, int, int]:
    """One whole message: (frames, "", n, bytes), or (None, why, n, bytes) when it is past ``shape``
    (every frame of it read, none kept past the point it went over). zmq.Again as ``recv``."""
    g = _Gather(sock.recv(flags), shape)
    while sock.getsockopt(zmq.RCVMORE):
        g.add(sock.recv())  # the rest of a message is there once its first frame is
    return g.result()


async def arecv_bounded(sock, shape: Shape) -> tuple[Optional[list[bytes]], str, int, int]:
    """``recv_bounded`` for a zmq.asyncio socket."""
    g = _Gather(await sock.recv(), shape)
    while sock.getsockopt(zmq.RCVMORE):
        g.add(await sock.recv())
    return g.result()
