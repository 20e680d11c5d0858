"""The writer's pure sides (no socket, NIXL agent or clock): P's rendezvous driven by its
inputs to effects, D's quarantine, and the deadline checks, which pushkv's writers and the
vLLM writer share."""
import pytest

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import rendezvous as rv
from pushkv.protocol.tp import page_heads
from pushkv.writer import sides as S

REG0 = m.Register("t", 0, "d", 0, 2, (5, 6), 32)
REG1 = m.Register("t", 0, "d", 1, 2, (7, 8), 32)
POST = A.PostWrite("t", 0, (1, 2), 32, 9, (REG0,))
FREE = A.FreeBlocks("t", 0, (1, 2), "written")


def _side(rank: int = 0, tp: int = 4, max_tracked: int = S.MAX_TRACKED, **kw) -> S.PrefillSide:
    return S.PrefillSide(rv.PushRendezvous(rank, tp, tp, registration_wait_s=5, transfer_s=5, **kw), max_tracked)


@pytest.mark.parametrize("actions,want", [
    ([], []),
    ([POST], [S.Post(POST)]),
    ([A.Count("cancelled")], [A.Count("cancelled")]),
    # the outcome comes with the free that reports it, whichever comes first in the batch
    ([FREE, A.Completed("t", 0, "prefill_first")],
     [A.Count("rendezvous_prefill_first"),
      S.Report(FREE, S.PrefillTransfer(outcome=A.Completed("t", 0, "prefill_first")))]),
    # a failure: each registered D rank told, the queued WRITEs dropped last
    ([A.FreeBlocks("t", 0, (1,), "boom"), A.NotifyFailure("t", 0, (REG0, REG1), "boom"), A.Failed("t", 0, "boom")],
     [A.Count("transfers_failed"),
      S.Report(A.FreeBlocks("t", 0, (1,), "boom"), S.PrefillTransfer(outcome=A.Failed("t", 0, "boom"))),
      S.Tell(("d", 0), m.WriteFailed("t", 0, 3, "boom")), S.Tell(("d", 1), m.WriteFailed("t", 0, 3, "boom")),
      S.Drop(("t", 0), "boom")]),
    # a free with no outcome (a refused half): reported failed with the free's reason
    ([A.FreeBlocks("t", 1, (), "stale")], [S.Report(A.FreeBlocks("t", 1, (), "stale"), S.PrefillTransfer())]),
])
def test_prefill_side_turns_actions_into_effects(actions, want):
    assert _side(rank=3).effects(actions) == want


def test_a_failure_is_reported_by_the_free_that_comes_batches_later():
    side = _side()
    assert side.effects([A.Failed("t", 0, "cancelled")]) == [A.Count("transfers_failed"), S.Drop(("t", 0), "cancelled")]
    side.record(("t", 0)).nbytes = 4096  # the shell books what moved
    late = A.FreeBlocks("t", 0, (1,), "write finished after failure")
    (report,) = side.effects([late])
    assert report.outcome == A.Failed("t", 0, "cancelled") and not report.ok and report.reason == "cancelled"
    assert report.transfer.nbytes == 4096 and side.transfers == {}  # forgotten once reported


@pytest.mark.parametrize("outcome,free_reason,ok,reason", [
    (A.Completed("t", 0, "pull"), "written", True, ""),
    (A.Failed("t", 0, "expired"), "x", False, "expired"),
    (None, "refused", False, "refused"),
])
def test_report_says_ok_and_why(outcome, free_reason, ok, reason):
    r = S.Report(A.FreeBlocks("t", 0, (), free_reason), S.PrefillTransfer(outcome=outcome))
    assert (r.ok, r.reason) == (ok, reason)


def test_prefill_side_bounds_the_records_it_keeps():
    side = _side(max_tracked=2)
    for i in range(3):
        side.effects([A.Failed(f"t{i}", 0, "x")])
    assert list(side.transfers) == [("t1", 0), ("t2", 0)]
    assert side.record(("t2", 0)).outcome == A.Failed("t2", 0, "x")


# -- P's inputs, through its own rendezvous: each row a sequence of calls, the effects of the last
T = ("t", 0)
REG = m.Register("t", 0, "d", 0, 1, (4,), 16)
WRITE = A.PostWrite("t", 0, (1,), 16, 7, (REG,))
NO_REG = "no registration within 5s of prefill or of D's last renewal"
REFUSED = "event 'prefill_done' is illegal in state 'finished' (transfer_id=t generation=0)"


