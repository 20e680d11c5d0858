"""The router on HTTPS, with vLLM's flags: ``--ssl-keyfile`` and ``--ssl-certfile`` serve it, ``--ssl-ca-certs`` with
``--ssl-cert-reqs 2`` requires a client certificate signed by those CAs; and files that do not load are refused before
anything starts, naming the flag. Certificates are made for the test by the ``openssl`` command."""
from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess

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
    with launched("--mode", "local", "--num-blocks", "256", "--ssl-keyfile", certs["server.key"], "--ssl-certfile",
                  certs["server.pem"], "--ssl-ca-certs", certs["ca.pem"], "--ssl-cert-reqs", "2",
                  log_path=str(tmp_path / "up.log")) as d:
        status, body = _complete(d.port, _client(certs, "client"))
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 3, body
        for ctx in (_client(certs), _client(certs, "rogue")):  # none, and one signed by nobody it trusts
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _complete(d.port, ctx)
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
