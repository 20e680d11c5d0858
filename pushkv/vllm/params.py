"""What a router puts in ``kv_transfer_params`` for pushkv's connector, and the
settings every side derives from vLLM's config. Pure: no vLLM import.

A router sends both legs at once, with one transfer id::

    P leg: {"pushkv": {"role": "prefill", "transfer_id": T}}           (max_tokens 1)
    D leg: {"pushkv": {"role": "decode", "transfer_id": T,
                       "source": {"engine_id": E, "tp": N, "handshake": [endpoint, ...]}}}

``source`` is P's identity. P returns it in every finished request's
``kv_transfer_params`` as ``{"pushkv_source": {...}}``, so a router learns it
from any P response (``pushkv vllm-proxy`` sends one probe request per P at
start). ``transfer_id`` must be unique among the transfers in flight between
that P and D; anything else in the params is ignored.

P's writers' handshake endpoints are, on one host (no ``handshake_host``), ``ipc://``
files in the connector's 0700 socket directory, so no other local user can reach a
Hello (NIXL metadata, KV base address); across hosts (``handshake_host`` set)
``tcp://host:port+rank`` under CURVE, which needs the deployment's secret file.
"""
from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from pushkv import envs
from pushkv.messages import PrefillSource

KEY = "pushkv"
SOURCE_KEY = "pushkv_source"
ROLE_KEY = "pushkv_kv_role"  # beside it: the instance's kv_role, which a router checks at start
DEFAULT_HANDSHAKE_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
# a socket file this old that no process listens on is a dead run's (zmq binds and listens in one call)
DEAD_SOCKET_S = 10.0
# Who allocates a GPU KV cache: "writer" (the writer allocates it and registers its own allocation
# with NIXL; vLLM's tensors are views of it, opened by CUDA IPC) or "vllm" (vLLM allocates it and
# the writer registers the CUDA IPC import, which NIXL/UCX moves at ~0.5 GiB/s: a fallback)
CudaMemory = Literal["writer", "vllm"]
CUDA_MEMORY: tuple[CudaMemory, ...] = ("writer", "vllm")


class ParamsError(ValueError):
    pass


@dataclass(frozen=True)
class Leg:
    role: Literal["prefill", "decode"]
    transfer_id: str
    source: Optional[PrefillSource] = None


def parse_leg(params: Optional[dict[str, Any]]) -> Optional[Leg]:
    """The pushkv part of a request's kv_transfer_params, or None if it has none."""
    if not params or KEY not in params:
        return None
    p = params[KEY]
    if not isinstance(p, dict):
        raise ParamsError(f"kv_transfer_params[{KEY!r}] must be an object, got {type(p).__name__}")
    role, tid = p.get("role"), p.get("transfer_id")
    if role not in ("prefill", "decode"):
        raise ParamsError(f"kv_transfer_params[{KEY!r}]['role'] must be 'prefill' or 'decode', got {role!r}")
    if not isinstance(tid, str) or not tid:
        raise ParamsError(f"kv_transfer_params[{KEY!r}]['transfer_id'] must be a non-empty string")
    if role == "prefill":
        return Leg(role, tid)
    return Leg(role, tid, parse_source(p.get("source")))


def parse_source(s: Any) -> PrefillSource:
    if not isinstance(s, dict):
        raise ParamsError("a decode leg needs 'source': {engine_id, tp, handshake} (P's pushkv_source)")
    eid, tp, hs = s.get("engine_id"), s.get("tp"), s.get("handshake")
    if not isinstance(eid, str) or not isinstance(tp, int) or tp < 1:
        raise ParamsError(f"bad source {s!r}: engine_id must be a string and tp a positive int")
    if not isinstance(hs, list) or len(hs) != tp or not all(isinstance(e, str) for e in hs):
        raise ParamsError(f"bad source {s!r}: handshake must list one endpoint per P rank")
    return PrefillSource(eid, tp, tuple(hs))


