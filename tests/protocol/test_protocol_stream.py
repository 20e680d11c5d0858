"""PushRendezvous, streaming push (chunk): part WRITEs while P still computes.

Table-driven like tests/protocol/test_protocol_rendezvous.py: each scenario is a list of
(event, expected actions, state of (t, 1) afterwards). Parts are written
``part <tid><gen> <d ranks> <token_start>+<num_tokens>``, the last WRITE (D's
notification) ``last ... ft<first token>``.
"""
import random

import pytest

from pushkv.messages import Register
from pushkv.protocol.rendezvous import (
    PARTS_AHEAD, Completed, Count, Failed, FreeBlocks, NotifyFailure, PostWrite, ProtocolError, PushRendezvous,
)

WAIT, XFER = 10.0, 5.0
UNIT = 16  # tokens per streamed unit (lcm of the two block sizes)
BLOCKS = tuple(range(8))  # P's blocks: enough for every prompt below at block size 16
FIRST = 7


def machine(p_rank=0, p_tp=1, total=4, unit=UNIT):
    return PushRendezvous(p_rank, p_tp, total, registration_wait_s=WAIT, transfer_s=XFER, stream_unit=unit)


def register(tid="t", gen=1, d_rank=0, d_tp=1, deadline=0.0):
    return Register(tid, gen, "D", d_rank, d_tp, (20 + d_rank, 21 + d_rank), 40, deadline)


def short(a):
    if isinstance(a, PostWrite):
        kind = "last" if a.last else "part"
        ranks = [r.d_rank for r in a.registrations]
        tail = f" ft{a.first_token}" if a.last else ""
        return f"{kind} {a.transfer_id}{a.generation} {ranks} {a.token_start}+{a.num_tokens}{tail}"
    if isinstance(a, FreeBlocks):
        return f"free {a.transfer_id}{a.generation}"
    if isinstance(a, NotifyFailure):
        return f"notify {a.transfer_id}{a.generation} {[r.d_rank for r in a.registrations]}"
    if isinstance(a, Completed):
        return f"completed {a.transfer_id}{a.generation} {a.order}"
    if isinstance(a, Failed):
        return f"failed {a.transfer_id}{a.generation}"
    if isinstance(a, Count):
        return f"count:{a.name}"
    raise AssertionError(a)


def step(m, ev):
    kind, *args = ev
    if kind == "prog":  # a chunk ended: the prompt's first n tokens are in
        tid, gen, n, now = args
        return m.on_prefill_progress(tid, gen, BLOCKS, n, now)
    if kind == "prefill":  # prefill ended: n prompt tokens in all
        tid, gen, n, now = args
        return m.on_prefill_done(tid, gen, BLOCKS, n, FIRST, now)
    if kind == "reg":
        tid, gen, d_rank, d_tp, now, *deadline = args
        return m.on_registration(register(tid, gen, d_rank, d_tp, *deadline), now)
    if kind in ("pdone", "done"):  # a part / the last WRITE completed
        tid, gen, now = args
        return m.on_write_done(tid, gen, now, part=kind == "pdone")
    if kind in ("pfail", "wfail"):
        tid, gen, now = args
        return m.on_write_failed(tid, gen, "nixl error", now, part=kind == "pfail")
    if kind == "cancel":
        tid, gen, now = args
        return m.cancel(tid, gen, "aborted", now)
    if kind == "expire":
        return m.expire(*args)
    raise AssertionError(kind)


