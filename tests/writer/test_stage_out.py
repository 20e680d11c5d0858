"""P's WRITEs waiting for their copy into the staging area (writer/staging.Copying): the loop takes
each once its copy is done, in the order the copies were issued, and never waits on one. The copies
here end when the test says (torch.cuda.Event.query's shape), which the CPU path never has: there a
copy is done when it returns and nothing waits."""
from __future__ import annotations

import pytest

from pushkv.writer.staging import Copying, device_s, done


class Copy:
    def __init__(self):
        self.over = False

    def query(self) -> bool:
        return self.over


@pytest.mark.parametrize("ended, ready, left", [
    ((), [], ["a", "b", "c"]),  # nothing copied yet: nothing goes, and nothing blocks
    ((0,), ["a"], ["b", "c"]),
    ((0, 1, 2), ["a", "b", "c"], []),
    ((1,), [], ["a", "b", "c"]),  # a later copy seen done first never overtakes the one before it
    ((0, 2), ["a"], ["b", "c"]),
])
def test_ready_gives_the_copied_in_issue_order_up_to_the_first_still_running(ended, ready, left):
    q: Copying[str] = Copying()
    copies = [Copy() for _ in range(3)]
    for item, c in zip("abc", copies):
        q.add(item, c)
    for i in ended:
        copies[i].over = True
    assert list(q.ready()) == ready
    assert list(q) == left and len(q) == len(left) and bool(q) == bool(left)


def test_a_host_areas_copy_is_done_at_once_and_takes_no_device_time():
    q: Copying[str] = Copying()
    q.add("a", None)  # StagingArea on the CPU copies at once and returns None
    assert done(None) and device_s(None) == 0.0
    assert list(q.ready()) == ["a"] and not q
