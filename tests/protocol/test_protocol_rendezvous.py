"""PushRendezvous: table-driven scenarios, illegal events, deadlines, and a random-walk invariant."""
import random

import pytest

from pushkv.messages import Register
from pushkv.protocol.rendezvous import (
    Completed, Count, Failed, FreeBlocks, NotifyFailure, PostWrite, ProtocolError, PushRendezvous, Withdraw,
)

WAIT, XFER = 10.0, 5.0
LATE_WAIT = 100.0
BLOCKS = (4, 5, 6)


def machine(p_rank=0, p_tp=1, total=4, remember=4096):
    return PushRendezvous(p_rank, p_tp, total, registration_wait_s=WAIT, transfer_s=XFER, remember=remember)


def register(tid="t", gen=1, d_rank=0, d_tp=1, deadline=0.0):
    return Register(tid, gen, "D", d_rank, d_tp, (20 + d_rank, 21 + d_rank), 40, deadline)


def short(a):
    """Compact, readable form of an action for the tables."""
    if isinstance(a, PostWrite):
        return f"post {a.transfer_id}{a.generation} {[r.d_rank for r in a.registrations]}"
    if isinstance(a, FreeBlocks):
        return f"free {a.transfer_id}{a.generation}" + ("" if a.block_ids else " (none held)")
    if isinstance(a, NotifyFailure):
        return f"notify {a.transfer_id}{a.generation} {[r.d_rank for r in a.registrations]}"
    if isinstance(a, Completed):
        return f"completed {a.transfer_id}{a.generation} {a.order}"
    if isinstance(a, Failed):
        return f"failed {a.transfer_id}{a.generation}"
    if isinstance(a, Withdraw):
        return f"withdraw {a.transfer_id}{a.generation}"
    if isinstance(a, Count):
        return f"count:{a.name}"
    raise AssertionError(a)


def step(m, ev):
    kind, *args = ev
    if kind == "prefill":
        tid, gen, now = args
        return m.on_prefill_done(tid, gen, BLOCKS, 40, 7, now)
    if kind == "reg":
        tid, gen, d_rank, d_tp, now, *deadline = args
        return m.on_registration(register(tid, gen, d_rank, d_tp, *deadline), now)
    if kind == "done":
        return m.on_write_done(*args)
    if kind == "wfail":
        tid, gen, now = args
        return m.on_write_failed(tid, gen, "nixl error", now)
    if kind == "cancel":  # the scheduler's: always answered
        tid, gen, now = args
        return m.cancel(tid, gen, "aborted", now, answer=True)
    if kind == "dcancel":  # D's (CancelTransfer) or a dead peer's: answered through held blocks only
        tid, gen, now = args
        return m.cancel(tid, gen, "aborted", now)
    if kind == "expire":
        return m.expire(*args)
    if kind == "lprefill":  # a late hold: D's leg leaves the router only now
        tid, gen, now = args
        return m.on_prefill_done(tid, gen, BLOCKS, 40, 7, now, wait_s=LATE_WAIT)
    if kind == "renew":  # D: the leg still queues there
        return m.renew(*args)
    raise AssertionError(kind)