# the legs an instance of each kv_role serves: vLLM treats a producer and a consumer apart (a consumer
# defers freeing blocks an in-flight step may still write, before a load fills them; a producer's
# preempted request drops a pending hand-off), so a leg on the other role's instance is refused
LEGS_OF_ROLE = {"kv_producer": ("prefill",), "kv_consumer": ("decode",), "kv_both": ("prefill", "decode")}


def leg_refused(leg_role: str, kv_role: str) -> str:
    """Why an instance of ``kv_role`` does not serve a ``leg_role`` leg ("" if it does)."""
    if leg_role in LEGS_OF_ROLE.get(kv_role, ("prefill", "decode")):
        return ""
    return (f"a {leg_role} leg sent to a {kv_role} instance (it serves {' and '.join(LEGS_OF_ROLE[kv_role])} "
            "legs): the router has P and D the wrong way round")


def source_dict(src: PrefillSource) -> dict[str, Any]:
    return {"engine_id": src.engine_id, "tp": src.tp, "handshake": list(src.handshake)}


@dataclass(frozen=True)
class Settings:
    engine_id: str
    tp: int
    handshake_host: str  # "" = one host: ipc:// in socket_dir(); else tcp:// on it, under CURVE
    handshake_port: int  # rank r listens on port + r (tcp only)
    registration_wait_s: float
    transfer_s: float
    idle_wait_ms: float
    secret_file: str = ""  # CURVE on the tcp handshake sockets (pushkv/security.py); "" = none
    stream_groups: int = 0  # layer streaming: P WRITEs this many layer groups as each is stored; 0: off
    cuda_memory: CudaMemory = "writer"  # who allocates a GPU KV cache (CUDA_MEMORY); the CPU: always a memfd

    def handshake_endpoint(self, rank: int) -> str:
        if not self.handshake_host:
            return f"ipc://{socket_dir()}/{self.engine_id}-{rank}-hs"
        return f"tcp://{self.handshake_host}:{self.handshake_port + rank}"

    def cmd_endpoint(self, rank: int) -> str:
        return f"ipc://{socket_dir()}/{self.engine_id}-{rank}-cmd"

    def event_endpoint(self, rank: int, pid: int) -> str:
        return f"ipc://{socket_dir()}/{self.engine_id}-{rank}-ev-{pid}"

    def source(self) -> PrefillSource:
        return PrefillSource(self.engine_id, self.tp, tuple(self.handshake_endpoint(r) for r in range(self.tp)))