SCENARIOS = [
    ("progress_before_registration", {}, [
        (("prog", "t", 1, 20, 0.0), [], "wait_prefill"),  # no registration yet: nothing can leave
        (("prog", "t", 1, 40, 1.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 2.0), ["part t1 [0] 0+32"], "wait_prefill"),  # whole units only
        (("pdone", "t", 1, 3.0), [], "wait_prefill"),  # 40 computed, 32 sent: no whole unit more
        (("prog", "t", 1, 50, 4.0), ["part t1 [0] 32+16"], "wait_prefill"),
        (("prefill", "t", 1, 53, 5.0), [], "writing"),  # final_pending: a part still flies
        (("pdone", "t", 1, 6.0), ["last t1 [0] 48+5 ft7"], "writing"),
        (("done", "t", 1, 7.0), ["free t1", "completed t1 prefill_first"], None),
    ]),
    ("registration_before_progress", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 10, 1.0), [], "wait_prefill"),  # less than a unit
        (("prog", "t", 1, 16, 2.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("pdone", "t", 1, 2.5), [], "wait_prefill"),
        (("prog", "t", 1, 40, 3.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("pdone", "t", 1, 6.0), [], "wait_prefill"),
        (("prefill", "t", 1, 45, 7.0), ["last t1 [0] 32+13 ft7"], "writing"),  # no part flies: at once
        (("done", "t", 1, 8.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    # -- two parts ahead (PARTS_AHEAD): the next part is asked while the previous one flies
    ("second_part_asked_while_the_first_flies", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 40, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),  # at once: only one flies
        (("prog", "t", 1, 50, 3.0), [], "wait_prefill"),  # two fly: a third waits
        (("prog", "t", 1, 70, 4.0), [], "wait_prefill"),
        (("pdone", "t", 1, 5.0), ["part t1 [0] 32+32"], "wait_prefill"),  # everything computed meanwhile
        (("pdone", "t", 1, 6.0), [], "wait_prefill"),  # 70 computed, 64 sent: no whole unit more
        (("pdone", "t", 1, 7.0), [], "wait_prefill"),
        (("prefill", "t", 1, 75, 8.0), ["last t1 [0] 64+11 ft7"], "writing"),
        (("done", "t", 1, 9.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    ("registration_releases_one_part_and_the_next_follows", {}, [
        (("prog", "t", 1, 40, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),  # what is whole, in one part
        (("prog", "t", 1, 64, 2.0), ["part t1 [0] 32+32"], "wait_prefill"),
        (("prog", "t", 1, 80, 3.0), [], "wait_prefill"),
        (("pdone", "t", 1, 4.0), ["part t1 [0] 64+16"], "wait_prefill"),
    ]),
    ("last_write_waits_for_both_parts", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 32, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("prefill", "t", 1, 40, 3.0), [], "writing"),  # final_pending: two parts fly
        (("pdone", "t", 1, 4.0), [], "writing"),  # one still flies
        (("pdone", "t", 1, 5.0), ["last t1 [0] 32+8 ft7"], "writing"),
        (("done", "t", 1, 6.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    ("first_to_end_fails_while_both_fly", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 32, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("pfail", "t", 1, 3.0), ["failed t1", "count:write_failed"], "draining"),  # the other still reads
        (("prog", "t", 1, 48, 3.5), ["count:late_progress"], "draining"),  # no part more
        (("pdone", "t", 1, 4.0), ["free t1", "notify t1 [0]"], None),  # drained: freed, D told once
        (("prefill", "t", 1, 50, 5.0), ["free t1", "count:late_prefill"], None),
    ]),
    ("second_to_end_fails_after_the_first_completed", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 32, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("prog", "t", 1, 48, 2.5), [], "wait_prefill"),
        (("pdone", "t", 1, 3.0), ["part t1 [0] 32+16"], "wait_prefill"),  # two fly again
        (("pfail", "t", 1, 4.0), ["failed t1", "count:write_failed"], "draining"),
        (("pdone", "t", 1, 5.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("both_parts_fail", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 32, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("prefill", "t", 1, 40, 2.5), [], "writing"),
        (("pfail", "t", 1, 3.0), ["failed t1", "count:write_failed"], "draining"),
        (("pfail", "t", 1, 4.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("cancel_while_both_fly", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), ["part t1 [0] 0+16"], "wait_prefill"),
        (("prog", "t", 1, 32, 2.0), ["part t1 [0] 16+16"], "wait_prefill"),
        (("cancel", "t", 1, 3.0), ["failed t1", "count:cancelled"], "draining"),
        (("pdone", "t", 1, 4.0), [], "draining"),  # one still reads the blocks
        (("pdone", "t", 1, 5.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("parts_wait_for_every_d_rank", {}, [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 1, 2, 1.0), [], "wait_prefill"),  # D rank 0 not registered yet
        (("reg", "t", 1, 0, 2, 2.0), ["part t1 [0, 1] 0+32"], "wait_prefill"),
        (("pdone", "t", 1, 3.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 4.0), ["last t1 [0, 1] 32+8 ft7"], "writing"),
    ]),
    ("unit_is_whole_blocks_of_both_sides", dict(unit=32), [  # P 16 / D 32: lcm 32
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 16, 1.0), [], "wait_prefill"),
        (("prog", "t", 1, 31, 2.0), [], "wait_prefill"),
        (("prog", "t", 1, 95, 3.0), ["part t1 [0] 0+64"], "wait_prefill"),
        (("pdone", "t", 1, 4.0), [], "wait_prefill"),
        (("prefill", "t", 1, 100, 5.0), ["last t1 [0] 64+36 ft7"], "writing"),
    ]),
    ("prompt_ends_on_a_unit", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("pdone", "t", 1, 2.0), [], "wait_prefill"),
        (("prefill", "t", 1, 48, 3.0), ["last t1 [0] 32+16 ft7"], "writing"),
    ]),
    ("no_part_ever_whole_prompt_in_the_last", {}, [  # progress seen, but never a whole unit
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 8, 1.0), [], "wait_prefill"),
        (("prefill", "t", 1, 12, 2.0), ["last t1 [0] 0+12 ft7"], "writing"),
    ]),
    ("stream_unit_zero_posts_nothing_until_prefill", dict(unit=0), [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), [], "wait_prefill"),
        (("prog", "t", 1, 64, 2.0), [], "wait_prefill"),
        (("prefill", "t", 1, 70, 3.0), ["last t1 [0] 0+70 ft7"], "writing"),
        (("done", "t", 1, 4.0), ["free t1", "completed t1 registration_first"], None),
    ]),
    ("stream_unit_zero_progress_first", dict(unit=0), [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 1.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 2.0), ["last t1 [0] 0+40 ft7"], "writing"),
    ]),
    # -- failures of a part
    ("part_fails_while_waiting_for_prefill", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("pfail", "t", 1, 2.0), ["free t1", "notify t1 [0]", "failed t1", "count:write_failed"], None),
        (("prog", "t", 1, 48, 3.0), ["count:late_progress"], None),  # the scheduler had not heard yet
        (("prefill", "t", 1, 50, 4.0), ["free t1", "count:late_prefill"], None),
        (("reg", "t", 1, 0, 1, 5.0), ["notify t1 [0]", "count:late_registration"], None),
    ]),
    ("part_fails_with_the_last_write_pending", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("prefill", "t", 1, 40, 2.0), [], "writing"),
        (("pfail", "t", 1, 3.0), ["free t1", "notify t1 [0]", "failed t1", "count:write_failed"], None),
    ]),
    ("last_write_fails_after_parts", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("pdone", "t", 1, 2.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 3.0), ["last t1 [0] 32+8 ft7"], "writing"),
        (("wfail", "t", 1, 4.0), ["free t1", "notify t1 [0]", "failed t1", "count:write_failed"], None),
    ]),
    # -- cancel and deadlines while a part flies: drain, then free and tell D
    ("cancel_while_part_flies_waiting", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("cancel", "t", 1, 2.0), ["failed t1", "count:cancelled"], "draining"),  # D not told yet
        (("prog", "t", 1, 48, 2.5), ["count:late_progress"], "draining"),
        (("reg", "t", 1, 0, 1, 2.6), ["count:duplicate_registration"], "draining"),
        (("cancel", "t", 1, 2.7), ["count:cancel_ignored"], "draining"),
        (("pdone", "t", 1, 3.0), ["free t1", "notify t1 [0]"], None),  # a part carries no WriteDone: tell D
        (("cancel", "t", 1, 4.0), ["count:cancel_ignored"], None),
    ]),
    ("cancel_while_part_flies_last_pending", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("prefill", "t", 1, 40, 2.0), [], "writing"),
        (("cancel", "t", 1, 3.0), ["failed t1", "count:cancelled"], "draining"),
        (("pfail", "t", 1, 4.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("cancel_while_last_write_flies_after_parts", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("pdone", "t", 1, 2.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 3.0), ["last t1 [0] 32+8 ft7"], "writing"),
        (("cancel", "t", 1, 4.0), ["failed t1", "count:cancelled"], "draining"),
        (("done", "t", 1, 5.0), ["free t1"], None),  # its WriteDone tells D itself
    ]),
    ("cancel_streamed_nothing_in_flight", {}, [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("cancel", "t", 1, 1.0), ["free t1", "failed t1", "count:cancelled"], None),
        (("reg", "t", 1, 0, 1, 2.0), ["notify t1 [0]", "count:late_registration"], None),
    ]),
    ("cancel_streamed_with_registration_between_parts", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("pdone", "t", 1, 2.0), [], "wait_prefill"),
        (("cancel", "t", 1, 3.0), ["free t1", "notify t1 [0]", "failed t1", "count:cancelled"], None),
    ]),
    ("expire_while_part_flies", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("expire", 10.9), [], "wait_prefill"),  # progress re-armed the wait at 1.0
        (("expire", 11.0), ["failed t1", "count:expired_registration"], "draining"),
        (("expire", 16.0), ["count:write_stuck"], "draining"),  # kept: the part may still read
        (("pfail", "t", 1, 17.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("expire_while_last_pending", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("prefill", "t", 1, 40, 2.0), [], "writing"),
        (("expire", 7.0), ["failed t1", "count:expired_transfer"], "draining"),
        (("pdone", "t", 1, 8.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("expire_stream_without_registration", {}, [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 48, 5.0), [], "wait_prefill"),
        (("expire", 14.9), [], "wait_prefill"),  # the stream is alive: each chunk re-arms
        (("expire", 15.0), ["free t1", "failed t1", "count:expired_registration"], None),
    ]),
    # -- stale and late input: counted, never raised
    ("stale_progress_counted", {}, [
        (("prog", "t", 1, 40, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 40, 1.0), ["count:stale_progress"], "wait_prefill"),
        (("prog", "t", 1, 20, 2.0), ["count:stale_progress"], "wait_prefill"),
        (("reg", "t", 1, 0, 1, 3.0), ["part t1 [0] 0+32"], "wait_prefill"),
    ]),
    ("late_progress_after_completion", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 1.0), ["last t1 [0] 0+40 ft7"], "writing"),
        (("done", "t", 1, 2.0), ["free t1", "completed t1 registration_first"], None),
        (("prog", "t", 1, 32, 3.0), ["count:late_progress"], None),
    ]),
    ("progress_of_a_stale_generation", {}, [
        (("reg", "t", 2, 0, 1, 0.0), [], None),
        (("prog", "t", 1, 32, 1.0), ["count:late_progress"], None),
    ]),
    ("superseded_while_a_part_flies", {}, [
        (("reg", "t", 1, 0, 1, 0.0), [], "wait_prefill"),
        (("prog", "t", 1, 32, 1.0), ["part t1 [0] 0+32"], "wait_prefill"),
        (("reg", "t", 2, 0, 1, 2.0), ["failed t1", "count:superseded_writing"], "draining"),
        (("pdone", "t", 1, 3.0), ["free t1", "notify t1 [0]"], None),
    ]),
    ("superseded_stream_nothing_in_flight", {}, [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("prog", "t", 2, 16, 1.0), ["free t1", "failed t1"], None),
    ]),
    # -- a replica rank (every head written by a lower rank) tracks the stream, writes nothing
    ("replica_frees_on_prefill_done", dict(p_rank=1, p_tp=4, total=2), [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("reg", "t", 1, 0, 2, 0.5), ["count:unneeded_registration"], "wait_prefill"),
        (("prog", "t", 1, 64, 1.0), [], "wait_prefill"),
        (("prefill", "t", 1, 70, 2.0), ["free t1", "completed t1 replica"], None),
    ]),
    ("replica_answers_a_cancel", dict(p_rank=1, p_tp=4, total=2), [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("cancel", "t", 1, 1.0), ["free t1", "failed t1", "count:cancelled"], None),
        (("prefill", "t", 1, 40, 2.0), ["free t1", "count:late_prefill"], None),
    ]),
    ("mla_replica_rank_streams_nothing", dict(p_rank=1, p_tp=2, total=1), [
        (("prog", "t", 1, 32, 0.0), [], "wait_prefill"),
        (("prefill", "t", 1, 40, 1.0), ["free t1", "completed t1 replica"], None),
    ]),
]