def _run(side: S.PrefillSide, calls: list) -> list:
    out: list = []
    for name, *args in calls:
        out = getattr(side, name)(*args[:-1], **args[-1]) if args and isinstance(args[-1], dict) else \
            getattr(side, name)(*args)
    return out


@pytest.mark.parametrize("calls,want", [
    # D first, then our prefill: the WRITE posts at once
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.1)], [S.Post(WRITE)]),
    # our prefill first: it waits for D
    ([("prefill_done", T, (1,), 16, 7, 0.0)], []),
    ([("prefill_done", T, (1,), 16, 7, 0.0), ("registration", REG, 0.1)], [S.Post(WRITE)]),
    # the WRITE done: its blocks reported, with what moved and how long the last WRITE took
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.0),
      ("write_ended", T, 0.75, {"part": False, "nbytes": 512, "num_descs": 2, "posted": 0.5})],
     [A.Count("rendezvous_registration_first"),
      S.Report(A.FreeBlocks("t", 0, (1,), "written"),
               S.PrefillTransfer("d", A.Completed("t", 0, "registration_first"), 512, 2, 0.25))]),
    # the WRITE failed: blocks reported failed, D told, nothing queued goes
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.0),
      ("write_ended", T, 0.75, {"part": False, "failed": "boom", "posted": 0.25})],
     [A.Count("transfers_failed"), S.Report(A.FreeBlocks("t", 0, (1,), "boom"),
                                            S.PrefillTransfer("d", A.Failed("t", 0, "boom"), write_s=0.5)),
      S.Tell(("d", 0), m.WriteFailed("t", 0, 0, "boom")), A.Count("write_failed"), S.Drop(T, "boom")]),
    # the scheduler's cancel of a transfer not begun: one answer (an empty free), remembered failed
    ([("cancel", T, "aborted", 0.0, {"answer": True})],
     [A.Count("transfers_failed"), S.Report(A.FreeBlocks("t", 0, (), "aborted"),
                                            S.PrefillTransfer(outcome=A.Failed("t", 0, "aborted"))),
      A.Count("cancelled"), S.Drop(T, "aborted")]),
    # the scheduler's cancel once the WRITE is asked for: withdrawn (what is still queued never goes),
    # no answer yet; the WRITE's end is the answer: landed (D has the KV whole), or not
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.0),
      ("cancel", T, "aborted", 0.1, {"answer": True})], [A.Count("withdrawn"), S.Drop(T, "aborted")]),
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.0),
      ("cancel", T, "aborted", 0.1, {"answer": True}),
      ("write_ended", T, 0.2, {"part": False, "nbytes": 512, "num_descs": 2, "posted": 0.0})],
     [A.Count("rendezvous_registration_first"),
      S.Report(A.FreeBlocks("t", 0, (1,), "written"),
               S.PrefillTransfer("d", A.Completed("t", 0, "registration_first"), 512, 2, 0.2))]),
    ([("registration", REG, 0.0), ("prefill_done", T, (1,), 16, 7, 0.0),
      ("cancel", T, "aborted", 0.1, {"answer": True}),
      ("write_ended", T, 0.2, {"part": False, "failed": "dropped from the link queue: aborted"})],
     [A.Count("transfers_failed"),
      S.Report(A.FreeBlocks("t", 0, (1,), "dropped from the link queue: aborted"),
               S.PrefillTransfer("d", A.Failed("t", 0, "dropped from the link queue: aborted"), write_s=0.2)),
      S.Tell(("d", 0), m.WriteFailed("t", 0, 0, "dropped from the link queue: aborted")),
      S.Drop(T, "dropped from the link queue: aborted")]),
    # a cancel before either half: the prefill that comes later frees its blocks, failed with the cancel's
    # reason; a second prefill is refused, and the side says so
    ([("cancel", T, "aborted", 0.0), ("prefill_done", T, (1,), 16, 7, 0.1)],
     [S.Report(A.FreeBlocks("t", 0, (1,), "transfer already failed"),
               S.PrefillTransfer(outcome=A.Failed("t", 0, "aborted"))), A.Count("late_prefill")]),
    ([("cancel", T, "aborted", 0.0), ("prefill_done", T, (1,), 16, 7, 0.1), ("prefill_done", T, (1,), 16, 7, 0.2)],
     [S.Refused(T, "prefill_done", "finished", REFUSED, live=False)]),
    # D renews while our blocks wait for it; with nothing waiting, the renewal is ignored
    ([("prefill_done", T, (1,), 16, 7, 0.0), ("renew", T, 4.0)], [A.Count("renewed")]),
    ([("renew", T, 0.0)], [A.Count("renew_ignored")]),
    # the deadline: blocks that waited for D in vain go back, failed
    ([("prefill_done", T, (1,), 16, 7, 0.0), ("expire", 4.9)], []),
    ([("prefill_done", T, (1,), 16, 7, 0.0), ("expire", 5.0)],
     [A.Count("transfers_failed"), S.Report(A.FreeBlocks("t", 0, (1,), NO_REG), S.PrefillTransfer(
         outcome=A.Failed("t", 0, NO_REG))), A.Count("expired_prefill"), S.Drop(T, NO_REG)]),
])
def test_prefill_side_inputs_to_effects(calls, want):
    assert _run(_side(tp=1), calls) == want


