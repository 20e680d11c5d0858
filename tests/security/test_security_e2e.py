"""A push deployment with ``--secret-file`` and ``--api-key``, end to end over real processes.

Its writers' handshake endpoints and its schedulers' are tcp on loopback (pinned in a config
file, as a multi-host deployment has them; one host's default is ipc in the run dir), so CURVE runs on the writer-to-writer
handshake and on the router's links: a request is served, the handshake sockets report CURVE
handshakes, and peers without the secret (plain ZMQ, another secret) are refused and counted
by the process they knocked on. The HTTP API takes the key through the official ``openai``
client; with ``--metrics-auth`` /metrics (the router's and each instance's) takes it too, /health
stays open.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from pushkv import messages as m
from pushkv.security import Security, derive_keys, load_secret
from pushkv.supervisor.plan import free_tcp_port
from tests.support.deploy import deployment, wait_pools_free
from tests.support.other_uid import knock

openai = pytest.importorskip("openai")

KEY = "sk-pushkv-test-key"
SECRET = b"6f1d0c7e2b9a4c3d8e5f60718293a4b5c6d7e8f9"
WAIT_S = 20.0


def _stats_until(dep, role, pred, timeout_s=WAIT_S) -> m.Stats:
    end = time.monotonic() + timeout_s
    while True:
        st = dep.stats(role)
        if pred(st.counters) or time.monotonic() > end:
            return st
        time.sleep(0.05)  # polling a remote counter, bounded by timeout_s


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    secret = tmp / "curve.secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    cfg = tmp / "deploy.json"
    cfg.write_text(json.dumps({
        # tcp as a deployment over several hosts has them (one host's default is ipc in the run dir)
        role: {"sched_endpoint": f"tcp://127.0.0.1:{free_tcp_port()}",
               "handshake_endpoints": [f"tcp://127.0.0.1:{free_tcp_port()}"]} for role in ("prefill", "decode")
    }))
    with deployment(tmp, "--config", str(cfg), "--mode", "push", "--model", "tiny", "--num-blocks", "128",
                    "--secret-file", str(secret), "--api-key", KEY, "--metrics-auth") as d:
        yield d
        wait_pools_free(d)


def _client(dep, key):
    return openai.OpenAI(base_url=dep.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.timeout(300)
def test_secured_push_serves_and_curve_runs_on_tcp(dep):
    cfg = dep.cfg
    assert cfg.secret_file and load_secret(cfg.secret_file) == SECRET
    for inst in (cfg.prefill, cfg.decode):
        assert inst.sched_endpoint.startswith("tcp://127.0.0.1:")
        assert all(e.startswith("tcp://127.0.0.1:") for e in inst.handshake_endpoints)
    r = _client(dep, KEY).completions.create(model="tiny", prompt="secure hello", max_tokens=6, temperature=0)
    assert len(r.choices[0].token_ids) == 6
    # the writers' handshake ran over CURVE (D dials P's handshake ROUTER), and so did the
    # router's DEALERs to both schedulers' ROUTERs
    p = _stats_until(dep, "prefill", lambda c: c.get("writer.0.curve_accepted", 0) >= 1)
    assert p.counters["writer.0.curve_accepted"] >= 1, p.counters
    assert p.counters["curve_accepted"] >= 1 and p.counters["curve_refused"] == 0, p.counters
    d = dep.stats("decode")
    assert d.counters["curve_accepted"] >= 1 and d.counters["curve_refused"] == 0, d.counters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("who, security", [
    ("plain ZMQ", lambda: None),
    ("another secret", lambda: Security(derive_keys(b"not-the-deployment-secret-at-all"))),
])
def test_peer_without_the_secret_is_refused_and_counted(dep, who, security):
    hs = dep.cfg.prefill.handshake_endpoints[0]
    sched = dep.cfg.decode.sched_endpoint
    key_w, key_s = "writer.0.curve_refused", "curve_refused"  # the why: test_security.py
    before_w = dep.stats("prefill").counters.get(key_w, 0)
    before_s = dep.stats("decode").counters.get(key_s, 0)
    knock(hs, security(), m.encode(m.GetStats()))  # at P's writer handshake socket
    knock(sched, security(), m.encode(m.GetStats()))  # at D's scheduler
    p = _stats_until(dep, "prefill", lambda c: c.get(key_w, 0) > before_w)
    assert p.counters[key_w] > before_w, (who, p.counters)  # >: a refused peer may redial
    d = _stats_until(dep, "decode", lambda c: c.get(key_s, 0) > before_s)
    assert d.counters[key_s] > before_s, (who, d.counters)
    # the deployment still serves
    r = _client(dep, KEY).completions.create(model="tiny", prompt="after " + who, max_tokens=3, temperature=0)
    assert len(r.choices[0].token_ids) == 3


def _get(url: str, key: str = KEY) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _refused(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("pushkv_router_auth_refused_total "):
            return float(line.split()[1])
    raise AssertionError("pushkv_router_auth_refused_total not in /metrics")


@pytest.mark.timeout(300)
def test_api_key(dep):
    good = _client(dep, KEY)
    assert [x.id for x in good.models.list().data] == ["tiny"]
    before = _refused(_get(dep.url + "/metrics")[1])
    no_key = openai.OpenAI(base_url=dep.url + "/v1", api_key="-", max_retries=0, default_headers={"Authorization": ""})
    for cli in (_client(dep, "sk-wrong"), no_key):
        with pytest.raises(openai.AuthenticationError) as e:
            cli.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert e.value.status_code == 401
        assert "API key" in e.value.body["message"] and e.value.body["type"] == "authentication_error"
    req = urllib.request.Request(dep.url + "/v1/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    assert _get(dep.url + "/health", key="")[0] == 200  # probes need no key
    status, metrics = _get(dep.url + "/metrics")
    assert status == 200 and _refused(metrics) == before + 3


@pytest.mark.timeout(300)
def test_metrics_behind_the_key(dep):
    """--metrics-auth: the router's /metrics and each instance's answer 401 without the key or with
    another, and the scrape with it."""
    cfg = dep.cfg
    urls = [dep.url + "/metrics"] + [f"http://{cfg.metrics_host()}:{i.metrics_port}/metrics"
                                     for i in (cfg.prefill, cfg.decode)]
    for url in urls:
        for key in ("", "sk-wrong"):
            status, body = _get(url, key)
            assert status == 401 and "vllm:" not in body and "pushkv_" not in body, (url, key, status)
        status, body = _get(url)
        assert status == 200 and ("vllm:num_requests_running" in body or "pushkv_router" in body), url
    assert "pushkv_router_auth_refused_total" in _get(dep.url + "/metrics")[1]