@pytest.mark.parametrize("name,kw,steps", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_scenarios(name, kw, steps):
    m = machine(**kw)
    for i, (ev, expected, state) in enumerate(steps):
        got = [short(a) for a in step(m, ev)]
        assert got == expected, f"step {i} {ev}"
        assert m.state_of("t", 1) == state, f"step {i} {ev}"


def test_a_part_names_the_whole_block_list_and_every_registration():
    """The writer slices both block tables at token_start itself: the action carries the
    request's whole block lists, the registrations in ascending D rank."""
    m = machine()
    m.on_registration(register(d_rank=1, d_tp=2), 0.0)
    m.on_registration(register(d_rank=0, d_tp=2), 0.0)
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 33, 1.0)
    regs = (register(d_rank=0, d_tp=2), register(d_rank=1, d_tp=2))
    assert part == PostWrite("t", 1, BLOCKS, 32, 0, regs, token_start=0, last=False)
    assert m.on_write_done("t", 1, 2.0, part=True) == []
    (last,) = m.on_prefill_done("t", 1, BLOCKS, 33, FIRST, 3.0)
    assert last == PostWrite("t", 1, BLOCKS, 1, FIRST, regs, token_start=32, last=True)


def test_drained_stream_tells_d_with_the_cancel_reason():
    m = machine()
    m.on_registration(register(), 0.0)
    m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0)
    m.cancel("t", 1, "client went away", 2.0)
    free, notify = m.on_write_done("t", 1, 3.0, part=True)
    assert isinstance(notify, NotifyFailure) and notify.reason == "client went away"
    assert free.block_ids == BLOCKS


