"""The router on HTTPS, with vLLM's flags: ``--ssl-keyfile`` and ``--ssl-certfile`` serve it, ``--ssl-ca-certs`` with
``--ssl-cert-reqs 2`` requires a client certificate signed by those CAs; and files that do not load are refused before
anything starts, naming the flag; ``--enable-ssl-refresh`` serves a rotated certificate to the connections after. Certificates
are made for the test by the ``openssl`` command."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import time

import pytest

from tools.launch import launched

pytestmark = pytest.mark.timeout(240)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA; the router's key and certificate (localhost, 127.0.0.1) signed by it; a client's, signed by it; and a
    client's signed by nobody the router trusts."""
    d = tmp_path_factory.mktemp("tls")
    p = {n: str(d / n) for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem", "ext.cnf",
                                 "client.key", "client.csr", "client.pem", "rogue.key", "rogue.pem")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p["ca.key"], "-out", p["ca.pem"], "-days",
             "2", "-subj", "/CN=pushkv test CA")
    with open(p["ext.cnf"], "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for who in ("server", "client"):
        _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", p[f"{who}.key"], "-out", p[f"{who}.csr"],
                 "-subj", f"/CN={'localhost' if who == 'server' else 'client'}")
        _openssl("x509", "-req", "-in", p[f"{who}.csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
                 "-CAcreateserial", "-out", p[f"{who}.pem"], "-days", "2", *(("-extfile", p["ext.cnf"])
                                                                              if who == "server" else ()))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p["rogue.key"], "-out", p["rogue.pem"],
             "-days", "2", "-subj", "/CN=client")
    return p


def _complete(port: int, ctx: ssl.SSLContext) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _client(certs, cert: str = "") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    if cert:
        ctx.load_cert_chain(certs[f"{cert}.pem"], certs[f"{cert}.key"])
    return ctx


def test_the_router_serves_https_with_vllms_flags(certs, tmp_path):
    with launched("--mode", "push", "--num-blocks", "256", "--ssl-keyfile", certs["server.key"], "--ssl-certfile",
                  certs["server.pem"], log_path=str(tmp_path / "up.log")) as d:
        assert d.url.startswith("https://"), d.url
        status, body = _complete(d.port, _client(certs))
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 3, body
        # a client that does not trust the certificate, and one speaking plain HTTP, get nothing served
        with pytest.raises(ssl.SSLCertVerificationError):
            _complete(d.port, ssl.create_default_context())
        plain = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
        d.wait_pools_free()


def test_a_client_certificate_is_required_where_asked(certs, tmp_path):
    reg = str(tmp_path / "registry")
    with launched("--mode", "push", "--num-blocks", "256", "--ssl-keyfile", certs["server.key"], "--ssl-certfile",
                  certs["server.pem"], "--ssl-ca-certs", certs["ca.pem"], "--ssl-cert-reqs", "2",
                  log_path=str(tmp_path / "up.log"), registry=reg) as d:
        status, body = _complete(d.port, _client(certs, "client"))
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 3, body
        for ctx in (_client(certs), _client(certs, "rogue")):  # none, and one signed by nobody it trusts
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _complete(d.port, ctx)
        # pushkv status, which has no client certificate, reads the router's view through the run dir's socket
        out = subprocess.run([sys.executable, "-m", "processes.cli", "status", "--json"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PUSHKV_REGISTRY_DIR=reg))
        report = json.loads(out.stdout)
        assert report[0]["state"] == "running" and report[0]["instances"], report
        assert all("blocks_committed" in row for row in report[0]["instances"]), report[0]["instances"]
        d.wait_pools_free()


