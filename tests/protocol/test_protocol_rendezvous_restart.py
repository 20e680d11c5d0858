"""PushRendezvous when the engine preempts a streamed prefill and computes it again into new
blocks (``on_prefill_restart``, vLLM's recompute): what D holds stays, a part in flight ends as
it would, later progress names the new blocks, parts resume past what was sent, and the last
WRITE reads the new table. Tables, with tests/protocol/test_protocol_stream.py's helpers."""
import pytest

from pushkv.protocol.rendezvous import PostWrite, ProtocolError
from tests.protocol.test_protocol_stream import FIRST, machine, register, short

OLD, NEW = tuple(range(8)), tuple(range(40, 48))  # the table before and after the preemption


def run(m, events):
    """events: ("reg",) | ("prog", n, blocks) | ("restart",) | ("pdone",) | ("prefill", n) |
    ("done",); returns each event's actions, a PostWrite as its short form and its block table."""
    out, now = [], 0.0
    for ev in events:
        now += 1.0
        kind = ev[0]
        if kind == "reg":
            acts = m.on_registration(register("t", 1), now)
        elif kind == "prog":
            acts = m.on_prefill_progress("t", 1, ev[2], ev[1], now)
        elif kind == "restart":
            acts = m.on_prefill_restart("t", 1, now)
        elif kind == "prefill":
            acts = m.on_prefill_done("t", 1, NEW, ev[1], FIRST, now)
        else:
            acts = m.on_write_done("t", 1, now, part=kind == "pdone")
        out.append([f"{short(a)} {'old' if a.block_ids == OLD else 'new'}" if isinstance(a, PostWrite)
                    else short(a) for a in acts])
    return out


CASES = [
    # a part flies over the old blocks when vLLM preempts: it ends as it would, and sends nothing more
    # until the recomputed progress passes what D holds (32 tokens); then parts and the last read NEW
    ("part_in_flight_then_recompute", [
        ("reg",), ("prog", 40, OLD), ("restart",), ("pdone",), ("prog", 16, NEW), ("prog", 40, NEW),
        ("prog", 64, NEW), ("pdone",), ("prefill", 70), ("done",)],
     [[], ["part t1 [0] 0+32 old"], ["count:prefill_restarted"], [], [], [],
      ["part t1 [0] 32+32 new"], [], ["last t1 [0] 64+6 ft7 new"],
      ["free t1", "completed t1 registration_first", ]]),
    # two parts fly over the old blocks (PARTS_AHEAD): both end as they would; the recomputed
    # progress resumes past both (48 sent), and the last waits for the new part
    ("two_parts_in_flight_then_recompute", [
        ("reg",), ("prog", 16, OLD), ("prog", 48, OLD), ("restart",), ("pdone",), ("pdone",),
        ("prog", 40, NEW), ("prog", 64, NEW), ("prefill", 70), ("pdone",), ("done",)],
     [[], ["part t1 [0] 0+16 old"], ["part t1 [0] 16+32 old"], ["count:prefill_restarted"], [], [],
      [], ["part t1 [0] 48+16 new"], [], ["last t1 [0] 64+6 ft7 new"],
      ["free t1", "completed t1 registration_first"]]),
    # preempted before D registered: nothing was sent, so everything goes from the new blocks (the
    # prefill ends while the first part flies: its whole units leave at once as one more part)
    ("restart_before_registration", [
        ("prog", 48, OLD), ("restart",), ("prog", 20, NEW), ("reg",), ("prefill", 40)],
     [[], ["count:prefill_restarted"], [], ["part t1 [0] 0+16 new"], ["part t1 [0] 16+16 new"]]),
    # a stream that no mark reached yet (or one already over): nothing to restart
    ("nothing_streamed_yet", [("restart",)], [["count:restart_ignored"]]),
]


@pytest.mark.parametrize("name,events,want", CASES, ids=[c[0] for c in CASES])
def test_restart(name, events, want):
    assert run(machine(total=4), events) == want


def test_restart_after_the_prefill_half_is_refused_and_changes_nothing():
    m = machine(total=4)
    m.on_prefill_progress("t", 1, OLD, 16, 0.0)
    m.on_prefill_done("t", 1, OLD, 40, FIRST, 1.0)
    with pytest.raises(ProtocolError, match="restart"):
        m.on_prefill_restart("t", 1, 2.0)
    assert m.state_of("t", 1) == "wait_registration"


def test_restart_while_draining_is_ignored_and_the_blocks_still_wait_for_the_part():
    m = machine(total=4)
    m.on_registration(register("t", 1), 0.0)
    assert [short(a) for a in m.on_prefill_progress("t", 1, OLD, 32, 1.0)] == ["part t1 [0] 0+32"]
    m.cancel("t", 1, "aborted", 2.0)  # the part still reads the blocks: draining
    assert [short(a) for a in m.on_prefill_restart("t", 1, 3.0)] == ["count:restart_ignored"]
    assert [short(a) for a in m.on_write_done("t", 1, 4.0, part=True)] == ["free t1", "notify t1 [0]"]
