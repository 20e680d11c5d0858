"""The capped link is real: a rate cap on two namespace hosts' links (``tools/netns.py``
``Host.cap``, a tc tbf qdisc: the regime ``tools/link_bench.py`` measures in) holds a NIXL WRITE
over UCX's TCP transport, and a plain TCP stream, of a few MiB to no less than (size - burst) / rate:
slower on a busy machine is allowed, faster never. Without the cap both are faster than size / rate,
so the bound is the qdisc's doing; a cap that was not applied fails the first test."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tools import netns
from tools.netns import cap_burst_bytes, parse_rate
from tools.tcp_write_report import MIB, measure

pytestmark = pytest.mark.unit  # two NIXL agent processes in namespaces, no pushkv deployment

RATE = "200mbit"  # slow enough that the capped and the free link differ ~10x even on a busy machine
SIZE = 8 * MIB  # >= 0.33 s through the cap
REPS = 2


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root: network namespaces and tc qdiscs"
    if shutil.which("tc") is None:
        return "needs tc (iproute2) to cap the link"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "needs `ip netns`"
    return ""


namespaces = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")


@pytest.mark.parametrize("text, bps", [
    ("1gbit", 1e9), ("10gbit", 1e10), ("100mbit", 1e8), ("2.5gbit", 2.5e9), ("500kbit", 5e5), ("none", None),
    ("NONE", None), ("1Gbit", 1e9),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["1gbps", "fast", "0gbit", "-1gbit", ""])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.parametrize("bps, burst", [(1e9, 131072), (1e10, 1250000), (1e8, 131072)])
def test_burst_holds_a_gso_packet_and_a_millisecond(bps, burst):
    assert cap_burst_bytes(bps) == burst


def _mine() -> set[str]:
    return set(netns.list_namespaces(f"{os.getpid()}-"))


@namespaces
@pytest.mark.timeout(120)
def test_capped_link_is_never_faster_than_its_rate():
    before = _mine()
    bps = parse_rate(RATE)
    floor_s = (SIZE - cap_burst_bytes(bps)) * 8 / bps
    result = measure([SIZE], reps=REPS, rate=RATE)
    row = result["sizes"][0]
    assert "tcp/" in result["ucx_transport"] and "cma" not in result["ucx_transport"], result["ucx_transport"]
    for q in result["qdisc"].values():  # the traffic went through a tbf at the rate
        assert q["kind"] == "tbf" and q["options"]["rate"] * 8 == bps, q
    sender = result["qdisc"][result["hosts"][0]]
    assert sender["bytes"] >= 2 * (REPS + 1) * SIZE, sender  # every rep, WRITE and stream
    # the fastest rep of each, not the median: the cap bounds every one
    assert row["nixl_min_s"] >= floor_s, (row, floor_s)
    assert row["tcp_min_s"] >= floor_s, (row, floor_s)
    assert _mine() <= before  # namespaces (with their veths and qdiscs) are gone


@namespaces
@pytest.mark.timeout(120)
def test_free_link_is_faster_than_the_cap():
    before = _mine()
    wire_s = SIZE * 8 / parse_rate(RATE)
    result = measure([SIZE], reps=REPS)
    row = result["sizes"][0]
    assert all(q["kind"] != "tbf" for q in result["qdisc"].values()), result["qdisc"]
    assert row["nixl_s"] < wire_s, (row, wire_s)
    assert row["tcp_s"] < wire_s, (row, wire_s)
    assert _mine() <= before


@namespaces
@pytest.mark.timeout(120)
def test_link_bench_probes_the_capped_link_and_the_planner_takes_its_rate():
    """link-bench's probe at a rate (``probe_link``, on hosts that exist, under the deployments'
    UCX settings) keeps each size's WRITE time; the planner's link rate is their slope: through
    the cap (never faster than it), and the probe's, not the cap's."""
    from argparse import Namespace

    from tools import link_bench, link_plan

    before = _mine()
    bps = parse_rate(RATE)
    args = Namespace(probe_mib=[2.0, SIZE / MIB], probe_reps=REPS, ucx_tls="tcp", ucx_net_devices=netns.DEV)
    results: dict = {"model": {"kv_bytes_per_token": 1024}}
    lines: list[str] = []
    with netns.hosts(2) as net:
        for h in (net[1], net[2]):
            h.cap(RATE)
        link_bench.probe_link(net, RATE, args, results, Namespace(write=lines.append))
    (probe,) = results["probes"][RATE]
    assert "error" not in probe, probe
    assert [sz["bytes"] for sz in probe["sizes"]] == [2 * MIB, SIZE] and "tcp/" in probe["ucx_transport"], probe
    floor = {sz["bytes"]: (sz["bytes"] - cap_burst_bytes(bps)) * 8 / bps for sz in probe["sizes"]}
    assert all(sz["nixl_min_s"] >= floor[sz["bytes"]] for sz in probe["sizes"]), (probe, floor)
    rate, source = link_plan.link_rate(results, RATE)  # bytes per ms
    assert source == "probe" and 0.2 * bps / 8e3 < rate <= bps * link_plan.TCP_PAYLOAD_SHARE / 8e3, rate
    assert lines and lines[0].startswith(f"link probe at {RATE}: 2 MiB WRITE"), lines
    assert _mine() <= before
