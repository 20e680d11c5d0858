"""One link between a P and a D as the planner sees it: the transfers on it share its rate, and
queues decide which go on it when (issue 27).

Pure: no clock, no socket. Time is passed in (ms); sizes are in any unit the caller keeps (the
simulation uses KV blocks, so the rate is blocks per ms).

- **Lanes.** Each lane is one ``protocol.link_queue.LinkQueue``, the very queue P's writer runs:
  a window (posts in flight) and an order (``arrival``, ``shortest``, ``deadline``). P's WRITEs
  go through one lane with the deployment's window; pull's READs (D's side) through another.
  A lane with an unbounded window posts everything at once.
- **Sharing.** Every transfer moving, of every lane, gets an equal share of the link's rate
  (processor sharing, as TCP streams through one bottleneck). When more than one is moving the
  link as a whole moves only ``overlap_share`` of one transfer's rate: over UCX's TCP lanes from
  GPU memory one WRITE moved 0.45 GB/s and 2-8 overlapping ones 0.24-0.29 GB/s together (issue
  27), about 0.6; over a tc-capped veth between host buffers they share it fully (1.0).
- **Streams.** Lanes may name one stream (one P's WRITEs and D's READs from that P: one endpoint
  pair, whose TCP connection carries the bytes in the order they were posted). Within a stream a
  lane's transfers move together, and another lane's wait for those that went on the wire before
  them and hold back those that came after. On the H200's veth capped at 25 Gbit/s, a late
  allocation's READ that D posted while P's WRITE to it was on the wire did not slow that WRITE (it
  moved 8k tokens' KV in 439 ms, its lone rate) and ended after it (docs/results/
  2026-12-03-h200-link-check/plan/gap_25gbit_8k, push-off); pull's READs posted together to one P
  moved one after another (docs/results/2026-12-03-h200-16k-load).
- **The path.** A transfer moves no faster than its path: a staging copy or the transport can bound
  it below the link's cap. ``path_rate`` takes the rate a mode's lone transfers measured as the
  slope of time over bytes across lengths (what does not grow with the bytes is a per-transfer
  cost, not a rate) and the link's rate is the lower of that and the cap. Over a veth capped at
  10 Gbit/s from one H200, push's pinned-host WRITE measured 9.56 (the cap's), pull's READ through
  UCX's ``cuda_copy`` staging 4.1-4.2 whatever the cap (docs/results/2026-12-02-slow-link/capped_gpu).
- **Held.** A link may be held (``hold``/``release``, counted): nothing on it moves meanwhile. The
  simulation holds a link whose transfers UCX stages through a GPU while a prefill computes on that
  GPU (``Profile.staged_holds``): on the H200 with P and D on one GPU, pull's READs through UCX's
  ``cuda_copy`` lost about as long as each prefill they overlapped lasted (16k at half of 25 Gbit/s:
  0.6-1.4 s more than a lone READ's 4.9-5.0 s with 0.6-1.6 s of prefill beside it, 0.1-0.4 s more with
  none; docs/results/2026-12-03-h200-16k-load).

The caller offers posts, asks ``next_end`` when the next transfer will end, and at that time
calls ``ended``, which returns the posts that finished and starts the next ones of their lanes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from pushkv.kinds import LinkOrder
from pushkv.protocol.link_queue import LinkPost, LinkQueue, Window

EPS = 1e-9  # a transfer with this little left is done (float rounding)


@dataclass(frozen=True)
class LinkSpec:
    """A link's rate for one transfer (units per ms), and what several in flight move together."""

    rate: float
    overlap_share: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or not 0 < self.overlap_share <= 1:
            raise ValueError(f"a link's rate is > 0 and its overlap share in (0, 1], not {self}")

    def total_rate(self, inflight: int) -> float:
        return self.rate if inflight <= 1 else self.rate * self.overlap_share


