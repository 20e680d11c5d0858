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
    if kind == "renew":
        return L.renew(*args)
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
    ("stale_and_early_reads", [
        (("hold", "t", 3, 0.0), []),
        (("read", "t", 2, 0, 1), ["count:stale_read_done"]),
        (("read", "u", 1, 0, 1), ["count:read_done_before_hold"]),  # kept for u's hold
    ]),
    # D READs once the router relays P's block ids, which P's scheduler sends beside the hold: D's
    # answers may reach P's writer first (dropped, they left the blocks pinned until the lease ran out)
    ("read_before_hold", [
        (("read", "t", 1, 0, 1), ["count:read_done_before_hold"]),
        (("hold", "t", 1, 0.0), ["free t1 [3, 4]", "completed t1 pull", "count:lease_read_before_hold"]),
        (("read", "t", 1, 0, 1), ["count:late_read_done"]),
        (("expire", 100.0), []),
    ]),
    ("one_of_two_reads_before_hold", [
        (("read", "t", 1, 1, 2), ["count:read_done_before_hold"]),
        (("hold", "t", 1, 0.0), []),
        (("read", "t", 1, 1, 2), ["count:duplicate_read_done"]),
        (("read", "t", 1, 0, 2), ["free t1 [3, 4]", "completed t1 pull"]),
    ]),
    ("read_before_hold_of_another_generation", [
        (("read", "t", 1, 0, 1), ["count:read_done_before_hold"]),
        (("hold", "t", 2, 0.0), []),  # generation 1's answer is not generation 2's
        (("expire", 30.0), ["free t2 [3, 4]", "failed t2", "count:lease_expired"]),
    ]),
    ("cancel_before_hold", [
        (("cancel", "t", 1, 0.0), ["count:cancel_before_hold"]),
        (("hold", "t", 1, 0.5), ["free t1 [3, 4]", "failed t1", "count:lease_cancelled_before_hold"]),
        (("cancel", "t", 1, 1.0), ["count:cancel_ignored"]),
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


def test_answers_before_hold_are_bounded():
    """Answers for transfers never held (their request failed before the hold) are kept for the
    last ``remember`` transfers only."""
    L = Leases(30.0, remember=2)
    for tid in "abc":
        L.on_read_done(tid, 1, 0, 1)
    assert [short(x) for x in L.hold("a", 1, (1,), 0.0)] == []  # forgotten: held until read or expiry
    assert [short(x) for x in L.hold("c", 1, (2,), 0.0)] == ["free c1 [2]", "completed c1 pull",
                                                             "count:lease_read_before_hold"]
    assert L.held_blocks() == [1]


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


def failed_reason(acts) -> str:
    return next(a.reason for a in acts if isinstance(a, Failed))


# Leases(30.0, lease_max_s=100.0): a renewal moves the deadline to now + 30, never past held_at + 100
RENEWALS = [
    ("renew_moves_the_deadline", [
        (("hold", "t", 1, 0.0), []),
        (("renew", "t", 1, 20.0), ["count:lease_renewed"]),
        (("expire", 30.0), []),  # the held deadline passed: renewed, so nothing ends
        (("expire", 49.9), []),
        (("expire", 50.0), ["free t1 [3, 4]", "failed t1", "count:lease_expired"]),
    ]),
    ("renewed_then_read", [
        (("hold", "t", 1, 0.0), []),
        (("renew", "t", 1, 10.0), ["count:lease_renewed"]),
        (("renew", "t", 1, 35.0), ["count:lease_renewed"]),  # past the first deadline: it was moved
        (("read", "t", 1, 0, 1), ["free t1 [3, 4]", "completed t1 pull"]),
        (("renew", "t", 1, 36.0), ["count:lease_renew_late"]),  # raced the ReadDone
        (("expire", 100.0), []),
    ]),
    ("cap_clips_then_ends", [
        (("hold", "t", 1, 0.0), []),
        (("renew", "t", 1, 20.0), ["count:lease_renewed"]),  # -> 50
        (("renew", "t", 1, 45.0), ["count:lease_renewed"]),  # -> 75
        (("renew", "t", 1, 70.0), ["count:lease_renew_capped"]),  # 100 would be passed: clipped at 100
        (("renew", "t", 1, 90.0), ["count:lease_renew_capped"]),  # the cap is final
        (("expire", 99.9), []),
        (("expire", 100.0), ["free t1 [3, 4]", "failed t1", "count:lease_cap_reached", "count:lease_expired"]),
        (("renew", "t", 1, 100.5), ["count:lease_renew_late"]),
    ]),
    ("renew_after_deadline_does_not_revive", [
        (("hold", "t", 1, 0.0), []),
        (("renew", "t", 1, 30.0), ["count:lease_renew_expired"]),  # due at 30.0: expire() ends it
        (("expire", 30.0), ["free t1 [3, 4]", "failed t1", "count:lease_expired"]),
    ]),
    ("peer_input_is_counted", [
        (("renew", "nobody", 0, 1.0), ["count:lease_renew_unknown"]),
        (("hold", "t", 2, 0.0), []),
        (("renew", "t", 1, 1.0), ["count:lease_renew_stale"]),
        (("renew", "t", 3, 1.0), ["count:lease_renew_unknown"]),  # a generation not held (yet)
        (("expire", 30.0), ["free t2 [3, 4]", "failed t2", "count:lease_expired"]),  # neither renewed it
    ]),
    ("cancelled_then_renewed", [
        (("hold", "t", 1, 0.0), []),
        (("cancel", "t", 1, 1.0), ["free t1 [3, 4]", "failed t1", "count:lease_cancelled"]),
        (("renew", "t", 1, 2.0), ["count:lease_renew_late"]),
    ]),
    ("reissue_renews_only_the_new_generation", [
        (("hold", "t", 1, 0.0), []),
        (("hold", "t", 2, 10.0), ["free t1 [3, 4]", "failed t1", "count:stale_lease"]),
        (("renew", "t", 1, 20.0), ["count:lease_renew_late"]),
        (("renew", "t", 2, 20.0), ["count:lease_renewed"]),  # -> 50
        (("expire", 40.0), []),
        (("expire", 50.0), ["free t2 [3, 4]", "failed t2", "count:lease_expired"]),
    ]),
]


@pytest.mark.parametrize("name,steps", RENEWALS, ids=[c[0] for c in RENEWALS])
def test_lease_renewals(name, steps):
    L = Leases(30.0, lease_max_s=100.0)
    for i, (ev, expected) in enumerate(steps):
        assert [short(a) for a in lease_step(L, ev)] == expected, f"step {i} {ev}"
    L.expire(1e9)
    assert L.held_blocks() == [] and len(L) == 0 and L.next_deadline() is None


def test_lease_renewal_deadlines_and_reasons():
    L = Leases(30.0, lease_max_s=50.0)
    L.hold("a", 1, (1,), 0.0)
    L.hold("b", 1, (2,), 5.0)
    L.renew("a", 1, 10.0)
    assert L.deadline_of("a", 1) == 40.0 and L.next_deadline() == 35.0  # b's, never renewed
    L.renew("a", 1, 25.0)  # 55 would pass the cap: clipped at 50
    assert L.deadline_of("a", 1) == 50.0
    plain = L.expire(35.0)
    assert failed_reason(plain) == "lease of 30.0s expired", plain
    assert L.next_deadline() == 50.0
    capped = L.expire(50.0)
    assert "cap of 50s (lease_max_s) after 1 renewals" in failed_reason(capped), capped
    assert L.next_deadline() is None


def test_lease_max_defaults_to_no_extension_and_is_checked():
    L = Leases(30.0)
    L.hold("t", 1, (1,), 0.0)
    assert [short(a) for a in L.renew("t", 1, 10.0)] == ["count:lease_renew_capped"]
    assert L.deadline_of("t", 1) == 30.0
    assert "cap of 30s" in failed_reason(L.expire(30.0))
    with pytest.raises(ValueError, match="lease_max_s"):
        Leases(30.0, lease_max_s=10.0)
