"""KVArrivals (D side of push): table-driven."""
import pytest

from pushkv.messages import WriteDone, WriteFailed
from pushkv.protocol.actions import Count, Failed, ProtocolError, Received
from pushkv.protocol.arrivals import KVArrivals


def short(a):
    if isinstance(a, Received):
        return f"received {a.transfer_id}{a.generation} tok={a.first_token} {a.nbytes}B {a.num_descs}d"
    if isinstance(a, Failed):
        return f"failed {a.transfer_id}{a.generation}"
    if isinstance(a, Count):
        return f"count:{a.name}"
    raise AssertionError(a)


def arrival_step(k, ev):
    kind, *args = ev
    if kind == "expect":
        tid, gen, producers, deadline = args
        return k.expect(tid, gen, (1, 2), producers, deadline)
    if kind == "done":
        tid, gen, p, now, *tok = args
        return k.on_write_done(WriteDone(tid, gen, p, tok[0] if tok else 7, 100, 2), now)
    if kind == "fail":
        tid, gen, p, now = args
        return k.on_write_failed(WriteFailed(tid, gen, p, "boom"), now)
    if kind == "cancel":
        tid, gen, now = args
        return k.cancel(tid, gen, "abort", now)
    if kind == "expire":
        return k.expire(*args)
    raise AssertionError(kind)


ARRIVALS = [
    ("one_producer", [
        (("expect", "t", 1, [0], 10.0), [], "waiting"),
        (("done", "t", 1, 0, 1.0), ["received t1 tok=7 100B 2d"], "received"),
    ]),
    ("two_producers_any_order", [
        (("expect", "t", 1, [0, 1], 10.0), [], "waiting"),
        (("done", "t", 1, 1, 1.0), [], "waiting"),
        (("done", "t", 1, 1, 1.5), ["count:duplicate_write_done"], "waiting"),
        (("done", "t", 1, 0, 2.0), ["received t1 tok=7 200B 4d"], "received"),
        (("done", "t", 1, 0, 3.0), ["count:late_write_done"], "received"),
    ]),
    ("unexpected_producer", [
        (("expect", "t", 1, [0], 10.0), [], "waiting"),
        (("done", "t", 1, 3, 1.0), ["count:unexpected_producer"], "waiting"),
    ]),
    ("unknown_transfer", [(("done", "t", 1, 0, 1.0), ["count:unknown_write_done"], None)]),
    ("first_token_mismatch_counted", [
        (("expect", "t", 1, [0, 1], 10.0), [], "waiting"),
        (("done", "t", 1, 0, 1.0, 5), [], "waiting"),
        (("done", "t", 1, 1, 1.0, 6), ["received t1 tok=5 200B 4d", "count:first_token_mismatch"], "received"),
    ]),
    ("stale_generation_ignored", [
        (("expect", "t", 2, [0], 10.0), [], None),
        (("done", "t", 1, 0, 1.0), ["count:stale_write_done"], None),
        (("fail", "t", 1, 0, 1.0), ["count:stale_write_failed"], None),
        (("done", "t", 2, 0, 2.0), ["received t2 tok=7 100B 2d"], None),
    ]),
    ("reissue_supersedes", [
        (("expect", "t", 1, [0], 10.0), [], "waiting"),
        (("expect", "t", 2, [0], 20.0), ["failed t1", "count:superseded"], "failed"),
        (("done", "t", 1, 0, 1.0), ["count:late_write_done"], "failed"),
        (("expire", 10.0), [], "failed"),
    ]),
    ("write_failed_once", [
        (("expect", "t", 1, [0, 1], 10.0), [], "waiting"),
        (("done", "t", 1, 0, 1.0), [], "waiting"),
        (("fail", "t", 1, 1, 2.0), ["failed t1", "count:write_failed"], "failed"),
        (("fail", "t", 1, 1, 2.0), ["count:late_write_failed"], "failed"),
        (("done", "t", 1, 1, 3.0), ["count:late_write_done"], "failed"),
        (("expire", 11.0), [], "failed"),
    ]),
    ("deadline", [
        (("expect", "t", 1, [0, 1], 10.0), [], "waiting"),
        (("done", "t", 1, 0, 1.0), [], "waiting"),
        (("expire", 9.99), [], "waiting"),
        (("expire", 10.0), ["failed t1", "count:expired_arrival"], "failed"),
        (("done", "t", 1, 1, 11.0), ["count:late_write_done"], "failed"),
    ]),
    ("cancel", [
        (("expect", "t", 1, [0], 10.0), [], "waiting"),
        (("cancel", "t", 1, 1.0), ["failed t1", "count:cancelled"], "failed"),
        (("cancel", "t", 1, 1.0), ["count:cancel_ignored"], "failed"),
    ]),
]


@pytest.mark.parametrize("name,steps", ARRIVALS, ids=[a[0] for a in ARRIVALS])
def test_arrivals(name, steps):
    k = KVArrivals()
    for i, (ev, expected, state) in enumerate(steps):
        assert [short(a) for a in arrival_step(k, ev)] == expected, f"step {i} {ev}"
        assert k.state_of("t", 1) == state, f"step {i} {ev}"


@pytest.mark.parametrize(
    "setup,event,state",
    [
        ([("expect", "t", 1, [0], 10.0)], ("expect", "t", 1, [0], 10.0), "waiting"),
        ([("expect", "t", 2, [0], 10.0)], ("expect", "t", 1, [0], 10.0), "newer_generation_waiting"),
        ([("expect", "t", 1, [0], 10.0), ("done", "t", 1, 0, 1.0)], ("expect", "t", 1, [0], 10.0), "finished"),
    ],
)
def test_arrivals_illegal_expect(setup, event, state):
    k = KVArrivals()
    for ev in setup:
        arrival_step(k, ev)
    before = (len(k), k.next_deadline())
    with pytest.raises(ProtocolError, match=state):
        arrival_step(k, event)
    assert (len(k), k.next_deadline()) == before


def test_arrivals_deadlines_and_outstanding():
    k = KVArrivals()
    assert k.next_deadline() is None
    k.expect("a", 1, (1,), [0, 1], 7.0)
    k.expect("b", 1, (2,), [0], 5.0)
    assert k.next_deadline() == 5.0
    k.on_write_done(WriteDone("b", 1, 0, 3), 1.0)
    assert k.next_deadline() == 7.0
    assert k.outstanding("a", 1) == [0, 1]
    k.on_write_done(WriteDone("a", 1, 1, 3), 1.0)
    assert k.outstanding("a", 1) == [0]
    k.expect("a", 2, (1,), [0], 7.0)  # same deadline value as the superseded one: fires once
    assert [short(x) for x in k.expire(8.0)] == ["failed a2", "count:expired_arrival"]
    assert k.next_deadline() is None and len(k) == 0
    with pytest.raises(ValueError):
        k.expect("c", 1, (1,), [], 1.0)
