"""P's writer's link queues: the pure per-link queue (``protocol/link_queue.py``) for every D rank
it writes into, with what the writer needs to post each queued WRITE once it is released.

The writer ``offer``s a planned post (``posting.SpanPost`` and its bookkeeping, opaque here) and
posts what comes back; ``sent`` ties the posted handle to its link, so that when the handle ends
(``ended``) the link's room goes to the next posts; ``drop`` takes a failed transfer's queued
posts out. No NIXL call, socket or clock here either: the writer makes them.
"""
from __future__ import annotations

import itertools
from typing import Any, Hashable

from pushkv.kinds import LinkOrder
from pushkv.protocol.link_queue import LinkPost, LinkQueue, Window

Link = tuple[str, int]  # (D engine id, D rank)
Released = tuple[Link, Hashable, Any]  # (its link, post id, the writer's post)


class LinkPosts:
    def __init__(self, window: Window, order: LinkOrder):
        self.window = window
        self.order = order
        self.queues: dict[Link, LinkQueue] = {}
        self._posts: dict[Hashable, Any] = {}  # post id -> the writer's post, while queued
        self._handles: dict[int, tuple[Link, Hashable]] = {}  # id(handle) -> (link, post id), while in flight
        self._ids = itertools.count()
        self.peak = 0  # the most posts on one link at once (the window holds: <= its max_parts)

    def offer(self, link: Link, key: Hashable, nbytes: int, remaining: int, deadline: float, since: float,
              post: Any, last: bool = False) -> list[Released]:
        pid = next(self._ids)
        self._posts[pid] = post
        return self._take(link, self._queue(link).offer(LinkPost(pid, key, nbytes, remaining, deadline, since, last)))

    def sent(self, link: Link, pid: Hashable, handle: Any) -> None:
        self._handles[id(handle)] = (link, pid)

    def ended(self, handle: Any, release: bool = True) -> list[Released]:
        """``handle``'s transfer ended: what its link posts next (nothing for a handle posted
        without the queue; ``release`` False: nothing yet, ``release()`` hands its room out)."""
        found = self._handles.pop(id(handle), None)
        return self.done(*found, release=release) if found else []

    def done(self, link: Link, pid: Hashable, release: bool = True) -> list[Released]:
        """Post ``pid`` ended, or never went (its post failed, or was skipped)."""
        q = self.queues.get(link)
        return self._take(link, q.done(pid, release)) if q else []

    def release(self) -> list[Released]:
        """What every link has room for now (the rooms that ``ended(..., release=False)`` freed)."""
        return [r for link, q in self.queues.items() for r in self._take(link, q.release())]

    def hold(self, link: Link, key: Hashable) -> None:
        """Keep a room on ``link`` for transfer ``key``'s next post (being copied for it)."""
        self._queue(link).hold(key)

    def unhold(self, link: Link, key: Hashable) -> list[Released]:
        """``key``'s post is not coming (its transfer failed): the room goes to the next posts."""
        q = self.queues.get(link)
        return self._take(link, q.unhold(key)) if q else []

    def drop(self, key: Hashable) -> list[Any]:
        """Transfer ``key``'s posts still queued on any link: out, never to be posted."""
        out = []
        for q in self.queues.values():
            out += [self._posts.pop(p.post_id) for p in q.drop(key)]
        return out

    def gauges(self) -> dict[str, int]:
        return {"link_queued": sum(q.queued for q in self.queues.values()),
                "link_inflight": sum(q.inflight for q in self.queues.values()), "link_inflight_peak": self.peak}

    def _queue(self, link: Link) -> LinkQueue:
        q = self.queues.get(link)
        if q is None:
            q = self.queues[link] = LinkQueue(self.window, self.order)
        return q

    def _take(self, link: Link, released: list[LinkPost]) -> list[Released]:
        if released:
            self.peak = max(self.peak, self.queues[link].inflight)
        return [(link, p.post_id, self._posts.pop(p.post_id)) for p in released]

