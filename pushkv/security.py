"""CURVE on every ZMQ socket that listens on or dials a network address.

The operator gives every host one secret (a file: a mounted Kubernetes secret, or one
made with ``openssl rand -hex 32``). From it each process derives, deterministically,

- the **server** key pair, which every socket that binds a network endpoint uses, and
- the **client** key pair, which every socket that connects to one uses,

with scrypt (the work factor: a guess at a weak secret costs ~0.1 s and 32 MiB), then
HKDF-SHA256 (RFC 5869) and ``zmq.curve_public``. So every holder of the secret can
be a server or a client, and nobody else can: a peer without the secret cannot complete
the CURVE handshake (it does not know the server's public key, so the server cannot
open its HELLO), and one that learnt the server's public key still has no allowed client
key, which the process's ZAP handler refuses.

``ipc://`` and ``inproc://`` endpoints stay as they are (same host, guarded by file
permissions); everything else (``tcp://``, ...) is a network endpoint.

One ``CurveGuard`` thread per zmq context answers ZAP requests and watches a monitor
of every secured bound socket, so each refused peer (not CURVE at all, wrong key, key
not allowed) is logged and counted in the counters of the process that owns the socket
(``curve_refused`` and ``curve_refused_<why>``). The guard owns only its own sockets, so
it works beside zmq.asyncio sockets and any loop: it is the context, not the caller's
thread, that talks to it.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import queue
import threading
from collections import Counter
from typing import Optional

import msgspec
import zmq
from zmq.utils import z85

from pushkv import envs
from pushkv.floods import worth_logging

log = logging.getLogger(__name__)

API_KEY_ENV = "PUSHKV_API_KEY"  # the router's HTTP API key (router/auth.py), as vLLM's VLLM_API_KEY
MIN_SECRET_BYTES = 16  # after stripping surrounding whitespace
KDF_SALT = b"pushkv-curve-v1"
# The work factor before HKDF (``PUSHKV_KDF=scrypt``, the default): scrypt N=2^15, r=8, p=1 (32 MiB,
# ~0.1 s once per process). Its own salt, so the two derivations never share a key. The salt is
# fixed because every host must derive the same keys with nothing exchanged first. "hkdf" is the
# derivation before it (HKDF alone), for a deployment whose hosts do not all run this version yet.
SCRYPT_SALT = b"pushkv-curve-scrypt-v2"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
SCRYPT_MAXMEM = 64 * 2**20  # 128 * r * N = 32 MiB, above hashlib's default cap of exactly that
KDFS = ("scrypt", "hkdf")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ZAP_VERSION = b"1.0"
ZAP_DOMAIN = b"pushkv"
GUARD_START_S = 5.0  # the guard thread binds ZAP within this, or secure_bind fails

# what a refused peer counts as: counter suffix, and the log's words
REFUSALS = {
    "no_curve": "not CURVE (mechanism mismatch): a peer without the secret",
    "bad_key": "CURVE with another server key: a peer without the secret",
    "not_allowed": "CURVE client key not allowed",
    "handshake": "handshake failed (the peer hung up mid-handshake, e.g. it speaks no CURVE)",
}
COUNTERS = ("curve_accepted", "curve_refused", *(f"curve_refused_{k}" for k in REFUSALS))
MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_MONITOR_STOPPED)


class CurveKeys(msgspec.Struct, frozen=True):
    """Z85-encoded CURVE keys (40 bytes each), as zmq's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 extract-then-expand."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def stretch(secret: bytes) -> bytes:
    """The work factor: 32 bytes of scrypt over the secret."""
    return hashlib.scrypt(secret, salt=SCRYPT_SALT, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          maxmem=SCRYPT_MAXMEM, dklen=32)


