"""One link's transfer queue (protocol/link_queue.py): table-driven.

Each case is a window, an order and a list of (event, the post ids released by it). Events:
("offer", id, key, nbytes[, remaining, deadline, since, last]), ("done", id), ("drop", key) (then the ids
are those dropped), ("done-later", id) (its room not handed out yet), ("release",), ("hold", key),
("unhold", key)."""
import random

import pytest

from pushkv.config import DeploymentConfig
from pushkv.protocol.link_queue import LinkPost, LinkQueue, Window, window_of

MB = 2**20


def step(q: LinkQueue, ev):
    kind, *args = ev
    if kind == "offer":
        pid, key, nbytes, *rest = args
        remaining, deadline, since, last = (list(rest) + [0, 0.0, 0.0, False][len(rest):])
        return q.offer(LinkPost(pid, key, nbytes, remaining, deadline, since, last))
    if kind == "done":
        return q.done(args[0])
    if kind == "drop":
        return q.drop(args[0])
    if kind == "done-later":
        return q.done(args[0], release=False)
    if kind == "release":
        return q.release()
    if kind == "hold":
        q.hold(args[0])
        return []
    if kind == "unhold":
        return q.unhold(args[0])
    raise AssertionError(kind)


CASES = [
    ("unbounded: everything at once", Window(), "arrival", [
        (("offer", "a1", "a", 10 * MB), ["a1"]),
        (("offer", "b1", "b", 10 * MB), ["b1"]),
        (("offer", "c1", "c", 10 * MB), ["c1"]),
    ]),
    ("one part: the next waits for the one in flight", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB), ["a1"]),
        (("offer", "b1", "b", 4 * MB), []),
        (("offer", "c1", "c", 4 * MB), []),
        (("done", "a1"), ["b1"]),
        (("offer", "a2", "a", 4 * MB), []),  # no request's first offer given: behind c
        (("done", "b1"), ["c1"]),
        (("done", "c1"), ["a2"]),
        (("done", "a2"), []),
    ]),
    # a request's later parts, and its last WRITE asked once its parts had landed, rank by its first
    # offer: before the parts of the requests that came after it (first come, first served by request)
    ("arrival: requests in the order they reached the link", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.0), ["a1"]),
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 2.0), []),
        (("offer", "b2", "b", 4 * MB, 0, 0.0, 2.0), []),
        (("done", "a1"), ["b1"]),  # a has nothing queued: the link goes on with b
        (("offer", "a2", "a", 1, 0, 0.0, 1.0), []),  # a's last WRITE, asked now
        (("offer", "c1", "c", 4 * MB, 0, 0.0, 3.0), []),
        (("done", "b1"), ["a2"]),  # a came first: its last WRITE before b's second part
        (("done", "a2"), ["b2"]),
        (("done", "b2"), ["c1"]),
    ]),
    ("two parts in flight", Window(max_parts=2), "arrival", [
        (("offer", "a1", "a", 1), ["a1"]),
        (("offer", "b1", "b", 1), ["b1"]),
        (("offer", "c1", "c", 1), []),
        (("done", "b1"), ["c1"]),
        (("done", "a1"), []),
    ]),
    ("byte bound: small posts share, a big one waits", Window(max_bytes=8 * MB), "arrival", [
        (("offer", "a1", "a", 3 * MB), ["a1"]),
        (("offer", "b1", "b", 4 * MB), ["b1"]),
        (("offer", "c1", "c", 2 * MB), []),  # 9 MiB > 8
        (("done", "a1"), ["c1"]),
    ]),
    ("byte bound: an idle link takes a post bigger than the window", Window(max_bytes=1 * MB), "arrival", [
        (("offer", "a1", "a", 64 * MB), ["a1"]),
        (("offer", "b1", "b", 1), []),
        (("done", "a1"), ["b1"]),
    ]),
    ("byte bound: arrival order holds a small post behind a big one", Window(max_bytes=8 * MB), "arrival", [
        (("offer", "a1", "a", 6 * MB), ["a1"]),
        (("offer", "b1", "b", 6 * MB), []),
        (("offer", "c1", "c", 1 * MB), []),  # would fit, but b is first
        (("done", "a1"), ["b1", "c1"]),
    ]),
    ("parts and bytes: the tighter bound holds", Window(max_parts=3, max_bytes=8 * MB), "arrival", [
        (("offer", "a1", "a", 1), ["a1"]),
        (("offer", "b1", "b", 1), ["b1"]),
        (("offer", "c1", "c", 1), ["c1"]),
        (("offer", "d1", "d", 1), []),
        (("done", "c1"), ["d1"]),
    ]),
    ("shortest remaining first", Window(max_parts=1), "shortest", [
        (("offer", "a1", "a", 4 * MB, 64 * MB), ["a1"]),
        (("offer", "b1", "b", 4 * MB, 32 * MB), []),
        (("offer", "c1", "c", 4 * MB, 8 * MB), []),
        (("offer", "d1", "d", 4 * MB, 8 * MB), []),  # ties with c: c came first
        (("done", "a1"), ["c1"]),
        (("done", "c1"), ["d1"]),
        (("done", "d1"), ["b1"]),
    ]),
    ("shortest without remaining: by the post's own size", Window(max_parts=1), "shortest", [
        (("offer", "a1", "a", 9), ["a1"]),
        (("offer", "b1", "b", 5), []),
        (("offer", "c1", "c", 2), []),
        (("done", "a1"), ["c1"]),
    ]),
    ("earliest deadline first", Window(max_parts=1), "deadline", [
        (("offer", "a1", "a", 1, 0, 5.0), ["a1"]),
        (("offer", "b1", "b", 1, 0, 9.0), []),
        (("offer", "c1", "c", 1, 0, 3.0), []),
        (("done", "a1"), ["c1"]),
        (("done", "c1"), ["b1"]),
    ]),
    # the rendezvous asks a request's next part while its previous one waits (PARTS_AHEAD): its
    # later part, with less of the prompt left, must not go before the earlier one
    ("shortest: a request's later part never overtakes its earlier one", Window(max_parts=1), "shortest", [
        (("offer", "b1", "b", 4 * MB, 40 * MB), ["b1"]),
        (("offer", "a1", "a", 4 * MB, 16 * MB), []),
        (("offer", "a2", "a", 4 * MB, 8 * MB), []),
        (("offer", "c1", "c", 4 * MB, 12 * MB), []),
        (("done", "b1"), ["c1"]),  # a2 (8) is not a's first: a1 (16) and c1 (12) compete
        (("offer", "d1", "d", 4 * MB, 10 * MB), []),
        (("done", "c1"), ["d1"]),
        (("done", "d1"), ["a1"]),
        (("done", "a1"), ["a2"]),
    ]),
    ("deadline: a request's parts go in the order asked", Window(max_parts=1), "deadline", [
        (("offer", "z1", "z", 1, 0, 1.0), ["z1"]),
        (("offer", "a1", "a", 1, 0, 5.0), []),
        (("offer", "b1", "b", 1, 0, 4.0), []),
        (("offer", "a2", "a", 1, 0, 3.0), []),  # (a request's deadline never moves earlier: a guard)
        (("done", "z1"), ["b1"]),
        (("done", "b1"), ["a1"]),
        (("done", "a1"), ["a2"]),
    ]),
    ("drop: a cancelled transfer's queued posts leave; its post in flight stays", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 1), ["a1"]),
        (("offer", "b1", "b", 1), []),
        (("offer", "c1", "c", 1), []),
        (("drop", "b"), ["b1"]),
        (("drop", "a"), []),  # a1 is on the wire: it ends by itself
        (("done", "a1"), ["c1"]),
    ]),
    # the writer hears a part's end before it hands out its room: the last WRITE its end asks for is
    # offered first and goes before the next request's part (handed the room at once, it would wait
    # for that whole part)
    ("a part's room waits for what its end asks: the last WRITE goes first", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.0), ["a1"]),
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 2.0), []),
        (("done-later", "a1"), []),
        (("offer", "a2", "a", 1, 0, 0.0, 1.0), ["a2"]),  # a's last WRITE: the room is free, it ranks first
        (("release",), []),  # nothing more fits
        (("done-later", "a2"), []),
        (("release",), ["b1"]),  # nothing of a's followed: b goes
        (("release",), []),
    ]),
    # two requests prefilled in one step: b's first post was offered a moment before a's, so b ranks
    # first; a's last WRITE (one unit) still goes before b's next part, and ends a at once
    ("arrival: a request's last WRITE goes before every part", Window(max_parts=1), "arrival", [
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 1.0), ["b1"]),
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.001), []),
        (("done", "b1"), ["a1"]),
        (("offer", "b2", "b", 4 * MB, 0, 0.0, 1.0), []),
        (("offer", "a2", "a", 1, 0, 0.0, 1.001, True), []),
        (("done", "a1"), ["a2"]),  # b ranks first, a's last WRITE goes first
        (("offer", "c1", "c", 1, 0, 0.0, 0.5, True), []),  # last WRITEs among themselves: by arrival
        (("offer", "d1", "d", 1, 0, 0.0, 0.2, True), []),
        (("done", "a2"), ["d1"]),
        (("done", "d1"), ["c1"]),
        (("done", "c1"), ["b2"]),
    ]),
    ("hold: a room kept for a request's post on its way", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.0), ["a1"]),
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 2.0), []),
        (("done-later", "a1"), []),
        (("hold", "a"), []),  # a's last WRITE is being copied into the staging area
        (("release",), []),  # the room is a's
        (("offer", "c1", "c", 1, 0, 0.0, 0.5), []),  # not even for an earlier request's post
        (("offer", "a2", "a", 1, 0, 0.0, 1.0), ["a2"]),  # a's post takes its room, whatever the order
        (("done", "a2"), ["c1"]),
        (("done", "c1"), ["b1"]),
    ]),
    ("hold: unhold (the copy's transfer failed) hands the room out", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.0), ["a1"]),
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 2.0), []),
        (("done-later", "a1"), []),
        (("hold", "a"), []),
        (("release",), []),
        (("unhold", "x"), []),  # held by no one: nothing
        (("unhold", "a"), ["b1"]),
        (("unhold", "a"), []),  # twice
    ]),
    ("hold while the window is full: the post waits for a room, then goes first", Window(max_parts=1), "arrival", [
        (("offer", "b1", "b", 4 * MB, 0, 0.0, 2.0), ["b1"]),
        (("hold", "a"), []),
        (("offer", "c1", "c", 1, 0, 0.0, 0.5), []),
        (("offer", "a1", "a", 1, 0, 0.0, 1.0), []),  # the window holds: b1 is on the wire
        (("done", "b1"), ["a1"]),  # the room kept for a, before c's earlier rank
        (("done", "a1"), ["c1"]),
    ]),
    ("two rooms kept on a window of one: they go in the order kept (they once waited for each other)",
     Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 4 * MB, 0, 0.0, 1.0), ["a1"]),
        (("done-later", "a1"), []),
        (("hold", "a"), []),  # a's last WRITE is copied into the staging area
        (("hold", "b"), []),  # b's too (its parts landed before its prefill ended)
        (("release",), []),
        (("offer", "c1", "c", 1, 0, 0.0, 0.5), []),
        (("offer", "b9", "b", 1, 0, 0.0, 2.0, True), []),  # b's copy is done first: a's room comes first
        (("offer", "a9", "a", 1, 0, 0.0, 1.0, True), ["a9"]),
        (("done", "a9"), ["b9"]),
        (("done", "b9"), ["c1"]),
    ]),
    ("two rooms kept, the first post first: each goes in turn", Window(max_parts=1), "arrival", [
        (("hold", "a"), []),
        (("hold", "b"), []),
        (("offer", "a9", "a", 1, 0, 0.0, 1.0, True), ["a9"]),
        (("offer", "b9", "b", 1, 0, 0.0, 2.0, True), []),
        (("done", "a9"), ["b9"]),
    ]),
    ("a kept room given up lets the next kept one go", Window(max_parts=1), "arrival", [
        (("hold", "a"), []),
        (("hold", "b"), []),
        (("offer", "b9", "b", 1, 0, 0.0, 2.0, True), []),
        (("unhold", "a"), ["b9"]),  # a's transfer failed while copied
    ]),
    ("hold on an idle link: the window counts it", Window(max_parts=2), "arrival", [
        (("hold", "a"), []),
        (("offer", "b1", "b", 4 * MB), ["b1"]),  # one room of two kept for a, one left
        (("offer", "c1", "c", 4 * MB), []),
        (("offer", "a1", "a", 1), ["a1"]),
        (("done", "b1"), ["c1"]),
    ]),
    ("done of an id not in flight changes nothing", Window(max_parts=1), "arrival", [
        (("offer", "a1", "a", 1), ["a1"]),
        (("offer", "b1", "b", 1), []),
        (("done", "zz"), []),
        (("done", "b1"), []),  # queued, not in flight
        (("done", "a1"), ["b1"]),
        (("done", "a1"), []),  # twice
    ]),
]


