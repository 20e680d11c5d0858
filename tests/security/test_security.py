"""CURVE between real ZMQ sockets over loopback TCP: key derivation (table), a peer with
the secret talks, peers without it are refused and counted, ipc stays plain."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import zmq
import zmq.asyncio
from zmq.utils import z85

from pushkv import security as sec
from pushkv.security import Security, derive_keys, secure_bind, secure_connect

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"
WAIT_S = 5.0


# -- pure: derivation and loading ---------------------------------------------------------
@pytest.mark.parametrize("a, b, same", [
    (SECRET, SECRET, True),
    (SECRET, OTHER, False),
    (SECRET, SECRET[:-1] + b"0", False),
])
def test_derive_keys_is_deterministic_and_secret_bound(a, b, same):
    ka, kb = derive_keys(a), derive_keys(b)
    assert (ka == kb) is same
    assert ka.server_public != ka.client_public  # two pairs, not one
    assert zmq.curve_public(ka.server_secret) == ka.server_public
    assert zmq.curve_public(ka.client_secret) == ka.client_public


# frozen: every host of a deployment must derive the same keys, so a change of the derivation
# (its parameters, salts, order) must be a decision, not an accident. "hkdf" is the derivation
# before the work factor: a host that sets PUSHKV_KDF=hkdf talks to hosts of the older version.
KDF_VECTORS = {
    "hkdf": (b"!TvKi9J19eJor*X[6<!KxtkdDgZPMlXrDF[oF]mk", b"StB89W#:7gU&xVTG@><PtHB$X!aTwB@)Y.cEX=G^"),
    "scrypt": (b"A*Bcp@}$T[=KEG#7)j[kusm)6tmBuf&j+MyvwSPc", b"a=UQ{NU-hQnoquFWws{=R0254Cw1wUaTNrXK]#)I"),
}


@pytest.mark.parametrize("kdf", sorted(KDF_VECTORS))
def test_derivation_is_frozen(kdf):
    k = derive_keys(SECRET, kdf)
    assert (k.server_public, k.client_public) == KDF_VECTORS[kdf]


def test_the_default_derivation_has_a_work_factor(monkeypatch):
    """scrypt, at least N=2^15 with r=8 (32 MiB a guess), then HKDF; PUSHKV_KDF picks the other."""
    import hashlib

    assert sec.SCRYPT_N >= 2**15 and sec.SCRYPT_R >= 8
    stretched = hashlib.scrypt(SECRET, salt=sec.SCRYPT_SALT, n=2**15, r=8, p=1, maxmem=2**26, dklen=32)
    want = zmq.curve_public(z85.encode(sec.hkdf_sha256(stretched, sec.KDF_SALT, b"server")))
    monkeypatch.delenv("PUSHKV_KDF", raising=False)
    assert derive_keys(SECRET).server_public == want == KDF_VECTORS["scrypt"][0]
    monkeypatch.setenv("PUSHKV_KDF", "hkdf")
    assert derive_keys(SECRET) == derive_keys(SECRET, "hkdf") != derive_keys(SECRET, "scrypt")
    monkeypatch.setenv("PUSHKV_KDF", "md5")
    with pytest.raises(ValueError, match="PUSHKV_KDF"):
        derive_keys(SECRET)


def test_hkdf_matches_rfc5869_case_1():
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = sec.hkdf_sha256(ikm, salt, info, 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


@pytest.mark.parametrize("content, ok", [
    (SECRET + b"\n", True),  # the newline echo adds is not part of the secret
    (b"  " + SECRET + b"\r\n", True),
    (b"short\n", False),
    (b"", False),
])
def test_load_secret(tmp_path, content, ok):
    p = tmp_path / "curve.secret"
    p.write_bytes(content)
    p.chmod(0o600)
    if ok:
        assert sec.load_secret(str(p)) == SECRET
    else:
        with pytest.raises(ValueError, match="too short"):
            sec.load_secret(str(p))


@pytest.mark.parametrize("endpoint, network", [
    ("tcp://127.0.0.1:5555", True), ("tcp://[::1]:1", True), ("ws://h:1", True),
    ("ipc:///tmp/x.sock", False), ("inproc://x", False),
])
def test_network_endpoints(endpoint, network):
    assert sec.is_network(endpoint) is network


# -- real sockets -------------------------------------------------------------------------
def _wait(pred, timeout_s=WAIT_S):
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)  # polling a counter another thread updates, bounded by timeout_s
    return True


@pytest.fixture
def server():
    ctx = zmq.Context()
    counters: Counter = Counter()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    secure_bind(s, "tcp://127.0.0.1:*", Security(derive_keys(SECRET), counters))
    endpoint = s.getsockopt(zmq.LAST_ENDPOINT).decode()
    yield s, endpoint, counters
    s.close(0)
    ctx.term()  # the guard thread must let go of the context


def _client(ctx, endpoint, security):
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    secure_connect(c, endpoint, security)
    return c


def _echo(server_sock, client, payload=b"ping"):
    client.send(payload)
    if not server_sock.poll(int(WAIT_S * 1000)):
        return None
    ident, data = server_sock.recv_multipart()
    server_sock.send_multipart([ident, data + b"!"])
    assert client.poll(int(WAIT_S * 1000))
    return client.recv()


@pytest.mark.timeout(30)
def test_peer_with_the_secret_talks(server):
    s, endpoint, counters = server
    ctx = zmq.Context()
    try:
        c = _client(ctx, endpoint, Security(derive_keys(SECRET)))
        assert _echo(s, c) == b"ping!"
        assert _wait(lambda: counters["curve_accepted"] == 1)  # the guard thread counts it
        assert counters["curve_refused"] == 0
    finally:
        ctx.destroy(0)


def _other_client_key():
    k = derive_keys(SECRET)
    pub, secret = zmq.curve_keypair()  # knows the server's public key, but not the secret
    return Security(sec.CurveKeys(k.server_public, b"", pub, secret))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("who, security, whys", [
    # which side sees the mechanism mismatch first is a race: the server either reads the
    # peer's NULL greeting (no_curve) or finds it gone mid-handshake (handshake)
    ("no CURVE", lambda: None, ("no_curve", "handshake")),
    ("another secret", lambda: Security(derive_keys(OTHER)), ("bad_key",)),
    ("server key, own client key", _other_client_key, ("not_allowed",)),
    # a host left on the other derivation (an upgrade half done): refused as a stranger, so
    # every host must set the same PUSHKV_KDF (docs/security.md, upgrading)
    ("the secret, the old derivation", lambda: Security(derive_keys(SECRET, "hkdf")), ("bad_key",)),
])
def test_peer_without_the_secret_is_refused_and_counted(server, who, security, whys):
    s, endpoint, counters = server
    ctx = zmq.Context()
    try:
        c = _client(ctx, endpoint, security())
        c.send(b"let me in")
        assert _wait(lambda: counters["curve_refused"] >= 1), f"{who}: refusal not counted: {counters}"
        assert sum(counters[f"curve_refused_{w}"] for w in whys) == counters["curve_refused"], counters
        assert not s.poll(200), f"{who}: a message got through"
        assert counters["curve_accepted"] == 0
        c.close(0)
        # and a peer with the secret still gets in afterwards
        good = _client(ctx, endpoint, Security(derive_keys(SECRET)))
        assert _echo(s, good) == b"ping!"
    finally:
        ctx.destroy(0)


@pytest.mark.timeout(30)
def test_ipc_stays_plain_beside_a_guarded_socket(server, tmp_path):
    """A CURVE-less ipc peer in a guarded context: ZAP lets NULL through, nothing is counted."""
    s, _, counters = server
    ctx = zmq.Context()
    try:
        sec_ = Security(derive_keys(SECRET), counters)
        rep = ctx.socket(zmq.ROUTER)
        rep.setsockopt(zmq.LINGER, 0)
        tcp = ctx.socket(zmq.ROUTER)  # starts this context's guard
        tcp.setsockopt(zmq.LINGER, 0)
        secure_bind(tcp, "tcp://127.0.0.1:*", sec_)
        secure_bind(rep, f"ipc://{tmp_path}/plain.sock", sec_)
        c = _client(ctx, f"ipc://{tmp_path}/plain.sock", sec_)
        assert _echo(rep, c) == b"ping!"
        assert counters["curve_refused"] == 0
        for x in (c, rep, tcp):
            x.close(0)
    finally:
        ctx.destroy(0)


@pytest.mark.timeout(30)
def test_asyncio_client_and_server():
    """zmq.asyncio sockets (the router's) on both sides, one refused sync peer counted."""
    async def main():
        ctx = zmq.asyncio.Context()
        counters: Counter = Counter()
        srv = ctx.socket(zmq.ROUTER)
        srv.setsockopt(zmq.LINGER, 0)
        secure_bind(srv, "tcp://127.0.0.1:*", Security(derive_keys(SECRET), counters))
        endpoint = srv.getsockopt(zmq.LAST_ENDPOINT).decode()
        cli = ctx.socket(zmq.DEALER)
        cli.setsockopt(zmq.LINGER, 0)
        secure_connect(cli, endpoint, Security(derive_keys(SECRET)))
        await cli.send(b"hi")
        ident, data = await asyncio.wait_for(srv.recv_multipart(), WAIT_S)
        await srv.send_multipart([ident, data + b"!"])
        assert await asyncio.wait_for(cli.recv(), WAIT_S) == b"hi!"
        plain_ctx = zmq.Context()
        bad = _client(plain_ctx, endpoint, None)
        bad.send(b"x")
        assert await asyncio.to_thread(_wait, lambda: counters["curve_refused"] >= 1)
        bad.close(0)
        plain_ctx.term()
        for x in (srv, cli):
            x.close(0)
        ctx.term()
    asyncio.run(main())


def test_vllm_connector_settings_carry_the_secret_file():
    """The vLLM connector's writers take the secret from kv_connector_extra_config or the env."""
    from pushkv.vllm import params as P

    assert P.settings("E", 1, {"secret_file": "/etc/pushkv/curve.secret"}, env={}).secret_file == "/etc/pushkv/curve.secret"
    assert P.settings("E", 1, None, env={"PUSHKV_SECRET_FILE": "/s"}).secret_file == "/s"
    assert P.settings("E", 1, None, env={}).secret_file == ""


@pytest.mark.parametrize("path, header, key, ok", [
    ("/v1/completions", "", "", True),  # no key configured: everything passes
    ("/v1/completions", "Bearer k1", "k1", True),
    ("/v1/chat/completions", "bearer  k1 ", "k1", True),  # scheme case-insensitive, token trimmed
    ("/v1/completions", "", "k1", False),
    ("/v1/models", "Bearer k2", "k1", False),
    ("/v1/completions", "Basic k1", "k1", False),
    ("/v1/completions", "k1", "k1", False),
    ("/health", "", "k1", True),  # probes and scrapers
    ("/metrics", "", "k1", True),
    ("/v1", "", "k1", True),  # not an API path (aiohttp answers 404)
    ("/reset_prefix_cache", "", "k1", False),  # it changes every user's service
    ("/reset_prefix_cache", "Bearer k1", "k1", True),
    ("/reset_prefix_cache", "", "", True),
])
def test_api_key_rule(path, header, key, ok):
    from pushkv.router.auth import authorized

    assert authorized(path, header, key) is ok


@pytest.mark.parametrize("path, header, key, ok", [  # --metrics-auth
    ("/metrics", "", "k1", False),
    ("/metrics", "Bearer k2", "k1", False),
    ("/metrics", "Bearer k1", "k1", True),
    ("/metrics", "", "", True),  # no key at all (pushkv up refuses --metrics-auth without one)
    ("/health", "", "k1", True),  # probes still pass
    ("/v1/models", "", "k1", False),
])
def test_metrics_auth_rule(path, header, key, ok):
    from pushkv.router.auth import authorized

    assert authorized(path, header, key, metrics=True) is ok


def _http_get(url: str, key: str = "") -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("key", ["", "sk-metrics"])
def test_instance_metrics_server_behind_the_key(key):
    """An instance's /metrics server (real HTTP): with a key, no or a wrong bearer gets a 401 and
    no metric; the key gets the scrape. Without a key it is open."""
    from prometheus_client import CollectorRegistry, Counter

    from pushkv.scheduler import metrics_http
    from pushkv.supervisor.plan import free_tcp_port

    reg = CollectorRegistry()
    Counter("pushkv_probe", "a probe counter", registry=reg).inc(3)
    port = free_tcp_port()
    srv = metrics_http.serve(port, "127.0.0.1", reg, key)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        status, body = _http_get(url)
        if key:
            assert status == 401 and "pushkv_probe" not in body, (status, body)
            assert _http_get(url, "sk-wrong")[0] == 401
            status, body = _http_get(url, key)
        assert status == 200 and "pushkv_probe_total 3.0" in body, (status, body)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("kind, metrics_auth, gets_key", [
    ("router", False, True),
    ("scheduler", False, False),
    ("scheduler", True, True),  # its /metrics checks the key
    ("worker", True, False),
    ("writer", True, False),
])
def test_a_child_gets_only_the_secrets_it_uses(kind, metrics_auth, gets_key):
    from pushkv.security import API_KEY_ENV
    from pushkv.supervisor.lifecycle import child_env

    env = child_env(f"x-{kind}", "dep", base={API_KEY_ENV: "sk-k", "PATH": "/bin"}, kind=kind,
                    metrics_auth=metrics_auth)
    assert (API_KEY_ENV in env) is gets_key and env["PATH"] == "/bin" and env["PUSHKV_NAME"] == f"x-{kind}"


@pytest.mark.parametrize("content, mode, expect", [
    (None, 0o600, "--secret-file {path}: No such file or directory; make one"),
    (b"short\n", 0o600, "too short"),
    (SECRET, 0o644, "--secret-file {path}: mode 0644, so every user of this host may read or write the CURVE secret; "
                    "chmod 600 {path}"),
    (SECRET, 0o602, "mode 0602"),
])
def test_pushkv_up_refuses_a_bad_secret_before_starting(tmp_path, capsys, content, mode, expect):
    from processes.cli import main

    path = tmp_path / "curve.secret"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    assert main(["up", "--model", "tiny", "--secret-file", str(path)]) == 2
    assert expect.format(path=path) in capsys.readouterr().err


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640])
def test_a_secret_of_the_user_or_its_group_passes(tmp_path, mode):
    path = tmp_path / "curve.secret"
    path.write_bytes(SECRET)
    path.chmod(mode)
    sec.check_secret_file(str(path))  # raises on a refusal