# name, machine kwargs, [(event, expected short actions, state of (t, 1) after or None)]
SCENARIOS = [
    # P's registration clock runs from D's admission: D renews while its leg queues
    ("renewed_while_d_queues", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("renew", "t", 1, 9.0), ["count:renewed"], "wait_registration"),
        (("expire", 10.0), [], "wait_registration"),  # the prefill's own wait is past: renewed
        (("renew", "t", 1, 18.0), ["count:renewed"], "wait_registration"),
        (("reg", "t", 1, 0, 1, 27.0), ["post t1 [0]"], "writing"),
        (("done", "t", 1, 28.0), ["free t1", "completed t1 prefill_first"], None),
    ]),
    ("renewals_stop_then_expire", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("renew", "t", 1, 5.0), ["count:renewed"], "wait_registration"),
        (("expire", 15.0), ["free t1", "failed t1", "count:expired_prefill"], None),
        (("renew", "t", 1, 16.0), ["count:renew_ignored"], None),
    ]),
    ("renew_past_the_deadline_revives_nothing", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("renew", "t", 1, 10.0), ["count:renew_expired"], "wait_registration"),
        (("expire", 10.0), ["free t1", "failed t1", "count:expired_prefill"], None),
    ]),
    ("renew_without_a_registration_clock", {}, [
        (("renew", "t", 1, 0.0), ["count:renew_ignored"], None),  # no prefill yet: nothing to time
        (("reg", "t", 1, 0, 1, 1.0), [], "wait_prefill"),
        (("renew", "t", 1, 2.0), ["count:renew_ignored"], "wait_prefill"),
        (("prefill", "t", 1, 3.0), ["post t1 [0]"], "writing"),
        (("renew", "t", 1, 4.0), ["count:renew_ignored"], "writing"),
    ]),
    # a late hold waits for D's leg to leave the router; once D renews, the usual wait
    ("late_hold_waits_for_the_router", {}, [
        (("lprefill", "t", 1, 0.0), [], "wait_registration"),
        (("expire", WAIT * 5), [], "wait_registration"),
        (("renew", "t", 1, 60.0), ["count:renewed"], "wait_registration"),
        (("expire", 60.0 + WAIT), ["free t1", "failed t1", "count:expired_prefill"], None),
    ]),
    ("prefill_first", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 1.0), ["post t1 [0]"], "writing"),
        (("done", "t", 1, 2.0), ["free t1", "completed t1 prefill_first"], None),
    ]),
    ("registration_first", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 1.0), ["post t1 [0]"], "writing"),
        (("done", "t", 1, 2.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    ("tp1_to_2_needs_both", {}, [
        (("reg", "t", 1, 1, 2, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 1.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 2, 2.0), ["post t1 [0, 1]"], "writing"),
        (("done", "t", 1, 3.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    ("tp2_to_1_rank1_writes_d0", dict(p_rank=1, p_tp=2), [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 1.0), ["post t1 [0]"], "writing"),
    ]),
    ("tp2_to_2_unneeded_rank", dict(p_rank=0, p_tp=2), [
        (("reg", "t", 1, 1, 2, 0.0), ["count:unneeded_registration"], None),
        (("reg", "t", 1, 0, 2, 0.0), [], "wait_prefill"),
    ]),
    ("bad_d_tp", {}, [(("reg", "t", 1, 0, 3, 0.0), ["count:bad_registration"], None)]),
    ("huge_d_tp", {}, [(("reg", "t", 1, 0, 2**31, 0.0), ["count:bad_registration"], None)]),
    ("duplicate_registration_waiting", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 1.0), ["count:duplicate_registration"], "wait_prefill"),
    ]),
    ("duplicate_registration_writing", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 1.0), ["post t1 [0]"], "writing"),
        (("reg", "t", 1, 0, 1, 1.5), ["count:duplicate_registration"], "writing"),
    ]),
    ("tp_mismatch", {}, [
        (("reg", "t", 1, 0, 2, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 0.0), ["count:registration_tp_mismatch"], "wait_prefill"),
    ]),
    ("reissue_prefill_held_new_registration", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 2, 0, 1, 1.0), ["free t1", "failed t1", "count:stale_prefill"], None),
        (("prefill", "t", 2, 2.0), ["post t2 [0]"], None),
        (("done", "t", 2, 3.0), ["free t2", "completed t2 registration_first"], None),
    ]),
    ("reissue_registration_held_new_prefill", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prefill", "t", 2, 1.0), ["notify t1 [0]", "failed t1", "count:stale_registration"], None),
        (("reg", "t", 2, 0, 1, 2.0), ["post t2 [0]"], None),
    ]),
    ("stale_registration_ignored", {}, [
        (("prefill", "t", 2, 0.0), [], None),
        (("reg", "t", 1, 0, 1, 1.0), ["notify t1 [0]", "count:stale_registration"], None),
        (("reg", "t", 2, 0, 1, 2.0), ["post t2 [0]"], None),
    ]),
    ("stale_prefill_freed_at_once", {}, [
        (("reg", "t", 2, 0, 1, 0.0), [], None),
        (("prefill", "t", 1, 1.0), ["free t1", "failed t1", "count:stale_prefill"], None),
        (("prefill", "t", 2, 2.0), ["post t2 [0]"], None),
    ]),
    ("reissue_while_writing", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        (("reg", "t", 2, 0, 1, 1.0), ["failed t1", "count:superseded_writing"], "draining"),
        (("prefill", "t", 2, 1.5), ["post t2 [0]"], "draining"),
        (("done", "t", 1, 2.0), ["free t1"], None),
        (("done", "t", 2, 2.5), ["free t2", "completed t2 registration_first"], None),
    ]),
    ("expire_prefill_held", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("expire", 9.9), [], "wait_registration"),
        (("expire", 10.0), ["free t1", "failed t1", "count:expired_prefill"], None),
        (("reg", "t", 1, 0, 1, 11.0), ["notify t1 [0]", "count:late_registration"], None),
    ]),
    ("expire_partial_registrations_with_prefill", {}, [
        (("reg", "t", 1, 0, 2, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 1.0), [], "wait_registration"),
        (("expire", 11.0), ["free t1", "notify t1 [0]", "failed t1", "count:expired_prefill"], None),
    ]),
    ("expire_registration_held", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("expire", 10.0), ["notify t1 [0]", "failed t1", "count:expired_registration"], None),
        (("prefill", "t", 1, 11.0), ["free t1", "count:late_prefill"], None),
    ]),
    ("registration_deadline_shorter_than_wait", {}, [
        (("reg", "t", 1, 0, 1, 0.0, 3.0), [], "wait_prefill"),
        (("expire", 3.0), ["notify t1 [0]", "failed t1", "count:expired_registration"], None),
    ]),
    ("expire_writing_keeps_blocks_until_done", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 1.0), ["post t1 [0]"], "writing"),
        (("expire", 5.9), [], "writing"),
        (("expire", 6.0), ["failed t1", "count:expired_transfer"], "draining"),  # D hears from the WRITE
        (("reg", "t", 1, 0, 1, 6.5), ["count:duplicate_registration"], "draining"),
        (("cancel", "t", 1, 6.6), ["count:cancel_ignored"], "draining"),
        (("done", "t", 1, 7.0), ["free t1"], None),
    ]),
    ("stuck_write_is_counted_not_freed", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        (("expire", 5.0), ["failed t1", "count:expired_transfer"], "draining"),
        (("expire", 10.0), ["count:write_stuck"], "draining"),
        (("expire", 100.0), [], "draining"),
        (("wfail", "t", 1, 101.0), ["free t1", "notify t1 [0]"], None),  # only now can D reuse its blocks
    ]),
    ("write_failed", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 0.0), ["post t1 [0]"], "writing"),
        (("wfail", "t", 1, 1.0), ["free t1", "notify t1 [0]", "failed t1", "count:write_failed"], None),
    ]),
    ("cancel_prefill_held", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("cancel", "t", 1, 1.0), ["free t1", "failed t1", "count:cancelled"], None),
        (("cancel", "t", 1, 1.5), ["free t1 (none held)", "count:cancel_ignored"], None),
    ]),
    ("cancel_registration_held", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        # no blocks held here, but the scheduler (layer stream: blocks handed over by marks) waits for an answer
        (("cancel", "t", 1, 1.0), ["free t1 (none held)", "notify t1 [0]", "failed t1", "count:cancelled"], None),
    ]),
    ("d_cancel_writing_defers_free", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        # D is not told while the WRITE may still land in its blocks; the WRITE's own
        # completion notification tells it
        (("dcancel", "t", 1, 1.0), ["failed t1", "count:cancelled"], "draining"),
        (("done", "t", 1, 2.0), ["free t1"], None),
    ]),
    # the scheduler's cancel finds the last WRITE asked for: it may be on the link already, and
    # then D gets its notification and the KV whole; the WRITE's end is the outcome
    ("cancel_writing_withdraws_then_the_write_landed", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        (("cancel", "t", 1, 1.0), ["withdraw t1", "count:withdrawn"], "draining"),
        (("cancel", "t", 1, 1.5), ["count:cancel_ignored"], "draining"),  # answered once, at the end
        (("done", "t", 1, 2.0), ["free t1", "completed t1 prefill_first"], None),
        (("reg", "t", 1, 0, 1, 2.5), ["count:late_registration"], None),  # it succeeded: nothing to tell
    ]),
    ("cancel_writing_withdraws_then_the_write_never_went", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 0.0), ["post t1 [0]"], "writing"),
        (("cancel", "t", 1, 1.0), ["withdraw t1", "count:withdrawn"], "draining"),
        # the writer took it out of its link queue: it fails, and only now is D told
        (("wfail", "t", 1, 1.1), ["free t1", "failed t1", "notify t1 [0]"], None),
        (("reg", "t", 1, 0, 1, 2.5), ["notify t1 [0]", "count:late_registration"], None),
    ]),
    ("cancel_writing_withdrawn_write_stuck", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        (("cancel", "t", 1, 1.0), ["withdraw t1", "count:withdrawn"], "draining"),
        (("expire", 1.0 + XFER), ["count:write_stuck"], "draining"),  # still pinned, no outcome yet
        (("wfail", "t", 1, 100.0), ["free t1", "failed t1", "notify t1 [0]"], None),
    ]),
    ("d_cancels_a_held_registration", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("dcancel", "t", 1, 1.0), ["notify t1 [0]", "failed t1", "count:cancelled"], None),
        # the scheduler's own cancel after D's: answered, so a stream's scheduler frees its blocks
        (("cancel", "t", 1, 1.5), ["free t1 (none held)", "count:cancel_ignored"], None),
    ]),
    ("cancel_before_either_half", {}, [
        (("cancel", "t", 1, 0.0), ["free t1 (none held)", "failed t1", "count:cancelled"], None),
        (("prefill", "t", 1, 1.0), ["free t1", "count:late_prefill"], None),
        (("reg", "t", 1, 0, 1, 2.0), ["notify t1 [0]", "count:late_registration"], None),
    ]),
    ("late_registration_after_completion", {}, [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 1, 0.0), ["post t1 [0]"], "writing"),
        (("done", "t", 1, 1.0), ["free t1", "completed t1 prefill_first"], None),
        (("reg", "t", 1, 0, 1, 2.0), ["count:late_registration"], None),
    ]),
    # more P ranks than KV heads: rank 1 of 4 holds head 0, which rank 0 writes
    ("replica_rank_frees_at_prefill", dict(p_rank=1, p_tp=4, total=2), [
        (("prefill", "t", 1, 0.0), ["free t1", "completed t1 replica"], None),
        (("reg", "t", 1, 0, 2, 1.0), ["count:unneeded_registration"], None),
        (("prefill", "u", 1, 2.0), ["free u1", "completed u1 replica"], None),
    ]),
    ("mla_latent_rank0_writes_every_d_rank", dict(p_rank=0, p_tp=2, total=1), [
        (("prefill", "t", 1, 0.0), [], "wait_registration"),
        (("reg", "t", 1, 1, 2, 1.0), [], "wait_registration"),
        (("reg", "t", 1, 0, 2, 1.5), ["post t1 [0, 1]"], "writing"),
    ]),
    ("mla_latent_rank1_is_replica", dict(p_rank=1, p_tp=2, total=1), [
        (("prefill", "t", 1, 0.0), ["free t1", "completed t1 replica"], None),
    ]),
    ("independent_transfers", {}, [
        (("prefill", "a", 1, 0.0), [], None),
        (("prefill", "b", 1, 0.0), [], None),
        (("reg", "b", 1, 0, 1, 1.0), ["post b1 [0]"], None),
        (("reg", "a", 1, 0, 1, 1.0), ["post a1 [0]"], None),
    ]),
]


