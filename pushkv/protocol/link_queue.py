"""One link's transfer queue: which queued WRITE part goes on the wire next, and when.

Over a slow link (UCX over TCP, a capped NIC), WRITEs that overlap on one link share it badly:
on one H200 with UCX TCP from GPU memory one transfer moved 0.45 GB/s, and 2-8 overlapping
ones together moved 0.24-0.29 GB/s (issue 27). Every request then finishes late. A queue per
link posts under a bounded in-flight window instead, so each transfer runs at the link's rate
and the earliest requests finish first.

Pure: no socket, NIXL or clock. The writer ``offer``s each post it has planned (its size
known), posts what the call returns, tells ``done`` when a post ends (completed or failed),
and posts what that returns; ``drop`` takes a transfer's queued posts out (cancelled, expired,
its peer gone) so the writer can end them without posting.

**A request's next post first.** A request's last WRITE is asked only once its parts have
landed, so the room its last part leaves would go to the next request's part before the last
WRITE is even offered, and the last WRITE would wait for that whole part (119 ms at 300 Mbit/s
on the CPU, measured). So the room of a post that ended can wait to be handed out:
``done(id, release=False)`` frees it and hands out nothing, and ``release()`` hands it out
once the writer has heard what the end asks for (the last WRITE offered meanwhile ranks first
by ``arrival``). A post that needs work before it can be offered (its bytes copied into the
staging area) keeps the room for its request: ``hold(key)`` counts as a post in flight until the
request offers its next post, which takes the next room whatever the order, or ``unhold(key)``.
Rooms kept for several requests go in the order they were kept: the first goes whenever the
window has a room, the next once one more is free. (Each kept room counted against every post,
its own included, so two last WRITEs held on a window of one waited for each other forever: every
transfer on that link then failed at its deadline, on the H200 over a capped link.)

The window bounds the posts in flight (``max_parts``) and their bytes (``max_bytes``); 0 leaves
either unbounded. An idle link always takes the next post, however large, so a post bigger
than the byte bound still goes (alone). Which queued post goes next is the ``order``:

- ``arrival``: requests in the order they reached the link (first come, first served): a post
  ranks by its request's first offer (``since``), so a request's later parts and its last WRITE go
  before the parts of requests that came after it; posts that give no ``since`` go in the order
  offered. A request's last WRITE (``last``: the post that ends its transfer, one unit with D's
  notice) goes before every part, whatever its request's rank: it ends a request for the cost of
  one unit. (Ranked by ``since`` alone, the last WRITE of a request prefilled in one step with
  another waited for the other's whole part when the other's first post had been offered a
  moment sooner: 230-463 ms at 300 Mbit/s on the CPU.) (Ranked by each post's own offer, the
  parts of requests in flight together would alternate, and each would finish as late as the
  last: a 4k request's one-unit last WRITE waited 219 ms behind a later request's parts over
  25 Gbit/s.)
- ``shortest``: the post whose request has the fewest bytes left to move (``remaining``), so
  short prompts are not stuck behind long ones;
- ``deadline``: the earliest ``deadline`` (the writer passes when the request's transfer must
  end by).

Ties go by arrival. The posts of one request never overtake each other here: the rendezvous
may have two parts of a request asked for at once (``rendezvous.PARTS_AHEAD``), and of a
request's queued posts only the one offered first may go next, whatever the order (under
``shortest`` its later part, having less of the prompt left, would otherwise go first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

from pushkv.kinds import LinkOrder

ORDERS: tuple[LinkOrder, ...] = ("arrival", "shortest", "deadline")


@dataclass(frozen=True)
class Window:
    """The most in flight on one link at a time: posts and bytes (0: unbounded)."""

    max_parts: int = 0
    max_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_parts < 0 or self.max_bytes < 0:
            raise ValueError(f"a link window is >= 0 posts and bytes (0: unbounded), not {self}")

    @property
    def unbounded(self) -> bool:
        return not self.max_parts and not self.max_bytes


@dataclass(frozen=True)
class LinkPost:
    """A post the writer has planned: ``post_id`` is the writer's own (unique while queued or in
    flight), ``key`` the transfer it belongs to (what ``drop`` matches)."""

    post_id: Hashable
    key: Hashable
    nbytes: int
    remaining: int = 0  # bytes the request has left to move, this post's included (order "shortest")
    deadline: float = 0.0  # when the request's transfer must end (order "deadline")
    since: float = 0.0  # when the request's first post was offered (order "arrival")
    last: bool = False  # it ends its request's transfer (order "arrival": before every part)


@dataclass
class LinkQueue:
    window: Window = field(default_factory=Window)
    order: LinkOrder = "arrival"
    _queued: list[tuple[int, LinkPost]] = field(default_factory=list)  # (arrival seq, post)
    _inflight: dict[Hashable, int] = field(default_factory=dict)  # post_id -> nbytes
    _held: dict[Hashable, None] = field(default_factory=dict)  # keys whose next post has a room kept, in order
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"link order {self.order!r} is not one of {', '.join(ORDERS)}")

    # -- events ---------------------------------------------------------------------------
    def offer(self, post: LinkPost) -> list[LinkPost]:
        """Queue ``post``; returns the posts to make now (it, others before it, or none)."""
        if post.nbytes < 0:
            raise ValueError(f"post {post.post_id!r}: nbytes {post.nbytes} < 0")
        if post.post_id in self._inflight or any(p.post_id == post.post_id for _, p in self._queued):
            raise ValueError(f"post {post.post_id!r} is already queued or in flight")
        self._queued.append((self._seq, post))
        self._seq += 1
        return self._release()

    def done(self, post_id: Hashable, release: bool = True) -> list[LinkPost]:
        """A post ended (completed or failed): its room in the window goes to the next ones
        (``release`` False: not yet; ``release()`` hands it out). An id not in flight (already
        ended) changes nothing."""
        if self._inflight.pop(post_id, None) is None or not release:
            return []
        return self._release()

    def release(self) -> list[LinkPost]:
        """The posts the window has room for now (after ``done(..., release=False)``)."""
        return self._release()

    def hold(self, key: Hashable) -> None:
        """Keep a room for transfer ``key``'s next post, which is on its way (its bytes being
        copied): it counts as a post in flight until ``key`` offers one, or ``unhold``."""
        self._held.setdefault(key)

    def unhold(self, key: Hashable) -> list[LinkPost]:
        """``key`` offers nothing after all (its transfer failed): its room goes to the next posts."""
        if key not in self._held:
            return []
        del self._held[key]
        return self._release()

    def drop(self, key: Hashable) -> list[LinkPost]:
        """Take transfer ``key``'s queued posts out (never posted: nothing to wait for); returns
        them. Its posts in flight stay until ``done``."""
        gone = [p for _, p in self._queued if p.key == key]
        if gone:
            self._queued = [(s, p) for s, p in self._queued if p.key != key]
        return gone

    # -- state ----------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def inflight_bytes(self) -> int:
        return sum(self._inflight.values())

    @property
    def held(self) -> int:
        return len(self._held)

    def __len__(self) -> int:
        return len(self._queued) + len(self._inflight) + len(self._held)

    # -- the choice -----------------------------------------------------------------------
    def _release(self) -> list[LinkPost]:
        out: list[LinkPost] = []
        ahead = 0  # rooms kept for earlier holds whose posts have not gone
        for key in list(self._held):  # each kept room goes to its request's post once it is here
            i = next((i for i, (_, p) in enumerate(self._queued) if p.key == key), None)
            if i is None or not self._fits(self._queued[i][1].nbytes, ahead):
                ahead += 1
                continue
            del self._held[key]
            post = self._queued.pop(i)[1]
            self._inflight[post.post_id] = post.nbytes
            out.append(post)
        while self._queued:
            i = self._next()
            post = self._queued[i][1]
            if not self._fits(post.nbytes, len(self._held)):
                break  # the window is full: the next post waits for a ``done``
            del self._queued[i]
            self._inflight[post.post_id] = post.nbytes
            out.append(post)
        return out

    def _next(self) -> int:
        """Index in the queue of the post the order picks (ties: the earliest offered)."""
        rank = _RANKS[self.order]
        heads: dict[Hashable, int] = {}  # each request's post offered first (the list is by arrival)
        for i, (_, p) in enumerate(self._queued):
            heads.setdefault(p.key, i)
        return min(heads.values(), key=lambda i: (rank(self._queued[i][1]), self._queued[i][0]))

    def _fits(self, nbytes: int, kept: int) -> bool:
        """A post of ``nbytes`` goes now, with ``kept`` rooms kept before it (holds)."""
        if not self._inflight and not kept:
            return True  # an idle link takes the next post, however large
        w = self.window
        if w.max_parts and len(self._inflight) + kept >= w.max_parts:
            return False
        return not (w.max_bytes and self.inflight_bytes + nbytes > w.max_bytes)


_RANKS = {
    "arrival": lambda p: (not p.last, p.since),
    "shortest": lambda p: p.remaining or p.nbytes,
    "deadline": lambda p: p.deadline,
}


# auto's window on a slow link: P's WRITEs one at a time (overlapping WRITEs share it badly); pull's READs
# from one P two at a time (push's late allocations READ one at a time, on the stream of P's WRITEs).
# Over UCX's TCP lanes from GPU memory (the H200, a veth capped at 25 Gbit/s, pull-background at 0.9 of
# the link, 12 prompts; docs/results/2026-12-03-read-queue) TTFT p50 was 4,549 (1k) and 18,438 ms (8k)
# with every READ posted at once, 3,173 and 18,960 one at a time (each waited for the one before to be
# seen done: 0.52 s a 1k READ against 0.37 in a batch), 2,886 and 16,257 two at a time.
AUTO_WINDOW = {"write": 1, "read": 2}


def window_of(parts: int, mib: int, slow_link: bool, op: str = "write") -> Optional[Window]:
    """The window a writer uses from its config: ``parts`` posts in flight per link (0 = auto:
    ``AUTO_WINDOW[op]`` on a slow link, else unbounded) and ``mib`` MiB (0: no byte bound). None:
    no queue at all (every post goes at once, as on a fast link)."""
    if parts < 0 or mib < 0:
        raise ValueError(f"link window: {parts} posts, {mib} MiB; each >= 0 (0: auto / unbounded)")
    if parts == 0:
        parts = AUTO_WINDOW[op] if slow_link else 0
    w = Window(parts, mib * 2**20)
    return None if w.unbounded else w
