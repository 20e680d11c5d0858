"""tools/tcp_write_report.py: NIXL WRITE over UCX's TCP transport between two namespace hosts,
against a TCP socket, at small sizes; every rep's bytes are CRC-checked at the target."""
from __future__ import annotations

import os

import pytest

from tools import netns
from tools.tcp_write_report import MIB, measure, ucx_transport

pytestmark = pytest.mark.unit  # two NIXL agent processes in namespaces, no pushkv deployment

TABLE = """\
[1796.9] [vm:1:0]   | tcpw-initiator self cfg#0                                |
[1796.9] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
[1796.9] [vm:1:0]   | Range  | Description |              Config               |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
[1796.9] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                        |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
[1796.9] [vm:1:0]   | tcpw-initiator inter-node cfg#1                          |
[1796.9] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
[1796.9] [vm:1:0]   | Range  | Description |              Config               |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
[1796.9] [vm:1:0]   |  0..8k | short       | tcp/eth0                          |
[1796.9] [vm:1:0]   | 8k..inf| zero-copy   | tcp/eth0                          |
[1796.9] [vm:1:0]   +--------+-------------+-----------------------------------+
"""


@pytest.mark.parametrize("text, want", [
    (TABLE, "inter-node: 0..8k short via tcp/eth0; 8k..inf zero-copy via tcp/eth0"),
    ("nothing here", "unknown (UCX printed no protocol table)"),
])
def test_ucx_transport_from_the_protocol_table(text, want):
    assert ucx_transport(text) == want


@pytest.mark.timeout(120)
def test_write_over_tcp_between_namespaces():
    sizes = [64 << 10, 1 * MIB]
    mine = f"{os.getpid()}-"  # only this process's: another run may be making hosts meanwhile
    before = set(netns.list_namespaces(mine))
    result = measure(sizes, reps=2)
    assert [r["bytes"] for r in result["sizes"]] == sizes
    for r in result["sizes"]:
        assert r["verified_reps"] == 3  # each rep's CRC matched at the target (else measure raises)
        assert r["nixl_gbps"] > 0 and r["tcp_gbps"] > 0
    assert "tcp/" in result["ucx_transport"] and "cma" not in result["ucx_transport"]
    assert set(netns.list_namespaces(mine)) <= before
