"""D's receive side (``pushkv/writer/receive_side.py``, the vLLM writer's D) as plain calls: a
completion counts only from the producer rank, a failed transfer's blocks are lost only once no
producer can still write into them."""
from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.writer import sides as S
from pushkv.writer.receive_side import Lost, ReceiveSide

KEY = ("t", 0)


def side(connected=lambda e, r: True) -> ReceiveSide:
    s = ReceiveSide(transfer_s=5.0, connected=connected)
    assert s.expect(KEY, "p", [0, 1], (3, 4), deadline=10.0, now=0.0) == []
    return s


def kinds(effects) -> list:
    return [type(e).__name__ for e in effects if not isinstance(e, A.Count)]


def test_received_once_every_producer_wrote():
    s = side()
    assert kinds(s.completion(m.WriteDone("t", 0, 0, 0, 10, 1), ("p", 0), 1.0)) == []
    out = s.completion(m.WriteDone("t", 0, 1, 0, 10, 1), ("p", 1), 1.0)
    assert kinds(out) == ["Received"] and not s.pending()


def test_a_completion_from_another_peer_does_not_count():
    s = side()
    assert s.completion(m.WriteDone("t", 0, 0, 0, 10, 1), ("p", 1), 1.0) == [A.Count("completion_from_wrong_peer")]
    assert s.pending()


def test_failed_blocks_held_until_the_last_producer_answers():
    s = side()
    out = s.completion(m.WriteFailed("t", 0, 0, "boom"), ("p", 0), 1.0)
    why = "P rank 0: boom"
    assert [e for e in out if not isinstance(e, A.Count)] == [S.Tell(("p", 1), m.CancelTransfer("t", 0, why))]
    assert s.pending()  # rank 1 may still write into the blocks
    assert s.completion(m.WriteDone("t", 0, 1, 0, 10, 1), ("p", 1), 2.0) == [Lost(KEY, why)]
    assert not s.pending()


def test_failed_blocks_lost_at_once_when_no_producer_is_connected():
    s = side(connected=lambda e, r: False)
    assert kinds(s.cancel(KEY, "cancelled", 1.0)) == ["Lost"]


def test_a_dead_producer_fails_its_transfers_and_the_quarantine_expires():
    s = side()
    out = s.rank_gone("p", 0, "prefill died", 1.0)
    assert kinds(out) == ["Tell"]  # rank 1 told to stop, the blocks held for it
    assert s.expire(3.0) == []
    assert s.expire(7.0) == [Lost(KEY, "prefill died")]