def test_a_failed_drain_names_the_write_failure():
    m = machine()
    m.on_registration(register(), 0.0)
    m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0)
    m.cancel("t", 1, "client went away", 2.0)
    free, notify = m.on_write_failed("t", 1, "UCX_ERR_CONNECTION_RESET", 3.0, part=True)
    assert free.reason == notify.reason == "UCX_ERR_CONNECTION_RESET"


def test_deadlines_of_a_stream():
    m = machine()
    m.on_registration(register(deadline=3.0), 0.0)
    assert m.next_deadline() == 3.0  # D gives up after 3 s
    m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0)
    assert m.next_deadline() == 1.0 + WAIT  # the prefill is alive: wait for its end anew
    m.on_prefill_done("t", 1, BLOCKS, 40, FIRST, 2.0)
    assert m.next_deadline() == 2.0 + XFER  # the last WRITE waits for the part: the transfer deadline
    m.on_write_done("t", 1, 3.0, part=True)
    assert m.next_deadline() == 2.0 + XFER
    m.on_write_done("t", 1, 4.0)
    assert m.next_deadline() is None and len(m) == 0


# setup events, then an illegal local event: ProtocolError naming state and event, nothing changed
ILLEGAL = [
    ("part_done_nothing_in_flight", [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 8, 0.0)],
     ("pdone", "t", 1, 1.0), "wait_prefill", "write_done"),
    ("part_failed_nothing_in_flight", [("prog", "t", 1, 32, 0.0)],
     ("pfail", "t", 1, 1.0), "wait_prefill", "write_failed"),
    ("last_done_while_only_a_part_flies_waiting", [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 32, 0.0)],
     ("done", "t", 1, 1.0), "wait_prefill", "write_done"),
    ("last_done_while_only_a_part_flies_writing",
     [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 32, 0.0), ("prefill", "t", 1, 40, 0.5)],
     ("done", "t", 1, 1.0), "writing", "write_done"),
    ("last_failed_while_only_a_part_flies_writing",
     [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 32, 0.0), ("prefill", "t", 1, 40, 0.5)],
     ("wfail", "t", 1, 1.0), "writing", "write_failed"),
    ("part_done_while_the_last_flies",
     [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 32, 0.0), ("pdone", "t", 1, 0.2), ("prefill", "t", 1, 40, 0.5)],
     ("pdone", "t", 1, 1.0), "writing", "write_done"),
    ("part_failed_while_the_last_flies",
     [("reg", "t", 1, 0, 1, 0.0), ("prefill", "t", 1, 40, 0.5)],
     ("pfail", "t", 1, 1.0), "writing", "write_failed"),
    ("progress_after_prefill_done", [("prog", "t", 1, 16, 0.0), ("prefill", "t", 1, 40, 0.5)],
     ("prog", "t", 1, 32, 1.0), "wait_registration", "progress"),
    ("progress_while_writing", [("reg", "t", 1, 0, 1, 0.0), ("prefill", "t", 1, 40, 0.5)],
     ("prog", "t", 1, 32, 1.0), "writing", "progress"),
    # the scheduler's SendKV can cross a stream cancelled by D: refused while the part drains (the
    # writer answers nothing then; the drain's FreeBlocks is the one answer for the stream's blocks)
    ("prefill_done_while_the_stream_drains",
     [("reg", "t", 1, 0, 1, 0.0), ("prog", "t", 1, 32, 0.0), ("cancel", "t", 1, 0.5)],
     ("prefill", "t", 1, 40, 1.0), "draining", "prefill_done"),
]