@pytest.mark.parametrize("name,window,order,events", CASES, ids=[c[0] for c in CASES])
def test_link_queue(name, window, order, events):
    q = LinkQueue(window, order)
    for ev, want in events:
        got = [p.post_id for p in step(q, ev)]
        assert got == want, f"{name}: after {ev}"


def test_counts_follow_the_posts():
    q = LinkQueue(Window(max_parts=2))
    for i in range(4):
        q.offer(LinkPost(i, i, 100))
    assert (q.queued, q.inflight, q.inflight_bytes, len(q)) == (2, 2, 200, 4)
    q.done(0)
    q.drop(3)
    assert (q.queued, q.inflight, q.inflight_bytes, len(q)) == (0, 2, 200, 2)
    q.hold("k")
    assert (q.held, len(q)) == (1, 3)


@pytest.mark.parametrize("window", [Window(max_parts=1), Window(max_parts=2), Window(max_bytes=6 * MB),
                                    Window(max_parts=2, max_bytes=6 * MB)], ids=str)
@pytest.mark.parametrize("order", ["arrival", "shortest", "deadline"])
@pytest.mark.parametrize("seed", range(40))
def test_random_writers_never_stall_the_link(window, order, seed):
    """A writer's life on one link, at random: requests offer parts (up to two queued), their posts
    end (their rooms handed out at once or at the pass's end), a request whose parts ended keeps a
    room for its last WRITE while it is copied (or not), then offers it or fails. Whatever happens,
    the window holds, every post goes once, and once every copy is done and every post has ended
    nothing is left waiting."""
    rng = random.Random(seed)
    q = LinkQueue(window, order)
    todo = {f"r{i}": rng.randint(0, 3) for i in range(rng.randint(2, 7))}  # parts left per request
    active: dict[str, int] = {}  # request -> its posts not ended (queued or in flight)
    copying: set[str] = set()  # last WRITEs held while their bytes are copied
    went: list = []
    inflight: list = []
    ids = iter(range(10**6))
    clock = iter(range(1, 10**6))

    def took(released):
        for p in released:
            assert p.post_id not in went, f"{p.post_id} went twice"
            went.append(p.post_id)
            inflight.append(p)
        if window.max_parts:
            assert q.inflight <= window.max_parts, "the window was overrun"

    def offer(key, last=False):
        active[key] = active.get(key, 0) + 1
        size = rng.choice([1, MB, 4 * MB, 8 * MB]) if not last else 1
        took(q.offer(LinkPost(next(ids), key, size, remaining=size * 3, deadline=rng.random(), since=next(clock),
                              last=last)))

    def last_write(key):  # a request's parts all ended: its last WRITE, staged (a room kept while copied) or not
        if rng.random() < 0.6:
            q.hold(key)
            copying.add(key)
            todo[key] = -2
        else:
            offer(key, last=True)
            todo[key] = -1

    for _ in range(200):
        moves = []
        moves += [("part", k) for k, n in todo.items() if n > 0 and active.get(k, 0) < 2]
        moves += [("end", i) for i in range(len(inflight))]
        moves += [("copied", k) for k in copying]
        moves += [("last", k) for k, n in todo.items() if n == 0 and not active.get(k) and k not in copying]
        if not moves:
            break
        kind, what = rng.choice(moves)
        if kind == "part":
            todo[what] -= 1
            offer(what)
        elif kind == "end":
            p = inflight.pop(what)
            active[p.key] -= 1
            later = rng.random() < 0.5
            took(q.done(p.post_id, release=not later))
            if later:  # what the end asks for first (the request's last WRITE), then the room goes
                if todo[p.key] == 0 and not active[p.key]:
                    last_write(p.key)
                took(q.release())
        elif kind == "copied":
            copying.discard(what)
            if rng.random() < 0.2:  # its transfer failed while its bytes were copied
                took(q.unhold(what))
            else:
                offer(what, last=True)
            todo[what] = -1
        else:
            last_write(what)
        if not inflight and not copying:  # nothing on the wire and nothing on its way: nothing may wait
            assert q.queued == 0 and q.held == 0, f"stalled: {q.queued} queued, {q.held} rooms kept"
    assert len(went) == len(set(went))