def test_a_tcp_trace_endpoint_needs_the_secret_or_insecure(capsys):
    """--trace tcp://...: every message mirrored (prompts, the writers' NIXL metadata) to whoever subscribes: refused
    without --secret-file; --insecure publishes it plain, saying so (refused here later, at the taken port)."""
    import socket

    from processes.cli import main

    assert main(["up", "--model", "tiny", "--trace", "tcp://127.0.0.1:18556"]) == 2
    err = capsys.readouterr().err
    assert "--trace tcp://127.0.0.1:18556 publishes every message" in err and "--secret-file" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["up", "--model", "tiny", "--trace", "tcp://127.0.0.1:18556", "--insecure", "--port", port]) == 2
    err = capsys.readouterr().err
    assert "WARNING --insecure: --trace tcp://127.0.0.1:18556 publishes every message plain" in err
    assert f"--port {port}: 127.0.0.1:{port} is taken" in err
    for trace in (["--trace"], []):  # the run dir's socket, or no trace: nothing to say, refused at the port
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = str(taken.getsockname()[1])
            assert main(["up", "--model", "tiny", *trace, "--port", port]) == 2
        err = capsys.readouterr().err
        assert "publishes every message" not in err and f"--port {port}: 127.0.0.1:{port} is taken" in err


@pytest.mark.parametrize("field", ["trace_endpoint", "trace_tap_endpoint"])
def test_a_tcp_trace_endpoint_from_a_config_file_needs_the_secret_too(tmp_path, capsys, field):
    """The same check wherever the endpoint comes from: a --config file's trace_endpoint (where every process
    publishes its messages) on tcp was taken without --secret-file, its traffic plain on the network."""
    import json
    import socket

    from processes.cli import main

    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"model": "tiny", field: "tcp://127.0.0.1:18557"}))
    with socket.socket() as taken:  # where the check is missing, refused at the port instead: nothing starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["up", "--config", str(path), "--port", port]) == 2
        err = capsys.readouterr().err
        assert "tcp://127.0.0.1:18557 publishes every message" in err and "--secret-file" in err, err
        assert main(["up", "--config", str(path), "--port", port, "--insecure"]) == 2
        err = capsys.readouterr().err
        assert "WARNING --insecure:" in err and "tcp://127.0.0.1:18557 publishes every message plain" in err, err


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_shutdown_timeout_is_taken_on_every_host_role(capsys, role):
    """--shutdown-timeout drains on every host: the router host its router, a P or D host its instances (marked
    draining in the registry: tests/hosts/test_hosts.py); none says it has no effect any more (refused here later,
    for want of a secret, so nothing starts)."""
    from processes.cli import main

    assert main(["up", "--model", "tiny", "--role", role, "--advertise", "127.0.0.1", "--registry",
                 "etcd://127.0.0.1:1", "--shutdown-timeout", "30"]) == 2
    err = capsys.readouterr().err
    assert "--shutdown-timeout" not in err, err
    assert "--secret-file" in err


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_networked_role_refuses_to_start_without_a_secret(capsys, role):
    """A host of a deployment over several hosts binds its schedulers and writers on the network:
    without --secret-file it refuses to start (nothing is started), naming --insecure."""
    from processes.cli import main

    assert main(["up", "--model", "tiny", "--role", role, "--advertise", "127.0.0.1",
                 "--registry", "etcd://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--secret-file" in err and "--insecure" in err
    # the file it says to make is one `pushkv up` takes: 0600 (a plain `openssl rand -hex 32 > FILE` made it 0644
    # under the usual umask 022, which the next start refused: "mode 0644, so every user of this host may read ...")
    assert "umask 077; openssl rand -hex 32 > FILE" in err


def test_insecure_role_gets_past_the_secret_check(capsys):
    """--insecure lets a networked role start without a secret: it gets as far as the registry,
    and says, before anything else can fail, that its sockets take unauthenticated peers."""
    from processes.cli import main

    assert main(["up", "--model", "tiny", "--role", "prefill", "--advertise", "127.0.0.1", "--insecure",
                 "--registry", "etcd://127.0.0.1:1"]) == 2  # no etcd there: refused at the registry, later
    err = capsys.readouterr().err
    assert "registry" in err and "--insecure to run" not in err
    assert "WARNING --insecure: prefill host without --secret-file" in err and "unauthenticated" in err