def socket_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the connector's ipc sockets live: a directory only this user can enter (an
    abstract-namespace socket has no permissions, so any local process could command a writer).
    $XDG_RUNTIME_DIR/pushkv-vllm, else /tmp/pushkv-vllm-$UID; made 0700, refused if another user
    owns it or others can enter it."""
    runtime: str = envs.get("XDG_RUNTIME_DIR", environ)
    fallback = f"/tmp/pushkv-vllm-{os.getuid()}"
    d = os.path.join(runtime, "pushkv-vllm") if runtime and os.path.isdir(runtime) else fallback
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d}: the connector's socket directory must be this user's and 0700")
    return d


def remove_socket_files(*endpoints: str) -> None:
    """Remove the files of ``ipc://`` endpoints we bound: zmq (4.3.5) leaves an ipc socket's file
    when it closes the socket, and a killed process removes nothing."""
    for ep in endpoints:
        if ep.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(ep[len("ipc://"):])


def remove_dead_sockets(d: str) -> list[str]:
    """Remove the socket files in the connector's directory ``d`` that no process listens on
    any more, and say which: an instance that vLLM stopped by its default shutdown (which
    SIGKILLs the engine's process tree at once, ``--shutdown-timeout 0``) removed none of its
    own. A file a live process listens on is left, and so is one younger than DEAD_SOCKET_S."""
    removed = []
    for name in os.listdir(d):
        path = os.path.join(d, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or time.time() - st.st_mtime < DEAD_SOCKET_S or _listened(path):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    return removed


def endpoints_in_use(*endpoints: str) -> list[str]:
    """The ``ipc://`` endpoints among these that a live process listens on. zmq binds over such a
    file without a word (it unlinks it), so a second instance of one engine id would take the
    first's sockets; the worker refuses to start instead."""
    return [ep for ep in endpoints if ep.startswith("ipc://") and os.path.exists(ep[len("ipc://"):])
            and _listened(ep[len("ipc://"):])]


def _listened(path: str) -> bool:
    """Whether a process listens on the unix socket file ``path`` (refused: none does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # its backlog full (alive), or what cannot be told: left alone
            return True
    return True


def settings(engine_id: str, tp: int, extra: Optional[dict[str, Any]],
             env: Optional[Mapping[str, str]] = None) -> Settings:
    """From kv_connector_extra_config, falling back on vLLM's NIXL side-channel variables.
    A tcp handshake (a ``handshake_host``, for peers on other hosts) without a secret is
    refused: anyone who reaches the port would get the Hello, loopback included."""
    extra = extra or {}
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"pushkv's connector: unknown key(s) {unknown} in kv_connector_extra_config "
                         f"(it takes {list(EXTRA_KEYS)})")
    host = str(extra.get("handshake_host") or envs.get("VLLM_NIXL_SIDE_CHANNEL_HOST", env) or "")
    port = _number("handshake_port", extra.get("handshake_port") or envs.get("VLLM_NIXL_SIDE_CHANNEL_PORT", env)
                   or DEFAULT_HANDSHAKE_PORT, int, 1, 65536 - tp)
    secret_file = str(extra.get("secret_file") or envs.get("PUSHKV_SECRET_FILE", env) or "")
    if host and not secret_file:
        raise ValueError(f"pushkv's connector: a handshake on tcp://{host} (handshake_host or "
                         "VLLM_NIXL_SIDE_CHANNEL_HOST) needs a secret for CURVE: set secret_file in "
                         "kv_connector_extra_config or PUSHKV_SECRET_FILE (one host: leave the host unset, "
                         "the handshake is then an ipc:// socket only this user can reach)")
    return Settings(engine_id, tp, host, port,
                    _number("registration_wait_s", extra.get("registration_wait_s", 30.0), float, 1e-3),
                    _number("transfer_s", extra.get("transfer_s", 30.0), float, 1e-3),
                    _number("idle_wait_ms", extra.get("idle_wait_ms", 10.0), float, 0.0), secret_file,
                    _number("stream_groups", extra.get("stream_groups", 0), int, 0),
                    parse_cuda_memory(extra.get("cuda_memory", "writer")))


# kv_connector_extra_config's keys (the connector's README lists them); any other is refused, so
# that a misspelt one ("stream_group") is not dropped without a word
EXTRA_KEYS = ("handshake_host", "handshake_port", "secret_file", "registration_wait_s", "transfer_s", "idle_wait_ms",
              "stream_groups", "cuda_memory")


def _number(key: str, value: Any, kind: type, low: float, high: float = float("inf")):
    """kv_connector_extra_config's ``key`` as ``kind`` in [low, high], or refused naming the key."""
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        n = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"pushkv's connector: {key} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {value!r}") from None
    if not low <= n <= high:
        bound = f"from {low:g} to {high:g}" if high != float("inf") else f"at least {low:g}"
        raise ValueError(f"pushkv's connector: {key} must be {bound}, got {value!r}")
    return n


def parse_cuda_memory(value: Any) -> CudaMemory:
    """kv_connector_extra_config's ``cuda_memory``, refused with the choices when unknown."""
    for choice in CUDA_MEMORY:
        if value == choice:
            return choice
    raise ValueError(f"pushkv's connector: cuda_memory must be one of {list(CUDA_MEMORY)}, got {value!r} "
                     "(writer: the writer allocates the GPU KV cache and vLLM maps it, the fast path; "
                     "vllm: vLLM allocates it and hands it to the writer by CUDA IPC)")