def test_prefill_side_streams_parts_and_books_their_bytes():
    side = _side(tp=1, stream_unit=16)
    side.registration(REG, 0.0)
    (part,) = side.progress(T, (1, 2), 16, 0.1)
    assert isinstance(part, S.Post) and not part.write.last and part.write.num_tokens == 16
    assert side.prefill_done(T, (1, 2), 32, 7, 0.2) == []  # the last WRITE waits for the part in flight
    (last,) = side.write_ended(T, 0.3, part=True, nbytes=100, num_descs=1, posted=0.1)
    assert isinstance(last, S.Post) and last.write.last
    report = [e for e in side.write_ended(T, 0.5, part=False, nbytes=50, num_descs=1, posted=0.4)
              if isinstance(e, S.Report)][0]
    assert report.ok and (report.transfer.nbytes, report.transfer.num_descs) == (150, 2)
    assert report.transfer.write_s == pytest.approx(0.1) and not side.pending()


def test_prefill_side_knows_who_registered_and_whether_it_waits():
    side = _side(tp=1)
    assert side.waiting(T) is False and not side.live(T) and not side.pending()
    side.registration(REG, 0.0)
    assert side.waiting(T) and side.live(T) and side.pending() and side.registered_by("d") == [T]
    assert side.registered_by("other") == []
    side.prefill_done(T, (1,), 16, 7, 0.1)
    assert not side.waiting(T) and side.live(T)  # writing


def test_a_replica_rank_writes_nothing():
    side = S.PrefillSide(rv.PushRendezvous(1, 2, 1, registration_wait_s=5, transfer_s=5))  # rank 0 holds the head
    assert side.produces is False and _side().produces is True
    assert side.prefill_done(T, (1,), 16, 7, 0.0) == [
        A.Count("rendezvous_replica"),
        S.Report(A.FreeBlocks("t", 0, (1,), "replica writes nothing"),
                 S.PrefillTransfer(outcome=A.Completed("t", 0, "replica")))]


def test_keys_of_effects_name_the_transfers_moved():
    effects = [S.Post(WRITE), A.Count("x"), S.Drop(("u", 1), "r"), S.Tell(("d", 0), m.WriteFailed("v", 2, 0, "r")),
               S.Refused(("w", 0), "progress", "writing", "e", True)]
    assert S.keys_of(effects) == {T, ("u", 1), ("v", 2)}


# -- D's quarantine ----------------------------------------------------------------------
def _quarantine() -> S.Quarantine:
    q = S.Quarantine()
    q.hold("a", "p0", {0, 1}, deadline=10.0, reason="ra")
    q.hold("b", "p0", {1}, deadline=20.0, reason="rb", slots=[3])
    q.hold("c", "p1", {0}, deadline=5.0, reason="rc")
    return q


@pytest.mark.parametrize("call,released,left", [
    (lambda q: q.answered("a", 0), [], {"a", "b", "c"}),  # rank 1 may still write
    (lambda q: q.answered("b", 1), ["b"], {"a", "c"}),
    (lambda q: q.answered("zz", 0), [], {"a", "b", "c"}),  # not held: nothing
    (lambda q: q.rank_gone("p0", 1), ["b"], {"a", "c"}),  # a still waits for rank 0
    (lambda q: q.rank_gone("p1", 1), [], {"a", "b", "c"}),  # rank 1 of p1 owes nothing
    (lambda q: q.engine_gone("p0"), ["a", "b"], {"c"}),
    (lambda q: q.expired(9.99), ["c"], {"a", "b"}),
    (lambda q: q.expired(20.0), ["a", "b", "c"], set()),
])
def test_quarantine_releases_once_no_write_can_land(call, released, left):
    q = _quarantine()
    assert [k for k, _ in call(q)] == released
    assert set(q.held) == left and len(q) == len(left)