def path_rate(cap: float, lone: Sequence[tuple[float, float]]) -> float:
    """The rate (units per ms) a mode's transfers move at over a link of rate ``cap``: the cap, or
    less where the mode's path is slower. ``lone``: (size, ms on the wire) of its lone transfers at
    two or more sizes; the path's rate is the slope of their least-squares line, since a fixed cost
    per transfer (its post, its notice) lowers a single transfer's rate without bounding the bytes'.
    One size, or a slope that does not rise: the cap (nothing tells a slow path)."""
    if cap <= 0:
        raise ValueError(f"a link's rate is > 0, not {cap}")
    pts = [(float(b), float(t)) for b, t in lone]
    if len({b for b, _ in pts}) < 2:
        return cap
    mb, mt = sum(b for b, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
    ms_per_unit = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
    return cap if ms_per_unit <= 0 else min(cap, 1.0 / ms_per_unit)


@dataclass
class Link:
    spec: LinkSpec
    lanes: dict[str, LinkQueue] = field(default_factory=dict)
    # post id -> units still to move, in flight, in the order they went on the wire (a dict keeps it)
    left: dict[Hashable, float] = field(default_factory=dict)
    lane_of: dict[Hashable, str] = field(default_factory=dict)  # post id -> its lane, in flight
    stream_of: dict[str, str] = field(default_factory=dict)  # lane -> its stream (its own name by default)
    now: float = 0.0  # when ``left`` was last brought up to date
    busy_ms: float = 0.0  # time with at least one transfer in flight
    peak: int = 0  # the most transfers in flight at once
    started: int = 0  # transfers put on the wire so far
    held: int = 0  # holds not yet released: nothing moves while > 0

    def lane(self, name: str, window: Optional[Window] = None, order: LinkOrder = "arrival",
             stream: Optional[str] = None) -> LinkQueue:
        """The lane ``name``, made on first use (``window`` None: every post at once; ``stream``: the
        stream it shares with other lanes, None: its own)."""
        q = self.lanes.get(name)
        if q is None:
            q = self.lanes[name] = LinkQueue(window or Window(), order)
            self.stream_of[name] = stream or name
        return q

    def offer(self, now: float, lane: str, post: LinkPost) -> list[LinkPost]:
        """Queue ``post`` on ``lane`` (made beforehand with ``lane``); returns the posts that went
        on the wire now."""
        self._advance(now)
        return self._start(lane, self.lanes[lane].offer(post))

    def next_end(self) -> Optional[float]:
        """When the next transfer in flight ends if nothing else is offered; None: none in flight,
        or the link is held (its release asks again)."""
        moving = self.moving()
        if not moving or self.held:
            return None
        per = self.spec.total_rate(len(moving)) / len(moving)
        return self.now + min(self.left[pid] for pid in moving) / per

    def ended(self, now: float) -> tuple[list[Hashable], list[LinkPost]]:
        """Bring the link to ``now``: the post ids that have ended, and the posts their room started."""
        self._advance(now)
        done = [pid for pid, left in self.left.items() if left <= EPS * max(1.0, self.spec.rate)]
        started: list[LinkPost] = []
        for pid in done:
            del self.left[pid]
            lane = self.lane_of.pop(pid)
            started += self._start(lane, self.lanes[lane].done(pid))
        return done, started

    def hold(self, now: float) -> None:
        """From ``now`` nothing on the link moves until every hold is released."""
        self._advance(now)
        self.held += 1

    def release(self, now: float) -> None:
        if self.held <= 0:
            raise ValueError("a link released more often than held")
        self._advance(now)
        self.held -= 1

    @property
    def inflight(self) -> int:
        return len(self.left)

    def moving(self) -> list[Hashable]:
        """The transfers on the wire that move now: in each stream, those of the lane of its earliest
        transfer that went on the wire before any other lane's of that stream."""
        by_stream: dict[str, list[Hashable]] = {}
        for pid in self.left:  # in the order they went on the wire
            by_stream.setdefault(self.stream_of[self.lane_of[pid]], []).append(pid)
        out: list[Hashable] = []
        for pids in by_stream.values():
            lane = self.lane_of[pids[0]]
            for pid in pids:
                if self.lane_of[pid] != lane:
                    break
                out.append(pid)
        return out

    def _advance(self, now: float) -> None:
        if now < self.now - EPS:
            raise ValueError(f"time runs backwards on a link: {now} < {self.now}")
        dt = max(0.0, now - self.now)
        if self.left and dt > 0:
            self.busy_ms += dt
            if self.held:
                self.now = max(self.now, now)
                return
            moving = self.moving()
            per = self.spec.total_rate(len(moving)) / len(moving) * dt
            for pid in moving:
                self.left[pid] = max(0.0, self.left[pid] - per)
        self.now = max(self.now, now)

    def _start(self, lane: str, posts: list[LinkPost]) -> list[LinkPost]:
        for p in posts:
            self.left[p.post_id] = float(p.nbytes)
            self.lane_of[p.post_id] = lane
        self.started += len(posts)
        self.peak = max(self.peak, len(self.left))
        return posts


def finish_times(spec: LinkSpec, offers: list[tuple[float, str, LinkPost]],
                 lanes: Optional[dict[str, tuple[Optional[Window], LinkOrder]]] = None,
                 streams: Optional[dict[str, str]] = None) -> dict[Hashable, float]:
    """Each post's end on one link, given when each is offered and on which lane (``lanes``: each
    lane's window and order; a lane not named: every post at once, arrival order; ``streams``: a
    lane's stream, where it shares one). For tests and for reasoning about one link alone."""
    link = Link(spec)
    for name, (window, order) in (lanes or {}).items():
        link.lane(name, window, order, (streams or {}).get(name))
    pending = sorted(offers, key=lambda o: o[0])
    out: dict[Hashable, float] = {}
    i = 0
    while i < len(pending) or link.inflight:
        t_end = link.next_end()
        if i < len(pending) and (t_end is None or pending[i][0] <= t_end):
            t, lane, post = pending[i]
            link.lane(lane)
            link.offer(t, lane, post)
            i += 1
            continue
        assert t_end is not None
        done, _ = link.ended(t_end)
        for pid in done:
            out[pid] = t_end
    return out
