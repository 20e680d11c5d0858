"""P's link queues as a pure stage between the side's Post effects and the post call
(``writer/link_posts.py``): no NIXL, socket or clock; the writer's posts and handles are
plain objects here. Each link (D engine, D rank) has its own window; a handle's end frees
its own link's room; a failed transfer's queued posts come out of every link."""
from pushkv.protocol.link_queue import Window
from pushkv.writer.link_posts import LinkPosts

D0, D1 = ("d", 0), ("d", 1)


def posts(released):
    return [p for _, _, p in released]


def test_one_post_in_flight_per_link_and_links_apart():
    lp = LinkPosts(Window(max_parts=1), "arrival")
    a = lp.offer(D0, ("a", 0), 100, 100, 0.0, 0.0, "a-d0")
    assert posts(a) == ["a-d0"]
    assert lp.offer(D0, ("b", 0), 10, 10, 0.0, 0.0, "b-d0") == []  # D0 is busy: it waits
    assert posts(lp.offer(D1, ("b", 0), 10, 10, 0.0, 0.0, "b-d1")) == ["b-d1"]  # D1's window is its own
    (link, pid, _), = a
    handle = object()
    lp.sent(link, pid, handle)
    assert lp.gauges() == {"link_queued": 1, "link_inflight": 2, "link_inflight_peak": 1}
    assert posts(lp.ended(handle)) == ["b-d0"]  # a's WRITE ended: D0's room goes to b
    assert lp.ended(object()) == []  # a handle posted without the queue frees nothing


def test_shortest_goes_first_and_a_post_that_never_went_frees_its_room():
    lp = LinkPosts(Window(max_parts=1), "shortest")
    [(link, first, _)] = lp.offer(D0, ("a", 0), 100, 1000, 0.0, 0.0, "a")
    lp.offer(D0, ("b", 0), 100, 900, 0.0, 0.0, "b")
    lp.offer(D0, ("c", 0), 100, 100, 0.0, 0.0, "c")
    assert posts(lp.done(link, first)) == ["c"]  # the fewest bytes left (its post failed: done all the same)


def test_drop_takes_a_failed_transfers_queued_posts_out_of_every_link():
    lp = LinkPosts(Window(max_parts=1), "arrival")
    lp.offer(D0, ("x", 0), 1, 1, 0.0, 0.0, "x-d0")
    lp.offer(D1, ("x", 0), 1, 1, 0.0, 0.0, "x-d1")
    lp.offer(D0, ("a", 0), 1, 1, 0.0, 0.0, "a-d0")
    lp.offer(D1, ("a", 0), 1, 1, 0.0, 0.0, "a-d1")
    assert sorted(lp.drop(("a", 0))) == ["a-d0", "a-d1"]  # queued: out, never posted
    assert lp.drop(("x", 0)) == []  # in flight already: ends on its own
    assert lp.gauges()["link_queued"] == 0


def test_an_ended_part_s_room_waits_for_the_writer_to_hear_what_the_end_asks():
    """The writer's reaping pass: the part's handle ends (room freed, nothing handed out), its end
    asks the request's last WRITE (offered: it goes first), then ``release`` hands out the rest."""
    lp = LinkPosts(Window(max_parts=1), "arrival")
    [(link, pid, _)] = lp.offer(D0, ("a", 0), 100, 100, 0.0, 1.0, "a-part")
    lp.offer(D0, ("b", 0), 100, 100, 0.0, 2.0, "b-part")
    handle = object()
    lp.sent(link, pid, handle)
    assert lp.ended(handle, release=False) == []
    assert posts(lp.offer(D0, ("a", 0), 1, 1, 0.0, 1.0, "a-last")) == ["a-last"]
    assert lp.release() == []  # the window is full again


def test_a_staged_last_write_keeps_a_room_while_its_bytes_are_copied():
    lp = LinkPosts(Window(max_parts=1), "arrival")
    [(link, pid, _)] = lp.offer(D0, ("a", 0), 100, 100, 0.0, 1.0, "a-part")
    lp.offer(D0, ("b", 0), 100, 100, 0.0, 2.0, "b-part")
    lp.hold(D0, ("a", 0))  # a's last WRITE is being copied into the staging area
    assert lp.done(link, pid) == []  # a's part ended: the room stays a's
    assert posts(lp.offer(D0, ("a", 0), 1, 1, 0.0, 1.0, "a-last")) == ["a-last"]
    lp.hold(D1, ("c", 0))
    assert lp.offer(D1, ("d", 0), 1, 1, 0.0, 0.0, "d") == []  # D1's one room is kept for c
    assert posts(lp.unhold(D1, ("c", 0))) == ["d"]  # c's transfer failed while copied: d goes


def test_two_staged_last_writes_on_a_window_of_one_go_in_turn():
    """Two requests' last WRITEs copied at once (a stream-off load on the GPU): the rooms kept for
    them go in the order kept, whichever copy ends first. (Each once counted against the other, and
    every WRITE on the link waited forever.)"""
    lp = LinkPosts(Window(max_parts=1), "arrival")
    lp.hold(D0, ("a", 0))
    lp.hold(D0, ("b", 0))
    assert lp.offer(D0, ("b", 0), 1, 1, 0.0, 2.0, "b-last", last=True) == []  # a's room comes first
    [(link, pid, post)] = lp.offer(D0, ("a", 0), 1, 1, 0.0, 1.0, "a-last", last=True)
    assert post == "a-last"
    handle = object()
    lp.sent(link, pid, handle)
    assert posts(lp.ended(handle)) == ["b-last"]
