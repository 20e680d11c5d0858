"""A host started with another --secret-file (a Secret rotated under a running deployment, a copy gone wrong):
its instance is in etcd, but its scheduler refuses the router's CURVE handshake without a word. The router
chose it anyway, and each request placed on it waited out the transfer's bound (30 s) and failed with an
unrelated reason ("no registration within 30.0s"). Now an instance found in the registry is chosen only once
its scheduler has answered over the link; this one never is, the log names it, and the requests go to the
instance of the right secret.

Three namespace hosts (P, D with the deployment's secret, D with another), the router and etcd in the root
namespace. Root, ``ip netns`` and etcd are needed; skipped cleanly without them."""
from __future__ import annotations

import os
import time

import pytest

from tests.hosts.test_hosts import UCX_TCP, _netns_ok
from tests.support.etcd_server import ETCD_BIN, etcd_server
from tests.support.hosts_up import HostUp, health, http, up_engines, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not _netns_ok(), reason="needs root and `ip netns`"),
    pytest.mark.skipif(not os.path.exists(ETCD_BIN), reason="needs etcd (Debian etcd-server)"),
]


def _secret(path):
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.mark.timeout(240)
def test_a_host_with_another_secret_is_never_chosen(tmp_path):
    from pushkv.supervisor.plan import free_tcp_port
    from tests.support import netns

    with netns.hosts(3) as net, etcd_server(tmp_path, extra_hosts=(net.root_addr,)) as etcd:
        good, other = _secret(tmp_path / "secret"), _secret(tmp_path / "other-secret")
        common = ["--mode", "push", "--model", "tiny", "--num-blocks", "64", "--registry",
                  etcd.url(host=net.root_addr), "--registry-ttl", "2"]

        def host(name, i, role, secret):
            return HostUp(name, net[i], ["--role", role, "--advertise", net[i].addr, *common, "--secret-file", secret],
                          tmp_path, UCX_TCP)

        port = free_tcp_port(net.root_addr)
        hosts = []
        try:
            hosts += [host("p", 1, "prefill", good), host("d-other", 2, "decode", other)]
            hosts.append(HostUp("router", None, ["--role", "router", "--advertise", net.root_addr, "--port", str(port),
                                                 *common, "--secret-file", good], tmp_path))
            for h in hosts:
                h.wait_ready()
            url = f"http://{net.root_addr}:{port}"
            p_engine, bad = hosts[0].engine_ids[0], hosts[1].engine_ids[0]
            wait_for(lambda: p_engine in up_engines(url), 20, "the router to choose P")
            # the router names the host it cannot talk to (JOIN_ANSWER_S after it found it)
            wait_for(lambda: hosts[2].log_has(f"decode instance {bad} does not answer"), 20,
                     "the router to name the D it cannot reach")
            assert bad not in up_engines(url)
            assert hosts[1].log_has("refused a peer")  # the other side counts the refusals
            t0 = time.monotonic()
            status, body = http(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
            # before: placed on the unreachable D, 502 "no registration within 30.0s" after 30 s
            assert status == 503 and "no live decode instance" in body["error"]["message"], (status, body)
            assert time.monotonic() - t0 < 5
            # a D with the deployment's secret joins and serves; the other is still never chosen
            hosts.append(host("d", 3, "decode", good))
            hosts[-1].wait_ready()
            d_engine = hosts[-1].engine_ids[0]
            wait_for(lambda: d_engine in up_engines(url), 20, "the router to choose the good D")
            for _ in range(4):
                status, body = http(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
                assert status == 200, body
                assert body["pushkv"]["instances"] == {"prefill": p_engine, "decode": d_engine}
            rows = {i["engine_id"]: i for i in health(url)["instances"]}
            assert not rows[bad]["up"] and rows[d_engine]["up"]
        finally:
            for h in hosts:
                h.stop()