@pytest.mark.unit
def test_tls_files_that_do_not_load_are_refused_by_name(certs, tmp_path):
    from pushkv.config_flags import user_config

    missing = str(tmp_path / "missing.pem")
    cases = [
        ({"ssl_keyfile": certs["server.key"]}, "--ssl-keyfile and --ssl-certfile go together"),
        ({"ssl_keyfile": certs["server.key"], "ssl_certfile": missing}, f"--ssl-certfile {missing}"),
        ({"ssl_keyfile": certs["client.key"], "ssl_certfile": certs["server.pem"]}, "not a certificate chain and its"),
        ({"ssl_keyfile": certs["server.key"], "ssl_certfile": certs["server.pem"], "ssl_ca_certs": missing},
         f"--ssl-ca-certs {missing}"),
        ({"ssl_keyfile": certs["server.key"], "ssl_certfile": certs["server.pem"], "ssl_cert_reqs": 2},
         "checks client certificates against --ssl-ca-certs"),
        ({"ssl_ca_certs": certs["ca.pem"]}, "give --ssl-keyfile and --ssl-certfile too"),
    ]
    for flags, said in cases:
        with pytest.raises(ValueError, match=said.replace(".", r"\.").replace("(", r"\(")):
            user_config({"mode": "local", "device": "cpu", **flags})
    cfg = user_config({"mode": "local", "device": "cpu", "ssl_keyfile": os.path.relpath(certs["server.key"]),
                       "ssl_certfile": certs["server.pem"]})
    assert cfg.ssl_keyfile == certs["server.key"]  # made absolute: the processes start elsewhere


def _served_serial(port: int, ctx: ssl.SSLContext) -> int:
    """The serial number of the certificate a new connection is served."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls_sock:
            der = tls_sock.getpeercert(binary_form=True)
    out = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout", "-serial"], input=der, capture_output=True,
                         check=True, timeout=60)
    return int(out.stdout.decode().strip().split("=")[1], 16)


def _serial(pem: str) -> int:
    out = subprocess.run(["openssl", "x509", "-in", pem, "-noout", "-serial"], capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout.strip().split("=")[1], 16)


def test_a_rotated_certificate_is_served_to_new_connections_with_ssl_refresh(certs, tmp_path):
    """vLLM's --enable-ssl-refresh: the key and certificate replaced on disk (as cert-manager rotates them) are served
    to the connections after, with no restart; a half-written pair (a certificate without its key) is not taken, and
    the router serves on with the pair before."""
    live = {n: str(tmp_path / n) for n in ("live.key", "live.pem")}
    shutil.copy(certs["server.key"], live["live.key"])
    shutil.copy(certs["server.pem"], live["live.pem"])
    # the rotated pair: a new key and certificate for localhost, signed by the same CA
    new = {n: str(tmp_path / n) for n in ("new.key", "new.csr", "new.pem")}
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", new["new.key"], "-out", new["new.csr"],
             "-subj", "/CN=localhost")
    _openssl("x509", "-req", "-in", new["new.csr"], "-CA", certs["ca.pem"], "-CAkey", certs["ca.key"],
             "-CAcreateserial", "-out", new["new.pem"], "-days", "2", "-extfile", certs["ext.cnf"])
    first, rotated = _serial(certs["server.pem"]), _serial(new["new.pem"])
    assert first != rotated
    with launched("--mode", "local", "--num-blocks", "128", "--ssl-keyfile", live["live.key"], "--ssl-certfile",
                  live["live.pem"], "--enable-ssl-refresh", log_path=str(tmp_path / "up.log")) as d:
        ctx = _client(certs)
        assert _served_serial(d.port, ctx) == first
        # mid-rotation: the new certificate written before its key; it does not load, the old pair serves on
        tmp = live["live.pem"] + ".tmp"
        shutil.copy(new["new.pem"], tmp)
        os.replace(tmp, live["live.pem"])
        log = tmp_path / "up.log"
        deadline = time.monotonic() + 30
        while "do not load" not in log.read_text():
            assert time.monotonic() < deadline, "the router never looked at the changed files"
            time.sleep(0.05)
        assert _served_serial(d.port, ctx) == first and _complete(d.port, ctx)[0] == 200
        # then its key: the pair loads, and new connections get it
        shutil.copy(new["new.key"], tmp)
        os.replace(tmp, live["live.key"])
        deadline = time.monotonic() + 30
        while _served_serial(d.port, ctx) != rotated:
            assert time.monotonic() < deadline, "the rotated certificate was never served"
            time.sleep(0.05)
        status, body = _complete(d.port, ctx)
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 3, body
        d.wait_pools_free()


@pytest.mark.unit
def test_ssl_refresh_needs_the_certificate_files():
    from pushkv.config_flags import user_config

    with pytest.raises(ValueError, match="--enable-ssl-refresh"):
        user_config({"mode": "local", "device": "cpu", "enable_ssl_refresh": True})