@pytest.mark.parametrize("name,kw,steps", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_scenarios(name, kw, steps):
    m = machine(**kw)
    for i, (ev, expected, state) in enumerate(steps):
        got = [short(a) for a in step(m, ev)]
        assert got == expected, f"step {i} {ev}"
        assert m.state_of("t", 1) == state, f"step {i} {ev}"


def test_post_write_carries_everything():
    m = machine()
    m.on_registration(register(d_rank=1, d_tp=2), 0.0)
    m.on_registration(register(d_rank=0, d_tp=2), 0.0)
    (post,) = m.on_prefill_done("t", 1, BLOCKS, 40, 7, 1.0)
    assert post == PostWrite("t", 1, BLOCKS, 40, 7, (register(d_rank=0, d_tp=2), register(d_rank=1, d_tp=2)))
    assert m.held_blocks() == list(BLOCKS)
    assert m.on_write_done("t", 1, 2.0)[0] == FreeBlocks("t", 1, BLOCKS, "written")
    assert m.held_blocks() == [] and len(m) == 0


# setup events, then an illegal event: ProtocolError naming state+event, state unchanged
ILLEGAL = [
    ("write_done_unknown", [], ("done", "t", 1, 0.0), "unknown", "write_done"),
    ("write_failed_unknown", [], ("wfail", "t", 1, 0.0), "unknown", "write_failed"),
    ("second_prefill", [("prefill", "t", 1, 0.0)], ("prefill", "t", 1, 1.0), "wait_registration", "prefill_done"),
    ("write_done_before_post", [("reg", "t", 1, 0, 1, 0.0)], ("done", "t", 1, 1.0), "wait_prefill", "write_done"),
    ("prefill_while_writing", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 0.0)],
     ("prefill", "t", 1, 1.0), "writing", "prefill_done"),
    ("prefill_after_completed", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 0.0), ("done", "t", 1, 0.0)],
     ("prefill", "t", 1, 1.0), "finished", "prefill_done"),
    ("write_done_twice", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 0.0), ("done", "t", 1, 0.0)],
     ("done", "t", 1, 1.0), "finished", "write_done"),
]


