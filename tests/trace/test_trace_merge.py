"""tools/trace/merge.py (pure): host clock offsets from messages mirrored on both sides."""
from __future__ import annotations

import msgspec
import pytest

from pushkv import messages as m
from tools.trace import merge as trace_merge

# true clocks: what each host's t_mono reads when the reference reads 0
SKEW = {"r": 0.0, "p": 500.25, "d": -73.5}


def ev(host, process, direction, kind, t_true, tid="t1", payload=b"x", peer=""):
    return m.TraceEvent(t_mono=t_true + SKEW[host], t_wall=0.0, process=process, direction=direction, peer=peer,
                        kind=kind, transfer_id=tid, payload=payload, host=host)


def msg(src, sp, dst, dp, kind, t_send, latency, tid="t1", payload=b"x"):
    return [ev(src, sp, "send", kind, t_send, tid, payload), ev(dst, dp, "recv", kind, t_send + latency, tid, payload)]


def request(tid: str, t0: float, lat_fwd: float, lat_back: float):
    """router -> P and D, D <-> P writers, D -> router: every hop both ways between some hosts."""
    return (msg("r", "router", "p", "prefill-scheduler", "Generate", t0, lat_fwd, tid, b"gp" + tid.encode())
            + msg("r", "router", "d", "decode-scheduler", "Generate", t0, lat_fwd, tid, b"gd" + tid.encode())
            + msg("d", "decode-writer-0", "p", "prefill-writer-0", "Register", t0 + 0.001, lat_fwd, tid, b"rg" + tid.encode())
            + msg("p", "prefill-writer-0", "d", "decode-writer-0", "WriteDone", t0 + 0.1, lat_back, tid, b"wd" + tid.encode())
            + msg("d", "decode-scheduler", "r", "router", "Tokens", t0 + 0.11, lat_back, tid, b"tk" + tid.encode())
            + msg("p", "prefill-scheduler", "r", "router", "PrefillFinished", t0 + 0.1, lat_back, tid, b"pf" + tid.encode()))


@pytest.mark.parametrize("lat_fwd, lat_back", [(1e-4, 1e-4), (1e-4, 3e-4), (5e-3, 1e-4)])
def test_offsets_within_the_stated_error(lat_fwd, lat_back):
    evs = [e for i in range(5) for e in request(f"t{i}", i * 0.5, lat_fwd, lat_back)]
    al = trace_merge.align(evs)
    assert al.reference == "r" and al.unaligned == []
    for h in ("p", "d"):
        assert abs(al.offsets[h] + SKEW[h]) <= al.error_s[h] + 1e-9, (h, al)
        assert al.error_s[h] <= (lat_fwd + lat_back) / 2 + 1e-9
    if lat_fwd == lat_back:  # symmetric delays: exact
        assert al.offsets["p"] == pytest.approx(-SKEW["p"], abs=1e-9)


def test_merged_is_one_clock_with_a_lane_per_host():
    evs = request("t0", 0.0, 1e-4, 1e-4)
    out, al = trace_merge.merged(evs)
    assert [e.t_mono for e in out] == sorted(e.t_mono for e in out)
    sends = {(e.kind, e.payload): e.t_mono for e in out if e.direction == "send"}
    for e in out:
        if e.direction == "recv":  # causality holds on the merged clock
            assert e.t_mono >= sends[(e.kind, e.payload)]
    assert {e.process for e in out} >= {"router@r", "prefill-writer-0@p", "decode-writer-0@d"}


def test_a_host_with_messages_one_way_only_is_reported_unaligned(monkeypatch):
    monkeypatch.setitem(SKEW, "x", 9.0)
    evs = (request("t0", 0.0, 1e-4, 1e-4) + [ev("x", "lonely", "event", "started", 0.2)]
           + msg("r", "router", "x", "lonely", "Generate", 1.0, 1e-4, "t9", b"z"))  # one way: no bound
    al = trace_merge.align(evs)
    assert al.unaligned == ["x"] and al.offsets["x"] == 0.0
    assert "not aligned" in trace_merge.describe(al)


def test_one_host_is_left_alone():
    evs = [msgspec.structs.replace(e, host="") for e in request("t0", 0.0, 1e-4, 1e-4)]
    out, al = trace_merge.merged(evs)
    assert al.offsets == {"": 0.0} and {e.process for e in out} == {e.process for e in evs}

