"""Leases (P side of pull): table-driven."""
import pytest

from pushkv.protocol.actions import Completed, Count, Failed, FreeBlocks, ProtocolError
from pushkv.protocol.lease import Leases


def short(a):
    if isinstance(a, Failed):
        return f"failed {a.transfer_id}{a.generation}"
    if isinstance(a, FreeBlocks):
        return f"free {a.transfer_id}{a.generation} {list(a.block_ids)}"
    if isinstance(a, Completed):
        return f"completed {a.transfer_id}{a.generation} {a.order}"
    if isinstance(a, Count):
        return f"count:{a.name}"
    raise AssertionError(a)


def lease_step(L, ev):
    kind, *args = ev
    if kind == "hold":
        tid, gen, now = args
        return L.hold(tid, gen, (3, 4), now)
    if kind == "read":
        tid, gen, d_rank, expected = args
        return L.on_read_done(tid, gen, d_rank, expected)
    if kind == "release":
        return L.release(*args)
    if kind == "cancel":
        tid, gen, now = args
        return L.cancel(tid, gen, "abort", now)
    if kind == "expire":
        return L.expire(*args)
    raise AssertionError(kind)


LEASES = [
    ("one_reader", [
        (("hold", "t", 1, 0.0), []),
        (("read", "t", 1, 0, 1), ["free t1 [3, 4]", "completed t1 pull"]),
        (("read", "t", 1, 0, 1), ["count:late_read_done"]),
    ]),
    ("two_readers", [
        (("hold", "t", 1, 0.0), []),
        (("read", "t", 1, 1, 2), []),
        (("read", "t", 1, 1, 2), ["count:duplicate_read_done"]),
        (("read", "t", 1, 0, 2), ["free t1 [3, 4]", "completed t1 pull"]),
    ]),
    ("expiry", [
        (("hold", "t", 1, 0.0), []),
        (("expire", 29.9), []),
        (("expire", 30.0), ["free t1 [3, 4]", "failed t1", "count:lease_expired"]),
        (("read", "t", 1, 0, 1), ["count:late_read_done"]),
        (("expire", 100.0), []),
    ]),
    ("reissue", [
        (("hold", "t", 1, 0.0), []),
        (("hold", "t", 2, 1.0), ["free t1 [3, 4]", "failed t1", "count:stale_lease"]),
        (("read", "t", 1, 0, 1), ["count:late_read_done"]),
        (("expire", 30.5), []),
        (("expire", 31.0), ["free t2 [3, 4]", "failed t2", "count:lease_expired"]),
    ]),
    ("stale_and_unknown_reads", [
        (("hold", "t", 3, 0.0), []),
        (("read", "t", 2, 0, 1), ["count:stale_read_done"]),
        (("read", "u", 1, 0, 1), ["count:unknown_read_done"]),
    ]),
    ("release", [
        (("hold", "t", 1, 0.0), []),
        (("release", "t", 1), ["free t1 [3, 4]"]),
        (("release", "t", 1), ["count:release_ignored"]),
    ]),
    ("cancel", [
        (("hold", "t", 1, 0.0), []),
        (("cancel", "t", 1, 1.0), ["free t1 [3, 4]", "failed t1", "count:lease_cancelled"]),
        (("cancel", "t", 1, 1.0), ["count:cancel_ignored"]),
        (("expire", 100.0), []),
    ]),
]


@pytest.mark.parametrize("name,steps", LEASES, ids=[c[0] for c in LEASES])
def test_leases(name, steps):
    L = Leases(30.0)
    for i, (ev, expected) in enumerate(steps):
        assert [short(a) for a in lease_step(L, ev)] == expected, f"step {i} {ev}"
    L.expire(1e9)
    assert L.held_blocks() == [] and len(L) == 0 and L.next_deadline() is None


def test_lease_deadlines_and_illegal_hold():
    L = Leases(30.0)
    L.hold("a", 1, (1,), 5.0)
    L.hold("b", 1, (2,), 1.0)
    assert L.next_deadline() == 31.0 and L.deadline_of("a", 1) == 35.0
    with pytest.raises(ProtocolError, match="held"):
        L.hold("a", 1, (9,), 6.0)
    with pytest.raises(ProtocolError, match="held"):
        L.hold("a", 0, (9,), 6.0)
    assert sorted(L.held_blocks()) == [1, 2]
    L.on_read_done("b", 1, 0, 1)
    assert L.next_deadline() == 35.0
    with pytest.raises(ProtocolError, match="finished"):
        L.hold("b", 1, (9,), 6.0)
