"""PushRendezvous when D holds the prompt's first tokens in its prefix cache: every WRITE,
streamed parts and the last, starts at ``Register.cached_tokens`` (tables, as in
tests/protocol/test_protocol_stream.py, whose helpers these reuse)."""
import pytest

from pushkv.messages import Register
from pushkv.protocol.rendezvous import PostWrite
from tests.protocol.test_protocol_stream import BLOCKS, FIRST, machine, short


def reg(d_rank=0, d_tp=1, cached=0):
    return Register("t", 1, "D", d_rank, d_tp, tuple(range(20, 28)), 100, 0.0, cached_tokens=cached)


# (stream unit, registrations as (d_rank, d_tp, cached), events, expected WRITEs in order)
# events: ("prog", n) a chunk ended, ("reg", i) the i-th registration arrives, ("prefill", n), ("pdone",)
CASES = [
    ("whole_write_starts_after_the_cache", 0, [(0, 1, 64)],
     [("reg", 0), ("prefill", 100)], ["last t1 [0] 64+36 ft7"]),
    ("prefill_first_then_registration", 0, [(0, 1, 64)],
     [("prefill", 100), ("reg", 0)], ["last t1 [0] 64+36 ft7"]),
    ("nothing_cached_writes_all", 0, [(0, 1, 0)],
     [("reg", 0), ("prefill", 100)], ["last t1 [0] 0+100 ft7"]),
    ("parts_start_after_the_cache", 16, [(0, 1, 32)],
     # the prefill ends while 48+32 flies: its whole units leave at once as one more part
     [("reg", 0), ("prog", 16), ("prog", 48), ("pdone",), ("prog", 80), ("prefill", 100), ("pdone",), ("pdone",)],
     ["part t1 [0] 32+16", "part t1 [0] 48+32", "part t1 [0] 80+16", "last t1 [0] 96+4 ft7"]),
    ("chunks_inside_the_cache_send_nothing", 16, [(0, 1, 64)],
     [("prog", 32), ("reg", 0), ("prog", 64), ("prefill", 100)], ["last t1 [0] 64+36 ft7"]),
    ("every_d_rank_said_the_same", 0, [(0, 2, 48), (1, 2, 48)],
     [("reg", 0), ("reg", 1), ("prefill", 100)], ["last t1 [0, 1] 48+52 ft7"]),
    ("ranks_that_disagree_move_from_the_least", 0, [(0, 2, 48), (1, 2, 16)],
     [("reg", 0), ("reg", 1), ("prefill", 100)], ["last t1 [0, 1] 16+84 ft7"]),
]


@pytest.mark.parametrize("name,unit,regs,events,writes", CASES, ids=[c[0] for c in CASES])
def test_writes_skip_what_d_holds(name, unit, regs, events, writes):
    m = machine(total=4, unit=unit)
    got = []
    now = 0.0
    for ev in events:
        now += 1.0
        if ev[0] == "reg":
            acts = m.on_registration(reg(*regs[ev[1]]), now)
        elif ev[0] == "prog":
            acts = m.on_prefill_progress("t", 1, BLOCKS, ev[1], now)
        elif ev[0] == "prefill":
            acts = m.on_prefill_done("t", 1, BLOCKS, ev[1], FIRST, now)
        else:
            acts = m.on_write_done("t", 1, now, part=True)
        got += [short(a) for a in acts if isinstance(a, PostWrite)]
    assert got == writes