def _snapshot(m):
    e = m._entry("t", 1)
    fields = None if e is None else (e.state, e.progress, e.sent, e.parts, e.inflight, e.final_pending,
                                     e.last_posted, e.has_prefill, e.deadline)
    return fields, m.next_deadline(), m.held_blocks(), len(m)


@pytest.mark.parametrize("name,setup,event,state,ev_name", ILLEGAL, ids=[c[0] for c in ILLEGAL])
def test_illegal_events_raise_and_change_nothing(name, setup, event, state, ev_name):
    m = machine()
    for ev in setup:
        step(m, ev)
    before = _snapshot(m)
    with pytest.raises(ProtocolError) as info:
        step(m, event)
    assert (info.value.state, info.value.event) == (state, ev_name)
    assert _snapshot(m) == before


@pytest.mark.parametrize("seed", range(150))
def test_random_walk_streams(seed):
    """Any interleaving of chunks, registrations, prefill ends, WRITE completions, cancels,
    deadlines and reissues, on P rank 0 of 1 or 2 and D of 1 or 2 ranks:

    - at most PARTS_AHEAD parts of a transfer in flight (one more once its prefill ended: the
      rest of its whole units), and its last WRITE only alone; parts
      are whole units, contiguous from token 0 and never past what was computed; the last WRITE
      is posted once, only after every part completed, moves the rest of the prompt and
      carries the first token; completions come in any order;
    - no FreeBlocks and no NotifyFailure while a WRITE of that transfer may still be in flight;
    - blocks handed in (a stream's first chunk, a prefill) are reported exactly once: by a
      FreeBlocks in the same answer (a late or stale half, a replica), or later, once, by the
      transfer's end; a prefill that joins a stream shares its one FreeBlocks;
    - at most one outcome per transfer; nothing held at the end.
    """
    rng = random.Random(seed)
    p_tp = 1 + seed % 2
    d_tp = 1 + (seed // 2) % 2
    unit = rng.choice([16, 32])
    m = machine(p_rank=0, p_tp=p_tp, total=4, unit=unit)
    needed = set(range(d_tp)) if p_tp == 1 else {0}  # P rank 0 of 2 holds heads 0-1: D rank 0 of 2
    now = 0.0
    prompt = {}  # key -> prompt length
    progress = {}  # key -> tokens computed so far (what the scheduler reported)
    prefilled = set()  # keys whose prefill half was handed in
    flying: dict = {}  # key -> its WRITEs in flight: "part" (up to PARTS_AHEAD) or "last" (alone)
    sent = {}  # key -> tokens asked for so far
    last_posted = set()
    holding = set()  # keys whose blocks the machine holds (to report once)
    outcomes: dict = {}

    def absorb(actions, handed=None):
        frees = []
        for a in actions:
            key = (a.transfer_id, a.generation) if hasattr(a, "transfer_id") else None
            if isinstance(a, PostWrite):
                assert {r.d_rank for r in a.registrations} == needed
                assert a.token_start == sent.get(key, 0), "parts must be contiguous"
                if a.last:
                    assert key not in last_posted and key in prefilled
                    assert key not in flying, f"the last WRITE of {key} while a part flies"
                    assert a.token_start + a.num_tokens == prompt[key] and a.first_token == FIRST
                    last_posted.add(key)
                    flying[key] = ["last"]
                else:
                    assert key not in last_posted and a.num_tokens > 0
                    # one more once the prefill ended (the rest of its whole units, at once)
                    ahead = PARTS_AHEAD + (key in prefilled)
                    assert len(flying.get(key, [])) < ahead, f"too many parts of {key} in flight"
                    assert a.num_tokens % unit == 0 and a.token_start % unit == 0
                    assert a.token_start + a.num_tokens <= (prompt[key] if key in prefilled else progress[key])
                    flying.setdefault(key, []).append("part")
                sent[key] = a.token_start + a.num_tokens
            elif isinstance(a, FreeBlocks) and not a.block_ids:  # a cancel's answer when nothing is held
                assert key not in holding and key not in flying, f"empty FreeBlocks of {key} while it holds blocks"
                assert not frees.count(key), f"two FreeBlocks of {key} in one answer"
                frees.append(key)
            elif isinstance(a, FreeBlocks):
                assert key not in flying, f"freed while a WRITE may read {key}"
                assert key in holding or key == handed, f"FreeBlocks of {key}: nothing held"
                assert key not in frees, f"two FreeBlocks of {key} in one answer"
                frees.append(key)
                holding.discard(key)
            elif isinstance(a, NotifyFailure):
                assert key not in flying, f"D told to give up while a WRITE may land {key}"
            elif isinstance(a, (Completed, Failed)):
                outcomes[key] = outcomes.get(key, 0) + 1
        return frees

    def hand(key, acts):
        """A half was handed in: it is held now, or was reported in this very answer (or,
        for progress only, the transfer was over and there was nothing to take)."""
        frees = absorb(acts, handed=key)
        if m.state_of(*key) is not None:
            holding.add(key)
        else:
            assert key in frees or any(isinstance(a, Count) and a.name == "late_progress" for a in acts), acts

    ids = ["a0", "b0"]
    touched: set = set()
    for i in range(200):
        now += rng.choice([0.0, 0.0, 0.5, 1.0, 12.0 if rng.random() < 0.05 else 0.0])
        slot = rng.randrange(len(ids))
        tid, gen = ids[slot], 2 if rng.random() < 0.1 else 1
        if (tid, 1) in prefilled and m.state_of(tid, 1) is None and rng.random() < 0.5:
            ids[slot] = tid = f"{tid[0]}{i}"  # that one is over: the next request
        key = (tid, gen)
        fresh = tid not in touched  # no event of any generation of this id yet
        touched.add(tid)
        r = rng.random()
        if r < 0.35 and key not in prefilled:  # a chunk ends, or the prefill does
            n = prompt.setdefault(key, rng.randint(1, 200))
            done = progress.get(key, 0)
            if done < n - 1 and rng.random() < 0.8:
                progress[key] = rng.randint(done + 1, min(n - 1, done + 40))
                hand(key, m.on_prefill_progress(tid, gen, BLOCKS, progress[key], now))
            else:
                progress[key] = n
                prefilled.add(key)
                try:
                    acts = m.on_prefill_done(tid, gen, BLOCKS, n, FIRST, now)
                except ProtocolError as e:  # only a stream that drains refuses it (see ILLEGAL)
                    assert e.state == "draining" and key in holding
                    continue
                hand(key, acts)
        elif r < 0.55:
            absorb(m.on_registration(register(tid, gen, rng.randint(0, d_tp - 1), d_tp), now))
        elif r < 0.85 and flying:
            key = rng.choice(sorted(flying))
            part = _land(flying, key) == "part"
            if rng.random() < 0.8:
                absorb(m.on_write_done(*key, now, part=part))
            else:
                absorb(m.on_write_failed(*key, "x", now, part=part))
        elif r < 0.9:
            acts = m.cancel(tid, gen, "abort", now, answer=True)
            absorb(acts)
            if fresh:  # the scheduler waits for an answer to every cancel, of a transfer never seen too
                assert any(isinstance(a, FreeBlocks) for a in acts), acts
        else:
            absorb(m.expire(now))
    while flying:
        key = sorted(flying)[0]
        absorb(m.on_write_done(*key, now, part=_land(flying, key) == "part"))
    absorb(m.expire(now + 1e6))
    absorb(m.expire(now + 2e6))
    assert holding == set(), f"never reported: {holding}"
    assert all(v == 1 for v in outcomes.values()), outcomes
    assert m.held_blocks() == [] and len(m) == 0 and m.next_deadline() is None


def _land(flying: dict, key) -> str:
    """One WRITE of ``key`` in flight ends (which one does not matter: the machine counts them)."""
    kinds = flying[key]
    kind = kinds.pop()
    if not kinds:
        del flying[key]
    return kind


# --------------------------------------------------------------------------- layer-streamed push
def spans(a):
    """A WRITE's (layer group, first token, end token) spans; -1: every group alike."""
    return a.spans or ((-1, a.token_start, a.token_start + a.num_tokens),)


def test_layer_groups_stream_apart_and_the_last_write_moves_each_rest():
    """Four layer groups, unit 16: each group's mark sends its whole units (two parts in flight,
    the next taking every group computed meanwhile); the last WRITE moves each group's rest
    from its own first token; a mark after the prefill half is counted and dropped."""
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=4)
    assert m.on_registration(register(), 0.0) == []
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 40, 1.0, group=0)
    assert not part.last and spans(part) == ((0, 0, 32),)
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 40, 1.1, group=1)  # while group 0's flies
    assert spans(part) == ((1, 0, 32),)
    assert m.on_prefill_progress("t", 1, BLOCKS, 40, 1.2, group=2) == []  # two fly: wait
    assert m.on_prefill_progress("t", 1, BLOCKS, 40, 1.25, group=3) == []
    (part,) = m.on_write_done("t", 1, 1.3, part=True)  # groups 2 and 3 together (0 and 1 are ahead)
    assert spans(part) == ((2, 0, 32), (3, 0, 32))
    assert m.on_prefill_done("t", 1, BLOCKS, 40, FIRST, 1.4) == []  # the last waits for both parts
    assert m.on_write_done("t", 1, 1.45, part=True) == []
    (last,) = m.on_write_done("t", 1, 1.5, part=True)
    assert last.last and last.first_token == FIRST and spans(last) == ((-1, 32, 40),)  # every group from 32
    assert [short(a) for a in m.on_prefill_progress("t", 1, BLOCKS, 40, 1.6, group=2)] == ["count:late_progress"]
    out = m.on_write_done("t", 1, 1.7)
    assert [short(a) for a in out] == ["free t1", "completed t1 registration_first"]


