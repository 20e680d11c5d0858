"""Two routers over the same instances, as a Kubernetes rolling update of the router has them (the new pod starts
while the old one still serves, then drains), or two replicas: each router's epoch aborted every request any other
router had sent (RouterEpoch), without a word to it, so the old router's requests in flight waited out their bound
and ended 504. Now a router's epoch aborts only what a router before it at the same place (address and port) left:
a second router leaves the first one's requests alone, and a router killed and started again where it served still
frees its orphans' blocks at once.

P and D on namespace hosts, each router on a host of its own, etcd in the root namespace. Root, ``ip netns`` and
etcd are needed; skipped cleanly without them."""
from __future__ import annotations

import os
import threading
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

PORT = 18000  # each router host is a namespace of its own
LONG = 1200  # tokens: still decoding when the second router starts (seconds on a CPU)


@pytest.mark.timeout(300)
def test_a_second_router_leaves_the_first_ones_requests_alone(tmp_path):
    from tests.support import netns

    with netns.hosts(4) as net, etcd_server(tmp_path, extra_hosts=(net.root_addr,)) as etcd:
        secret = tmp_path / "secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        common = ["--mode", "push", "--model", "tiny", "--num-blocks", "512", "--registry",
                  etcd.url(host=net.root_addr), "--registry-ttl", "2", "--secret-file", str(secret)]

        def up(name, i, role, *extra):
            return HostUp(name, net[i], ["--role", role, "--advertise", net[i].addr, *extra, *common], tmp_path,
                          UCX_TCP)

        hosts = [up("p", 1, "prefill"), up("d", 2, "decode")]
        try:
            hosts.append(up("router-a", 3, "router", "--port", str(PORT)))
            for h in hosts:
                h.wait_ready()
            url_a, url_b = f"http://{net[3].addr}:{PORT}", f"http://{net[4].addr}:{PORT}"
            engines = {hosts[0].engine_ids[0], hosts[1].engine_ids[0]}
            wait_for(lambda: engines <= up_engines(url_a), 30, "router a to choose P and D")
            results: list = []

            def ask(prompt):
                try:
                    results.append(http(url_a + "/v1/completions", {"prompt": prompt, "max_tokens": LONG},
                                        timeout=120))
                except OSError as e:  # the router killed under it (the second half)
                    results.append((0, str(e)))

            threads = [threading.Thread(target=ask, args=([5 + i] * 10,)) for i in range(3)]
            for t in threads:
                t.start()
            wait_for(lambda: any(i["legs"] for i in health(url_a)["instances"] if i["role"] == "decode"), 30,
                     "router a's requests on D")
            hosts.append(up("router-b", 4, "router", "--port", str(PORT)))  # the rolling update's new pod
            hosts[-1].wait_ready()
            wait_for(lambda: engines <= up_engines(url_b), 30, "router b to choose P and D")
            for t in threads:
                t.join(120)
            # before: 504 'request exceeded 60 s' for each (D aborted them when router b said its epoch)
            assert [s for s, _ in results] == [200] * 3, results
            assert all(len(b["choices"][0]["token_ids"]) == LONG for _, b in results)
            stats = hosts[1].stats()
            assert all(s.counters.get("router_epoch_aborted", 0) == 0 for s in stats.values()), stats
            status, _ = http(url_b + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
            assert status == 200

            # router a killed with its requests decoding, then started again where it served (a container
            # restarted in its pod): its epoch frees its orphans' blocks at once, not after LONG tokens
            results.clear()
            threads = [threading.Thread(target=ask, args=([7 + i] * 10,)) for i in range(3)]
            for t in threads:
                t.start()
            wait_for(lambda: sum(i["legs"] for i in health(url_a)["instances"] if i["role"] == "decode") >= 3, 30,
                     "router a's requests on D again")
            hosts[2].kill()
            hosts[2].cleanup()
            for t in threads:
                t.join(30)
            hosts[2] = up("router-a-again", 3, "router", "--port", str(PORT))
            hosts[2].wait_ready()
            t0 = time.monotonic()
            hosts[1].wait_pools_free(10)
            assert time.monotonic() - t0 < 10
            assert sum(s.counters.get("router_epoch_aborted", 0) for s in hosts[1].stats().values()) == 3
        finally:
            for h in hosts:
                h.stop()
