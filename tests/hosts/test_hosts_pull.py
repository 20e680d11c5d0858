"""Pull across four namespace hosts: the same cluster as tests/hosts/test_hosts.py with ``--mode pull``
(P finishes, the router relays P's blocks to D, D READs over UCX on TCP): greedy tokens equal a
local run, every P and D instance serves, no block is left held. Its own module, so the push
cluster of test_hosts.py is down before this one starts."""
from __future__ import annotations

import pytest

from tests.hosts.test_hosts import pytestmark, reference, running_cluster, serve_spread  # noqa: F401 (fixture, marks)


@pytest.mark.timeout(240)
def test_pull_on_four_hosts_tokens_equal_local_and_spread(tmp_path, reference):
    with running_cluster(tmp_path, mode="pull") as c:
        bodies, served, leaked = serve_spread(c, reference)
        d_writers = [s.counters for n in ("d1", "d2") for s in c.hosts[n].stats().values()]
        assert all(w.get("writer.0.bytes_read", 0) > 0 for w in d_writers), d_writers  # D READ over TCP
        c.record("pull_tokens_and_spread", {"requests": len(bodies), "tokens_equal_local": True,
                                            "prefill_engines": sorted(served["prefill"]),
                                            "decode_engines": sorted(served["decode"]), "blocks_held_after": leaked})
