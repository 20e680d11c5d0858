"""A restarted router's epoch: the scheduler aborts what the router before it sent and frees
its blocks; the new router's requests, and an old epoch heard late, change nothing."""
from __future__ import annotations

from pushkv import messages as m
from pushkv.scheduler.outbox import Peer
from tests.scheduler.test_scheduler_roles import P_SRC, all_free, deliver, make, step_done

OLD, NEW = Peer.router(b"old-router"), Peer.router(b"new-router")


def gen(s, frm, tid, leg, prompt=(1, 2, 3), max_tokens=50, **kw):
    deliver(s, frm, m.Generate(tid, 0, leg, prompt, max_tokens, **kw))


def test_decode_aborts_the_old_routers_legs_running_and_queued_and_frees_their_blocks():
    s, wire = make("decode", num_blocks=9)
    deliver(s, OLD, m.RouterEpoch(100))
    long = tuple(range(1, 61))  # 60 tokens and the next one's slot: 4 blocks at admission
    gen(s, OLD, "run", "decode", prompt=long, max_tokens=3, prefill_here=True)  # prefilled and decoding here
    gen(s, OLD, "kv", "decode", prompt=long, max_tokens=3, source=P_SRC)  # registered, waiting for the KV
    gen(s, OLD, "queued", "decode", prompt=long, max_tokens=3, prefill_here=True)  # no room: queued
    step_done(s, wire, (5,))  # "run" prefilled; its next step is in flight
    wire.take("writer")
    assert len(s.waiting) == 1 and s.alloc.num_free == 1  # (the watermark: one block left for "run" to grow)
    deliver(s, NEW, m.RouterEpoch(200))
    gen(s, NEW, "fresh", "decode", prefill_here=True)
    assert s.counters["router_epoch_aborted"] == 3
    # the registered leg's blocks wait for its writers to say nothing lands in them any more
    assert [type(x) for x in wire.take("writer")] == [m.CancelKV, m.CancelKV]
    for w in s.writers:
        deliver(s, w, m.KVFailed("kv", 0, "cancelled"))
    step_done(s, wire, (6,))  # "run"'s step ends: its blocks are freed, "fresh" is admitted
    assert set(r.transfer_id for r in s.reqs.values()) == {"fresh"}
    out = [x for x in wire.take("router")]
    assert not any(isinstance(x, m.RequestFailed) and x.transfer_id != "fresh" for x in out)  # nobody to tell
    while s.reqs:
        step_done(s, wire, (7,) * len(s.step))
    assert all_free(s)


def test_prefill_aborts_the_old_routers_legs_and_keeps_the_new_ones():
    s, wire = make("prefill", num_blocks=8)
    deliver(s, OLD, m.RouterEpoch(1))
    gen(s, OLD, "a", "prefill")  # prefilling
    gen(s, OLD, "b", "prefill", prompt=tuple(range(1, 100)))  # queued (7 blocks)
    deliver(s, NEW, m.RouterEpoch(2))  # the router restarted where it served: its life before's work is an orphan
    assert s.counters["router_epoch_aborted"] == 2
    step_done(s, wire, (42,))  # "a"'s step ends: aborted, nothing more is handed to the writers
    cancels = [x for x in wire.take("writer") if not isinstance(x, m.StreamKV)]
    # layer-streamed push: the writers may already read "a"'s blocks, so they are asked to stop
    assert {(type(x), x.transfer_id) for x in cancels} <= {(m.CancelKV, "a")}
    for w in s.writers if cancels else ():
        deliver(s, w, m.KVFailed("a", 0, "cancelled"))
    assert all_free(s)


def test_an_older_or_the_same_epoch_changes_nothing():
    s, wire = make("decode", num_blocks=8)
    deliver(s, NEW, m.RouterEpoch(200))
    gen(s, NEW, "t", "decode", prefill_here=True)
    deliver(s, OLD, m.RouterEpoch(100))  # a replaced router heard late
    deliver(s, NEW, m.RouterEpoch(200))  # the same router again
    assert s.counters["router_epoch_stale"] == 1 and s.counters["router_epoch_aborted"] == 0
    assert [r.transfer_id for r in s.reqs.values()] == ["t"]


def test_a_router_elsewhere_leaves_the_other_routers_requests_alone():
    """A second router (another replica, or a rolling update's new pod while the old one drains) announces its epoch
    from another place: the first router's requests run on; a restart at the first's place still aborts them."""
    s, wire = make("decode", num_blocks=16)
    a, b, a_again = Peer.router(b"router-a"), Peer.router(b"router-b"), Peer.router(b"router-a2")
    deliver(s, a, m.RouterEpoch(100, "10.0.0.9:8000"))
    gen(s, a, "a1", "decode", prefill_here=True)
    deliver(s, b, m.RouterEpoch(200, "10.0.0.10:8000"))  # before: a1 aborted, nobody told, its client waited
    gen(s, b, "b1", "decode", prefill_here=True)
    assert s.counters["router_epoch_aborted"] == 0
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"a1", "b1"}
    deliver(s, a_again, m.RouterEpoch(300, "10.0.0.9:8000"))  # router a restarted: its orphan goes, b's stays
    assert s.counters["router_epoch_aborted"] == 1
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"b1"}
    deliver(s, a, m.RouterEpoch(100, "10.0.0.9:8000"))  # a's old connection heard late
    assert s.counters["router_epoch_stale"] == 1