def derive_keys(secret: bytes, kdf: str = "") -> CurveKeys:
    """The deployment's two key pairs from the shared secret (pure, deterministic). ``kdf``:
    "scrypt" (scrypt, then HKDF) or "hkdf" (HKDF alone, the keys before the work factor);
    "" = ``PUSHKV_KDF``."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"CURVE secret too short: {len(secret)} bytes, need at least {MIN_SECRET_BYTES}")
    kdf = kdf or envs.get("PUSHKV_KDF")
    if kdf not in KDFS:
        raise ValueError(f"PUSHKV_KDF={kdf!r}: one of {', '.join(KDFS)}")
    return _derive(secret, kdf)


@functools.lru_cache(maxsize=8)  # scrypt once per process (and per test secret), not per socket
def _derive(secret: bytes, kdf: str) -> CurveKeys:
    ikm = stretch(secret) if kdf == "scrypt" else secret
    server_secret = z85.encode(hkdf_sha256(ikm, KDF_SALT, b"server"))
    client_secret = z85.encode(hkdf_sha256(ikm, KDF_SALT, b"client"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret,
                     zmq.curve_public(client_secret), client_secret)


def load_secret(path: str) -> bytes:
    """The secret file's bytes without surrounding whitespace (a trailing newline from
    ``echo`` or an editor must not make two hosts disagree)."""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path}: CURVE secret too short ({len(secret)} bytes, need at least "
                         f"{MIN_SECRET_BYTES}; make one: umask 077; openssl rand -hex 32 > {path})")
    try:
        if os.stat(path).st_mode & 0o077:
            log.warning("%s: the CURVE secret is readable by group or others", path)
    except OSError:
        pass
    return secret


def check_secret_file(path: str) -> None:
    """``pushkv up``'s check of ``--secret-file`` before anything starts: ValueError naming the flag and the fix
    for a file that cannot be read, is too short, or that every user of this host may read or write (as ssh refuses
    such a key: any of them could derive the CURVE keys, or swap the secret). Readable by the group: a warning."""
    try:
        load_secret(path)
        mode = os.stat(path).st_mode & 0o777
    except OSError as e:
        raise ValueError(f"--secret-file {path}: {e.strerror}; make one, the same file on every host: "
                         f"umask 077; openssl rand -hex 32 > {path}") from None
    if mode & 0o007:
        raise ValueError(f"--secret-file {path}: mode {mode:04o}, so every user of this host may read or write the "
                         f"CURVE secret; chmod 600 {path} (and on every host)")


def bearer_ok(authorization: str, key: str) -> bool:
    """Whether an HTTP ``Authorization`` header carries ``Bearer <key>`` (constant-time compare)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def is_network(endpoint: str) -> bool:
    return not endpoint.startswith(("ipc://", "inproc://"))


class Security:
    """One process's keys, plus where its refusals are counted (the process's counters)."""

    def __init__(self, keys: CurveKeys, counters: Optional[Counter] = None):
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support")
        self.keys = keys
        self.counters = counters if counters is not None else Counter()
        for name in COUNTERS:  # present from the start: the guard thread never adds a key
            self.counters[name] += 0

    @classmethod
    def from_file(cls, path: str, counters: Optional[Counter] = None) -> "Security":
        return cls(derive_keys(load_secret(path)), counters)


def load(secret_file: str, counters: Optional[Counter] = None) -> Optional[Security]:
    """``Security`` for a configured secret file, None when there is none (nothing changes)."""
    return Security.from_file(secret_file, counters) if secret_file else None


def secure_bind(sock: zmq.Socket, endpoint: str, security: Optional[Security]) -> None:
    """``sock.bind(endpoint)``; a network endpoint with a secret becomes a CURVE server
    whose peers the context's guard authenticates, refuses and counts."""
    if security is not None and is_network(endpoint):
        k = security.keys
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, k.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, k.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        CurveGuard.of(sock.context, k.client_public).watch(sock, security.counters)
    sock.bind(endpoint)


def secure_connect(sock: zmq.Socket, endpoint: str, security: Optional[Security]) -> None:
    """``sock.connect(endpoint)``; a network endpoint with a secret is dialled as a CURVE client."""
    if security is not None and is_network(endpoint):
        k = security.keys
        sock.setsockopt(zmq.CURVE_SERVERKEY, k.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, k.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, k.client_secret)
    sock.connect(endpoint)