@pytest.mark.parametrize("name,setup,event,state,ev_name", ILLEGAL, ids=[c[0] for c in ILLEGAL])
def test_illegal_events_raise_and_change_nothing(name, setup, event, state, ev_name):
    m = machine()
    for ev in setup:
        step(m, ev)
    before = (m.state_of("t", 1), m.next_deadline(), m.held_blocks())
    with pytest.raises(ProtocolError) as info:
        step(m, event)
    assert info.value.state == state and info.value.event == ev_name
    assert state in str(info.value) and ev_name in str(info.value)
    assert (m.state_of("t", 1), m.next_deadline(), m.held_blocks()) == before


DEADLINES = [
    ("none_when_idle", [], None),
    ("prefill_held", [("prefill", "t", 1, 1.0)], 1.0 + WAIT),
    ("registration_held", [("reg", "t", 1, 0, 1, 2.0)], 2.0 + WAIT),
    ("prefill_rearms_for_missing_registrations", [("reg", "t", 1, 0, 2, 0.0), ("prefill", "t", 1, 4.0)], 4.0 + WAIT),
    ("writing", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 3.0)], 3.0 + XFER),
    ("draining", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 0.0), ("cancel", "t", 1, 1.0)], 1.0 + XFER),
    ("earliest_of_many", [("prefill", "a", 1, 5.0), ("reg", "b", 1, 0, 1, 2.0)], 2.0 + WAIT),
    ("cleared_when_done", [("prefill", "t", 1, 0.0), ("reg", "t", 1, 0, 1, 0.0), ("done", "t", 1, 1.0)], None),
    ("cleared_when_superseded", [("prefill", "t", 1, 0.0), ("reg", "t", 2, 0, 1, 3.0)], 3.0 + WAIT),
    ("late_hold", [("lprefill", "t", 1, 1.0)], 1.0 + LATE_WAIT),
    ("renewal_rearms_from_now", [("prefill", "t", 1, 0.0), ("renew", "t", 1, 7.0)], 7.0 + WAIT),
    ("renewal_shortens_a_late_hold", [("lprefill", "t", 1, 0.0), ("renew", "t", 1, 7.0)], 7.0 + WAIT),
]