def test_layer_groups_uneven_rests_and_a_last_write_with_nothing_left():
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=2)
    m.on_registration(register(), 0.0)
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 48, 1.0, group=0)
    assert spans(part) == ((0, 0, 48),)
    # group 1 never marked: its whole units leave at prefill end as one more part (group 0's
    # still flies), and the last WRITE moves its final unit
    (rest,) = m.on_prefill_done("t", 1, BLOCKS, 48, FIRST, 1.1)
    assert not rest.last and spans(rest) == ((1, 0, 32),)
    assert m.on_write_done("t", 1, 1.2, part=True) == []
    (last,) = m.on_write_done("t", 1, 1.3, part=True)
    assert spans(last) == ((1, 32, 48),)
    # every group's units reached the prompt's end before the prefill half: the notification
    # still needs a WRITE, so the last moves the final unit of the last group again
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=2)
    m.on_registration(register(), 0.0)
    m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0)  # -1: every group (a chunk)
    m.on_write_done("t", 1, 1.1, part=True)
    (last,) = m.on_prefill_done("t", 1, BLOCKS, 32, FIRST, 1.2)
    assert last.last and spans(last) == ((1, 16, 32),)


def test_a_mark_for_a_group_outside_the_cut_is_counted():
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=2)
    assert [short(a) for a in m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0, group=2)] == ["count:bad_progress_group"]