def test_quarantine_release_carries_reason_and_slots():
    q = _quarantine()
    q.answered("a", 1)
    assert "a" in q and q.get("a").outstanding == {0}
    ((_, held),) = q.answered("a", 0)
    assert held.reason == "ra"
    ((_, b),) = q.engine_gone("p0")
    assert (b.reason, b.slots) == ("rb", [3])


# -- deadlines ------------------------------------------------------------------------------
class _Clocked:
    def __init__(self, deadline):
        self.deadline = deadline

    def next_deadline(self):
        return self.deadline

    def expire(self, now):
        return [A.Count(f"expired@{now}")]


@pytest.mark.parametrize("deadline,now,want", [
    (None, 5.0, []), (6.0, 5.0, []), (5.0, 5.0, [A.Count("expired@5.0")]),
])
def test_due_expires_only_past_deadlines(deadline, now, want):
    assert S.due(_Clocked(deadline), now) == want


@pytest.mark.parametrize("deadlines,want", [((), False), ((None,), False), ((None, 3.0), True)])
def test_pending_when_any_machine_has_a_deadline(deadlines, want):
    assert S.pending(*[_Clocked(d) for d in deadlines]) is want


@pytest.mark.parametrize("p_rank,p_tp,d_rank,d_tp,total,want", [
    (0, 1, 0, 1, 4, None),  # same TP: whole pages
    (1, 2, 0, 1, 4, (0, 2, 2)),  # P rank 1 of 2 holds heads 2-3: D's 2-3
    (0, 1, 1, 2, 4, (2, 0, 2)),  # D rank 1 of 2 wants heads 2-3: P's 2-3
    (1, 2, 0, 2, 4, False),  # nothing shared
])
def test_page_heads(p_rank, p_tp, d_rank, d_tp, total, want):
    assert page_heads(p_rank, p_tp, d_rank, d_tp, total) == want


# -- D's producers (the vLLM writer's table) ------------------------------------------------
def _producers() -> S.Producers:
    p = S.Producers()
    p.expect("t", "P", [0, 1])
    return p


@pytest.mark.parametrize("peer,p_rank,verdict", [
    (("P", 0), 0, "counts"),
    (("P", 1), 0, "wrong_peer"),  # claims rank 0, is rank 1
    (("Q", 0), 0, "wrong_peer"),  # another engine
    (None, 0, "wrong_peer"),  # not a known peer
])
def test_a_completion_counts_only_from_its_producer_rank(peer, p_rank, verdict):
    p = _producers()
    assert p.completion("t", peer, p_rank) == (verdict, [])
    assert p.writing["t"][1] == ({1} if verdict == "counts" else {0, 1})


def test_an_unknown_transfer_goes_to_the_arrivals_machine():
    assert S.Producers().completion("zz", None, 0) == ("counts", [])


@pytest.mark.parametrize("connected,tell,held", [
    (set(), [], False),  # nobody can still write: fail now
    ({1}, [("P", 1)], True),  # rank 1 may: tell it to stop, hold the blocks
    ({0, 1}, [("P", 0), ("P", 1)], True),
])
def test_a_failed_transfer_is_held_while_a_connected_rank_may_write(connected, tell, held):
    p = _producers()
    assert p.fail("t", "boom", 9.0, lambda e, r: e == "P" and r in connected) == (tell, held)
    assert "t" not in p.writing and ("t" in p.quarantine) is held


def test_a_held_transfer_is_released_when_its_ranks_answer_or_die():
    p = _producers()
    p.fail("t", "boom", 9.0, lambda e, r: True)
    assert p.completion("t", ("P", 1), 0)[0] == "wrong_peer"
    assert p.completion("t", ("P", 0), 0) == ("quarantined", [])  # rank 1 may still write
    ((key, held),) = p.rank_gone("P", 1)[0]
    assert (key, held.reason) == ("t", "boom") and len(p.quarantine) == 0


def test_a_dead_rank_fails_the_transfers_it_was_writing():
    p = _producers()
    p.expect("u", "P", [1])
    p.expect("v", "Q", [0])
    assert p.rank_gone("P", 0) == ([], ["t"])
    assert p.writing["t"][1] == {1} and p.rank_gone("P", 1) == ([], ["t", "u"])
    p.received("v")
    assert "v" not in p.writing