@pytest.mark.parametrize("name,events,expected", DEADLINES, ids=[c[0] for c in DEADLINES])
def test_next_deadline(name, events, expected):
    m = machine()
    for ev in events:
        step(m, ev)
    assert m.next_deadline() == expected


def test_finished_memory_is_bounded():
    m = machine(remember=8)
    for i in range(100):
        tid = f"t{i}"
        m.on_prefill_done(tid, 1, BLOCKS, 40, 7, 0.0)
        m.on_registration(register(tid), 0.0)
        m.on_write_done(tid, 1, 0.0)
    assert len(m) == 0 and len(m._finished) <= 8 and len(m._newest) <= 8
    # the recent ones are still recognised as late
    assert [short(a) for a in m.on_registration(register("t99"), 1.0)] == ["count:late_registration"]


@pytest.mark.parametrize("seed", range(100))
def test_random_walk_frees_every_prefill_exactly_once(seed):
    """Any interleaving: one FreeBlocks per prefill, never while its WRITE may read,
    no NotifyFailure while it may still write, at most one outcome per (tid, gen),
    and nothing held at the end."""
    rng = random.Random(seed)
    m = machine(p_tp=1, total=4)
    now = 0.0
    given = set()  # (tid, gen) prefills handed in
    in_flight = set()  # posted, WRITE not yet reported
    reported = set()
    freed: dict = {}
    outcomes: dict = {}
    completed, told = set(), set()  # P's success; D told of a failure

    def absorb(actions):
        for a in actions:
            key = (a.transfer_id, a.generation) if hasattr(a, "transfer_id") else None
            if isinstance(a, PostWrite):
                assert key not in in_flight and key not in reported
                in_flight.add(key)
            elif isinstance(a, FreeBlocks) and not a.block_ids:  # a cancel's answer: nothing was held
                assert key not in in_flight, f"empty report of {key} while a WRITE may read its blocks"
            elif isinstance(a, FreeBlocks):
                assert key not in in_flight, f"freed while WRITE may read {key}"
                freed[key] = freed.get(key, 0) + 1
            elif isinstance(a, (Completed, Failed)):
                outcomes[key] = outcomes.get(key, 0) + 1
                if isinstance(a, Completed):
                    completed.add(key)
            elif isinstance(a, NotifyFailure):  # D reuses its blocks when told
                assert key not in in_flight, f"D told to give up while a WRITE may land {key}"
                told.add(key)

    d_tp = 1 + seed % 2
    for _ in range(80):
        now += rng.choice([0.0, 0.0, 0.5, 2.0, 6.0])
        tid, gen = rng.choice("ab"), rng.randint(1, 2)
        r = rng.random()
        if r < 0.3 and (tid, gen) not in given:
            given.add((tid, gen))
            absorb(m.on_prefill_done(tid, gen, BLOCKS, 40, 7, now))
        elif r < 0.6:
            absorb(m.on_registration(register(tid, gen, rng.randint(0, d_tp - 1), d_tp), now))
        elif r < 0.75 and in_flight:
            key = rng.choice(sorted(in_flight))
            in_flight.discard(key)
            reported.add(key)
            if rng.random() < 0.7:
                absorb(m.on_write_done(*key, now))
            else:
                absorb(m.on_write_failed(*key, "x", now))
        elif r < 0.85:
            absorb(m.cancel(tid, gen, "abort", now, answer=True))
        else:
            absorb(m.expire(now))
    for key in sorted(in_flight):
        in_flight.discard(key)
        absorb(m.on_write_done(*key, now))
    absorb(m.expire(now + 1e6))
    assert freed == {k: 1 for k in given}
    assert all(v == 1 for v in outcomes.values())
    assert not completed & told, "P completed a transfer D was told had failed"
    assert m.held_blocks() == [] and len(m) == 0 and m.next_deadline() is None