def test_a_last_write_with_nothing_left_never_divides_by_zero():
    """No stream unit and a prompt of 0 tokens (a peer's or a fuzzer's numbers): the last WRITE
    is asked for all the same (empty), not a crash (found by tests/writer/test_fuzz_writer.py)."""
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=0, stream_groups=2)
    m.on_registration(register(), 0.0)
    (last,) = m.on_prefill_done("t", 1, BLOCKS, 0, FIRST, 1.0)
    assert last.last and last.num_tokens == 0


def test_layer_marks_keep_the_last_groups_final_unit_for_the_last_write():
    """Every layer mark of a prompt's last step may come before its prefill half: parts then
    move all but the last group's final unit, which the last WRITE carries (once: nothing is
    sent twice), so the bytes D sees last are the prompt's end (what --kv-verify's sample
    always checks, and what its faults damage)."""
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=2)
    m.on_registration(register(), 0.0)
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 32, 1.0, group=0)
    assert spans(part) == ((0, 0, 32),)  # not the last group: all its whole units
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 32, 1.1, group=1)  # beside the part in flight
    assert spans(part) == ((1, 0, 16),)  # the last group: its final unit stays
    assert m.on_prefill_done("t", 1, BLOCKS, 32, FIRST, 1.3) == []
    assert m.on_write_done("t", 1, 1.35, part=True) == []  # (in either order: they are counted)
    (last,) = m.on_write_done("t", 1, 1.4, part=True)
    assert last.last and spans(last) == ((1, 16, 32),)
    # one group (layer streaming with --push-stream-groups 1): the same
    m = PushRendezvous(0, 1, 4, WAIT, XFER, stream_unit=UNIT, stream_groups=1)
    m.on_registration(register(), 0.0)
    (part,) = m.on_prefill_progress("t", 1, BLOCKS, 48, 1.0, group=0)
    assert spans(part) == ((-1, 0, 32),)
    m.on_write_done("t", 1, 1.1, part=True)
    (last,) = m.on_prefill_done("t", 1, BLOCKS, 48, FIRST, 1.2)
    assert spans(last) == ((-1, 32, 48),)