def test_a_router_restarted_or_linked_again_leaves_no_connection_of_its_place_behind():
    """Each router connection's place was kept for good: routers restarting often (or linking again) grew
    ``router_places`` without end. A newer epoch at a place forgets the connections of the router before (once their
    requests are aborted); the same epoch on a new connection forgets the idle connection it replaces."""
    s, wire = make("decode", num_blocks=16)
    b = Peer.router(b"router-b")
    deliver(s, b, m.RouterEpoch(50, "10.0.0.10:8000"))
    gen(s, b, "b1", "decode", prefill_here=True)
    for n in range(1, 6):  # router a restarts where it served, five times
        a = Peer.router(b"router-a%d" % n)
        deliver(s, a, m.RouterEpoch(100 * n, "10.0.0.9:8000"))
        gen(s, a, f"a{n}", "decode", prefill_here=True)
        assert s.router_places == {b.identity: "10.0.0.10:8000", a.identity: "10.0.0.9:8000"}
    assert s.counters["router_epoch_aborted"] == 4
    b_again = Peer.router(b"router-b2")  # router b links again (the same epoch): its busy connection stays known
    deliver(s, b_again, m.RouterEpoch(50, "10.0.0.10:8000"))
    assert s.router_places[b.identity] == "10.0.0.10:8000"
    deliver(s, a, m.Abort("a5", 0))
    deliver(s, a, m.RouterEpoch(100, "10.0.0.9:8000"))  # an old epoch heard late changes nothing
    assert s.counters["router_epoch_stale"] == 1 and s.counters["router_epoch_aborted"] == 4
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"b1"}
    deliver(s, b, m.Abort("b1", 0))
    while s.reqs:
        step_done(s, wire, (7,) * len(s.step))
    b_third = Peer.router(b"router-b3")  # b links again once more: the idle connections of before are forgotten
    deliver(s, b_third, m.RouterEpoch(50, "10.0.0.10:8000"))
    assert s.router_places == {b_third.identity: "10.0.0.10:8000", a.identity: "10.0.0.9:8000"}
    assert all_free(s)


def test_a_restarted_scheduler_learns_each_routers_place_again_and_aborts_only_a_restarted_ones():
    """Two routers on one host (fixed endpoints, no registry), the scheduler restarted: it knew neither's place, so
    whichever epoch came first took the other's requests for orphans. Each router's link says its epoch again on
    connecting anew (``again``); what a router sent before its epoch said again is not taken for another's orphan,
    and a router restarted later aborts only its own life before's requests."""
    s, wire = make("decode", num_blocks=16)  # the restarted scheduler
    a, b = Peer.router(b"router-a"), Peer.router(b"router-b")
    gen(s, a, "a1", "decode", prefill_here=True)  # queued by router a while the scheduler was down
    deliver(s, b, m.RouterEpoch(200, "/run/router-b.sock", again=True))  # before: a1 aborted
    gen(s, b, "b1", "decode", prefill_here=True)
    deliver(s, a, m.RouterEpoch(100, "/run/router-a.sock", again=True))
    assert s.counters["router_epoch_aborted"] == 0
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"a1", "b1"}
    a_again = Peer.router(b"router-a2")  # router a restarted: its orphan goes, b's stays
    deliver(s, a_again, m.RouterEpoch(300, "/run/router-a.sock"))
    assert s.counters["router_epoch_aborted"] == 1
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"b1"}
    deliver(s, b, m.Abort("b1", 0))
    while s.reqs:
        step_done(s, wire, (7,) * len(s.step))
    assert all_free(s)


def test_a_router_starting_beside_a_restarted_scheduler_leaves_another_routers_queued_requests_alone():
    """The scheduler and router a restart together (a host's services restarted); router b, alive, had queued a
    request while the scheduler was down, which its link delivers ahead of its epoch said again. Router a's fresh
    epoch took b's connection, of no place yet, for the router before's and aborted b1 without a word to b."""
    s, wire = make("decode", num_blocks=16)  # the restarted scheduler
    a, b = Peer.router(b"router-a"), Peer.router(b"router-b")
    gen(s, b, "b1", "decode", prefill_here=True)  # b's, queued while the scheduler was down
    deliver(s, a, m.RouterEpoch(300, "/run/router-a.sock"))  # a, started afresh
    deliver(s, b, m.RouterEpoch(200, "/run/router-b.sock", again=True))
    assert s.counters["router_epoch_aborted"] == 0
    assert {r.transfer_id for r in s.reqs.values() if not r.aborted} == {"b1"}
