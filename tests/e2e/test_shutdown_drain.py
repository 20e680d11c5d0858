"""Stopping with vLLM's ``--shutdown-timeout`` as a terminal's Ctrl-C stops it (SIGINT to the whole foreground
process group, children included): the router refuses new requests and /health says 503 at once, the request in
flight streams to its last token and a background response ends (their instances stop only after them), and
`pushkv up` exits 0."""
import http.client
import json
import os
import signal
import time
import urllib.parse

import pytest

from tests.support.deploy import deployment

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 2000  # tiny on 2 CPU cores: seconds of decoding, so the stop comes while it streams


def _health_status(url: str) -> int:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_ctrl_c_with_shutdown_timeout_lets_the_requests_in_flight_finish(tmp_path):
    with deployment(tmp_path, "--mode", "push", "--model", "tiny", "--num-blocks", "256",
                    "--shutdown-timeout", "60", session=True) as dep:
        u = urllib.parse.urlsplit(dep.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}),
            headers={"content-type": "application/json"})
        r = conn.getresponse()
        first = r.readline()
        assert r.status == 200 and first.startswith(b"data: "), first  # in flight: its first token is out
        # a background response (no handler waits on it) that outlasts the stream: the drain waits for it too
        status, queued = dep.post("/v1/responses", {"input": "Hello", "max_output_tokens": MAX_TOKENS + 400,
                                                    "background": True})  # random weights: no EOS
        assert status == 200 and queued["status"] in ("queued", "in_progress"), queued
        os.killpg(dep.proc.pid, signal.SIGINT)  # Ctrl-C
        end = time.monotonic() + 20
        while _health_status(dep.url) != 503:  # draining: a balancer takes the router out
            assert time.monotonic() < end, "the router never began to stop"
            time.sleep(0.02)  # polls the router's own answer, no fixed wait
        status, body = dep.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 503 and body["error"]["message"] == "router shutting down", body
        text = first.decode() + r.read().decode()
        conn.close()
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert not [e for e in events if "error" in e], events[-3:]
        assert sum(len(e["choices"][0]["token_ids"] or []) for e in events) == MAX_TOKENS
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert dep.proc.wait(60) == 0
    log = (tmp_path / "up.log").read_text()
    assert "router draining: 2 request(s) in flight have up to 60 s to finish (--shutdown-timeout)" in log
    assert "router stopping: 0 request(s) in flight" in log  # the background response ended before the stop
