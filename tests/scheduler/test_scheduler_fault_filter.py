"""The scheduler's fault points as a filter on its core's effects (pushkv/scheduler/fault_filter.py):
which effect marks which point, per role; a Kill lands right after it only when the test armed that
point, and nothing after it leaves. Pure: the armed points are a set, no files."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.scheduler.fault_filter import FaultFilter
from pushkv.scheduler.outbox import Kill, Peer, Send, Trace

ROUTER = Peer.router(b"r")


class Armed:
    """Points armed once, as the files are: taken when asked."""

    def __init__(self, *points: str):
        self.points = set(points)
        self.asked: list[str] = []

    def armed(self, name: str) -> bool:
        self.asked.append(name)
        if name in self.points:
            self.points.discard(name)
            return True
        return False


def tok(tid: str = "t", gen: int = 1, finished: bool = False) -> Send:
    return Send(ROUTER, m.TokensGenerated(tid, gen, (7,), finished))


AFTER = Trace("send_kv", "t")  # anything the core asked for after the point


# (role, armed, effects, what leaves)
CASES = {
    "decode_alloc_kills_after_the_stamp": (
        "decode", ["after_alloc"], [Trace("decode_alloc", "t"), AFTER],
        [Trace("decode_alloc", "t"), Kill("after_alloc")]),
    "local_alloc_is_its_own_stamp": (
        "local", ["after_alloc"], [Trace("local_alloc", "t"), AFTER], [Trace("local_alloc", "t"), Kill("after_alloc")]),
    "prefill_alloc": (
        "prefill", ["after_alloc"], [Trace("prefill_alloc", "t"), AFTER],
        [Trace("prefill_alloc", "t"), Kill("after_alloc")]),
    "another_roles_stamp_is_no_point": (
        "decode", ["after_alloc"], [Trace("prefill_alloc", "t"), AFTER], [Trace("prefill_alloc", "t"), AFTER]),
    "prefill_done_after_p_prefill_end": (
        "prefill", ["prefill_done"], [Trace("prefill_end", "t"), AFTER],
        [Trace("prefill_end", "t"), Kill("prefill_done")]),
    "prefill_end_on_d_is_no_point": (
        "decode", ["prefill_done"], [Trace("prefill_end", "t"), AFTER], [Trace("prefill_end", "t"), AFTER]),
    "not_armed_passes_everything": (
        "decode", [], [Trace("decode_alloc", "t"), tok(), tok(), tok(), AFTER],
        [Trace("decode_alloc", "t"), tok(), tok(), tok(), AFTER]),
    "decoding_after_the_third_token": (
        "decode", ["decoding"], [tok(), tok(), tok(), AFTER], [tok(), tok(), tok(), Kill("decoding")]),
    "tokens_count_per_request": (
        "decode", ["decoding"], [tok("a"), tok("b"), tok("a"), tok("b"), tok("b"), AFTER],
        [tok("a"), tok("b"), tok("a"), tok("b"), tok("b"), Kill("decoding")]),
    "a_new_generation_counts_anew": (
        "decode", ["decoding"], [tok(gen=1), tok(gen=1), tok(gen=2), AFTER],
        [tok(gen=1), tok(gen=1), tok(gen=2), AFTER]),
    "a_last_third_token_is_no_point": (
        "local", ["decoding"], [tok(), tok(), tok(finished=True), AFTER], [tok(), tok(), tok(finished=True), AFTER]),
    "p_counts_no_tokens": (
        "prefill", ["decoding"], [tok(), tok(), tok(), AFTER], [tok(), tok(), tok(), AFTER]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_filter(case):
    role, armed, effects, want = CASES[case]
    assert FaultFilter(Armed(*armed), role)(effects) == want


def test_counts_across_batches_and_asks_only_at_points():
    armed = Armed("decoding")
    f = FaultFilter(armed, "decode")
    assert f([Trace("first_token", "t"), tok()]) == [Trace("first_token", "t"), tok()]
    assert f([tok()]) == [tok()]
    assert armed.asked == []  # no point yet: nothing asked (no file touched)
    assert f([tok(), AFTER]) == [tok(), Kill("decoding")]
    assert armed.asked == ["decoding"]


def test_a_finished_request_is_forgotten():
    f = FaultFilter(Armed(), "decode")
    f([tok(), tok(), tok(finished=True)])
    assert f.tokens == {}
