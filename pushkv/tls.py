"""The router's HTTPS, as vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and ``--ssl-cert-reqs`` set
it up: a server context with the deployment's key and certificate chain, checking client certificates against its CA
certificates where asked. Built once when the flags are read, so a missing or mismatched file is refused before any
process starts, and again by the router. With ``--enable-ssl-refresh`` the router takes the files again when they
change (``Refresher``): the connections after use the new certificate, those open keep theirs."""
from __future__ import annotations

import logging
import os
import ssl
import tempfile
from typing import Optional

from pushkv import uds
from pushkv.config import DeploymentConfig

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how often the router looks at the certificate files (--enable-ssl-refresh)


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


class Refresher:
    """``--enable-ssl-refresh``, as vLLM's: the key, certificate and CA files looked at every ``REFRESH_S``; when any
    of them changed (its inode, size or time), the router's context loads them again, so new connections get the
    rotated certificate. A set that does not load (a key written before its certificate, mid-rotation) leaves the
    context as it was, is said once, and is tried again when the files next change. CA certificates are added to the
    ones trusted (OpenSSL does not forget one), as vLLM's refresh does."""

    def __init__(self, cfg: DeploymentConfig, ctx: ssl.SSLContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.files = [f for f in (cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) if f]
        self.seen = self._stamp()
        self.reloads = 0

    def _stamp(self) -> tuple:
        out: list[Optional[tuple[int, int, int]]] = []
        for path in self.files:
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def check(self) -> bool:
        """Load the files again if they changed since last looked at; whether the context took them. The files are
        read once, into a private directory, and loaded there into a scratch context first: a set that does not load
        never reaches the router's context (OpenSSL would leave it holding a certificate without its key)."""
        now = self._stamp()
        if now == self.seen:
            return False
        self.seen = now
        with tempfile.TemporaryDirectory(prefix="pushkv-tls-") as tmp:  # 0700
            try:
                copies: list[str] = []
                for path in self.files:
                    copy = os.path.join(tmp, str(len(copies)))
                    with open(path, "rb") as src, open(os.open(copy, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as dst:
                        dst.write(src.read())
                    copies.append(copy)
                cert, key = copies[0], copies[1] if self.cfg.ssl_keyfile else None
                ca = copies[-1] if self.cfg.ssl_ca_certs else None
                scratch = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                scratch.load_cert_chain(cert, key)
                if ca:
                    scratch.load_verify_locations(cafile=ca)
            except (OSError, ssl.SSLError) as e:
                log.warning("--enable-ssl-refresh: the changed certificate files do not load (%s); serving with the "
                            "ones before until they change again", e)
                return False
            self.ctx.load_cert_chain(cert, key)
            if ca:
                self.ctx.load_verify_locations(cafile=ca)
        self.reloads += 1
        log.info("--enable-ssl-refresh: took the changed certificate files (%s)", ", ".join(self.files))
        return True