def _offer_twice(q):
    q.offer(LinkPost("a", "k", 1))
    q.offer(LinkPost("a", "k", 1))


REFUSED = [
    ("negative window", lambda: Window(max_parts=-1), "window"),
    ("unknown order", lambda: LinkQueue(order="random"), "not one of"),  # type: ignore[arg-type]
    ("negative size", lambda: LinkQueue().offer(LinkPost("a", "a", -1)), "nbytes"),
    ("an id twice", lambda: _offer_twice(LinkQueue(Window(1))), "already"),
    ("negative config", lambda: window_of(-1, 0, True), ">= 0"),
    ("negative config field", lambda: DeploymentConfig(link_window=-1), ">= 0"),
]


@pytest.mark.parametrize("name,make,says", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_input_is_refused(name, make, says):
    with pytest.raises(ValueError, match=says):
        make()


@pytest.mark.parametrize("parts,mib,slow,want", [
    (0, 0, True, Window(1, 0)),  # auto on a slow link: one post at a time
    (0, 0, False, None),  # auto on a fast link: no queue
    (3, 0, False, Window(3, 0)),
    (0, 16, False, Window(0, 16 * MB)),
    (2, 16, True, Window(2, 16 * MB)),
])
def test_window_of_config(parts, mib, slow, want):
    assert window_of(parts, mib, slow) == want


@pytest.mark.parametrize("parts,slow,want", [
    (0, True, Window(2, 0)),  # auto on a slow link: pull's READs from one P two at a time
    (0, False, None),  # a fast link: no queue
    (1, True, Window(1, 0)),  # the flag, as given, for READs too
])
def test_reads_have_their_own_auto_window(parts, slow, want):
    assert window_of(parts, 0, slow, "read") == want
    assert window_of(0, 0, True, "write") == Window(1, 0)  # P's WRITEs stay one at a time