def _refusal(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "not_allowed"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "no_curve"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "bad_key"
    return "handshake"


class CurveGuard:
    """The ZAP handler and handshake monitor of one zmq context, on its own thread."""

    _guards: dict[int, "CurveGuard"] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, ctx: zmq.Context, client_public: bytes) -> "CurveGuard":
        key = ctx.underlying  # a zmq.asyncio context and its sync shadow share one guard
        with cls._lock:
            guard = cls._guards.get(key)
            if guard is None or guard.closed:
                guard = cls._guards[key] = cls(ctx, client_public)
            elif guard.client_public != client_public:
                raise ValueError("one zmq context cannot serve two CURVE secrets")
            return guard

    def __init__(self, ctx: zmq.Context, client_public: bytes):
        self.key = ctx.underlying
        self.closed = False
        self.client_public = client_public
        self._client_raw = z85.decode(client_public)
        self.ctx: zmq.Context = zmq.Context.shadow(ctx.underlying)  # plain sockets, whatever ctx's flavour
        self._new: queue.SimpleQueue = queue.SimpleQueue()  # (monitor PAIR, counters, endpoint)
        self._wake_r, self._wake_w = os.pipe()
        self._n = 0
        self._zap_denied = 0
        started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(started,), name="pushkv-curve-guard", daemon=True)
        self.thread.start()
        if not started.wait(GUARD_START_S):
            raise RuntimeError("CURVE guard did not start")
        if self._start_error is not None:
            raise RuntimeError(f"CURVE guard: cannot bind {ZAP_ENDPOINT}: {self._start_error}")

    def watch(self, sock: zmq.Socket, counters: Counter) -> None:
        """Monitor ``sock``'s handshakes (call before it binds, so no event is missed)."""
        with CurveGuard._lock:  # against the thread's exit: a pair handed over is always closed
            if self.closed:
                raise zmq.ContextTerminated()
            self._n += 1
            addr = f"inproc://pushkv-curve-monitor-{os.getpid()}-{id(self)}-{self._n}"
            sock.monitor(addr, MONITOR_EVENTS)
            pair = self.ctx.socket(zmq.PAIR)  # connected here, then owned by the guard thread
            pair.setsockopt(zmq.LINGER, 0)
            pair.connect(addr)
            self._new.put((pair, counters, addr))
            os.write(self._wake_w, b"x")

    # -- the thread ---------------------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        zap = self.ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._start_error = e
            zap.close(0)
            started.set()
            return
        started.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        monitors: dict[zmq.Socket, Counter] = {}
        try:
            while True:
                for s, _ in poller.poll():
                    if s is zap:
                        self._answer(zap)
                    elif s == self._wake_r:
                        os.read(self._wake_r, 4096)
                        while not self._new.empty():
                            pair, counters, _addr = self._new.get()
                            monitors[pair] = counters
                            poller.register(pair, zmq.POLLIN)
                    elif s in monitors:
                        if not self._on_monitor(s, monitors[s]):
                            poller.unregister(s)
                            monitors.pop(s)
                            s.close(0)
        except zmq.ContextTerminated:
            pass
        finally:
            # forgotten before the sockets close, so before the context's term() can return and a
            # new context reuse its address
            with CurveGuard._lock:
                self.closed = True
                if CurveGuard._guards.get(self.key) is self:
                    del CurveGuard._guards[self.key]
            while not self._new.empty():
                monitors[self._new.get()[0]] = Counter()
            for s in (zap, *monitors):
                s.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _answer(self, zap: zmq.Socket) -> None:
        frames = zap.recv_multipart()
        if len(frames) < 6:
            log.error("malformed ZAP request (%d frames)", len(frames))
            zap.send_multipart([ZAP_VERSION, frames[1] if len(frames) > 1 else b"", b"400", b"malformed", b"", b""])
            return
        _version, request_id, domain, address, _identity, mechanism = frames[:6]
        if mechanism == b"NULL":  # an ipc/inproc socket of this context without CURVE
            ok, why = True, b"OK"
        elif mechanism == b"CURVE" and len(frames) == 7 and hmac.compare_digest(frames[6], self._client_raw):
            ok, why = True, b"OK"
        else:
            ok, why = False, b"not an allowed key"
            self._zap_denied += 1
            if worth_logging(self._zap_denied):
                key = z85.encode(frames[6]).decode() if mechanism == b"CURVE" and len(frames) == 7 else "-"
                log.warning("refused %s peer %s on ZAP domain %s: key %s not allowed (ZAP refusals: %d)",
                            mechanism.decode(errors="replace"), address.decode(errors="replace"),
                            domain.decode(errors="replace"), key, self._zap_denied)
        zap.send_multipart([ZAP_VERSION, request_id, b"200" if ok else b"400", why, b"pushkv" if ok else b"", b""])

    def _on_monitor(self, pair: zmq.Socket, counters: Counter) -> bool:
        """Count one handshake event; False when the monitored socket is gone."""
        frames = pair.recv_multipart()
        event = int.from_bytes(frames[0][:2], "little")
        value = int.from_bytes(frames[0][2:6], "little")
        endpoint = frames[1].decode(errors="replace") if len(frames) > 1 else "?"
        if event == zmq.EVENT_MONITOR_STOPPED:
            return False
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            counters["curve_accepted"] += 1
            return True
        why = _refusal(event, value)
        counters["curve_refused"] += 1
        counters[f"curve_refused_{why}"] += 1
        if worth_logging(counters["curve_refused"]):
            log.warning("refused a peer on %s: %s (event 0x%x, value 0x%x; refused so far: %d)",
                        endpoint, REFUSALS[why], event, value, counters["curve_refused"])
        return True
