"""The router's HTTPS, as vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and ``--ssl-cert-reqs`` set
it up: a server context with the deployment's key and certificate chain, checking client certificates against its CA
certificates where asked. Built once when the flags are read, so a missing or mismatched file is refused before any
process starts, and again by the router."""
from __future__ import annotations

import ssl
from typing import Optional

from pushkv import uds
from pushkv.config import DeploymentConfig


def server_context(cfg: DeploymentConfig) -> Optional[ssl.SSLContext]:
    """The router's TLS context, or None where it serves plain HTTP. ValueError naming the flag and the file for a
    key, certificate or CA file that does not load."""
    if not cfg.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {cfg.ssl_certfile} / --ssl-keyfile {cfg.ssl_keyfile}: not a certificate "
                         f"chain and its key: {e}") from None
    if cfg.ssl_ca_certs:
        try:
            ctx.load_verify_locations(cafile=cfg.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {cfg.ssl_ca_certs}: not CA certificates: {e}") from None
    ctx.verify_mode = ssl.VerifyMode(cfg.ssl_cert_reqs)
    return ctx


def scheme(cfg: DeploymentConfig) -> str:
    """The router's URL scheme."""
    return "https" if cfg.ssl_certfile else "http"


def router_url(cfg: DeploymentConfig, port: int) -> str:
    """The router's URL: its Unix socket's (``--uds``, ``pushkv/uds.py``), else ``scheme://host:port``."""
    return uds.url(cfg.uds) if cfg.uds else f"{scheme(cfg)}://{cfg.host}:{port}"
