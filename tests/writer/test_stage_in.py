"""D's copies from its staging area into its pool (writer/stage_in.py): a transfer is answered only
once every copy into its blocks is done, whether it was received or failed while a part's copy ran.
The area here stands in for the copy stream (copies that end when the test says), which the CPU
path never has: there every copy is done when it returns."""
from __future__ import annotations

from pushkv.protocol import actions as A
from pushkv.writer.stage_in import Ending, StageIn


class Copy:
    """A copy on the stream: done when the test ends it (torch.cuda.Event.query's shape)."""

    def __init__(self, cells):
        self.cells, self.over = cells, False

    def query(self) -> bool:
        return self.over


class Area:
    def __init__(self):
        self.copies: list[Copy] = []

    def cell_pairs(self, blocks, slots, cells):
        return [(blocks[i], slots[i], g) for g, idx in cells for i in idx]

    def copy_in(self, pairs):
        self.copies.append(Copy(pairs))
        return self.copies[-1]


KEY = ("t", 0)
RECEIVED = A.Received("t", 0, 7, 4096, 2)


def test_a_received_transfer_ends_with_its_last_copy_and_the_rest_moves_only_the_rest():
    area = Area()
    s = StageIn(area)  # type: ignore[arg-type]
    s.copy(KEY, [10, 11], [0, 1], [(0, [0, 1])])  # a part
    assert s.running(KEY) and list(s.ended()) == []
    s.finish(KEY, Ending([0, 1], RECEIVED), [10, 11], [0, 1], [(1, [0, 1])])
    assert [c.cells for c in area.copies] == [[(10, 0, 0), (11, 1, 0)], [(10, 0, 1), (11, 1, 1)]]
    area.copies[0].over = True
    assert list(s.ended()) == []  # the rest's copy still runs
    area.copies[1].over = True
    [(key, e)] = list(s.ended())
    assert key == KEY and e.received == RECEIVED and e.slots == [0, 1] and not e.reason
    assert not s and list(s.ended()) == []


def test_a_transfer_failed_while_a_part_copies_is_answered_when_that_copy_ends():
    area = Area()
    s = StageIn(area)  # type: ignore[arg-type]
    s.copy(KEY, [10], [3], [(0, [0])])
    assert s.running(KEY)
    s.finish(KEY, Ending([3], reason="cancelled", lost="x"))  # no copy more
    assert len(area.copies) == 1 and list(s.ended()) == []
    area.copies[0].over = True
    [(key, e)] = list(s.ended())
    assert (key, e.received, e.reason, e.lost, e.slots) == (KEY, None, "cancelled", "x", [3])


def test_a_finished_part_copy_leaves_nothing_running():
    area = Area()
    s = StageIn(area)  # type: ignore[arg-type]
    s.copy(KEY, [10], [3], [(0, [0])])
    area.copies[0].over = True
    assert not s.running(KEY)  # a failure now is answered at once
    assert not s


def test_copies_that_end_as_they_start_cpu():
    class HostArea(Area):
        def copy_in(self, pairs):
            return None  # a host pool's area copies at once

    s = StageIn(HostArea())  # type: ignore[arg-type]
    s.copy(KEY, [10], [3], [(0, [0])])
    assert not s.running(KEY)
    s.finish(KEY, Ending([3], RECEIVED), [10], [3], [(1, [0])])
    assert [k for k, _ in s.ended()] == [KEY] and not s
