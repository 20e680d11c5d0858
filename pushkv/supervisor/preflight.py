"""Checks before anything starts: the mistakes that would otherwise surface only after every
model has loaded (a taken port, found when the router binds) or deep inside a child (torch's
error from a writer on a host without a GPU, a raw ImportError from NIXL).

The KV pools' sizing (``kv_sizing``: a model that does not fit its GPUs) runs here too, once the
port and GPU checks passed, so it is not kept waiting for NIXL either.

Each check returns the problems it found, each naming the flag and the fix; ``pushkv up`` prints
them and exits 2 before any process starts. They are cheap: binding a socket, loading the CUDA
driver library and asking it for devices (no torch), and one child interpreter importing NIXL
(started first, so it overlaps the rest; importing NIXL imports torch, seconds when cold). A NIXL
that imported is remembered in the user's cache directory under a fingerprint of this
interpreter and the files NIXL and torch load from (paths and times, read without importing them),
so a later ``pushkv up`` over the same install does not pay that import again; any change of the
install is a new fingerprint, checked afresh.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import stat
import subprocess
import sys
from typing import Callable, Optional

from pushkv import envs
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.cuda_driver import device_count as cuda_device_count
from pushkv.protocol import kv_events
from pushkv.supervisor.plan import fixed_ports, instances_here

NIXL_IMPORT = "nixl._api"  # what pushkv.transport.nixl_agent imports
NIXL_TIMEOUT_S = 120.0  # a cold torch import on a loaded host; only a hung import waits this long


def port_problems(cfg: DeploymentConfig) -> list[str]:
    """Every port the user fixed that something on this host holds already."""
    out = []
    for flag, port in fixed_ports(cfg):
        # the KV events bind every interface (tcp://*:PORT) or the one they name
        host = {"--port": cfg.host, "--kv-events-config": "0.0.0.0"}.get(flag) or cfg.metrics_host()
        err = _bind_error(host, port)
        if err:
            out.append(f"{flag} {port}: {host}:{port} is taken ({err}); give {flag} a free port, or stop what "
                       f"listens there (ss -ltnp 'sport = :{port}' shows it)")
    return out


def ipc_problems(cfg: DeploymentConfig) -> list[str]:
    """Every ipc:// socket this host binds at a path the user gave (--trace's taps' end, each instance's KV events)
    whose path is taken: ZeroMQ's ipc bind removes
    what is there first, so a second deployment given the same --kv-events-config took the first one's sockets over
    without a word (its consumers then read the other deployment's events), and a file there that is no socket would
    be deleted. A socket nobody listens on (a crash's leftover) is replaced, as ZeroMQ does."""
    out = []
    tap = cfg.trace_tap_endpoint  # --trace ipc://PATH: the supervisor binds the taps' end there
    if tap.startswith("ipc://") and (why := _ipc_taken(tap[len("ipc://"):])):
        out.append(f"--trace {tap}: {tap[len('ipc://'):]} {why}; binding it would take it over: give each deployment "
                   "a path of its own")
    ev = cfg.kv_events
    if not ev.on or cfg.host_role == "router":
        return out
    for name, given in (("endpoint", ev.endpoint), ("replay_endpoint", ev.replay_endpoint)):
        if not given or not given.startswith("ipc://"):
            continue
        for i in range(instances_here(cfg)):
            path = (kv_events.endpoint_for(given, i) or given)[len("ipc://"):]
            why = _ipc_taken(path)
            if why:
                out.append(f"--kv-events-config {name} {given}: {path} {why}; binding it would take it over: give "
                           "each deployment a path of its own")
    return out


def _ipc_taken(path: str) -> str:
    """Why a ZeroMQ ipc bind at ``path`` would take something over ("" where nothing is there, or a dead socket)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if not stat.S_ISSOCK(st.st_mode):
        return "exists and is no socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return ""  # nobody listens: a leftover
    return "is a socket another process listens on (another deployment's?)"


def _bind_error(host: str, port: int) -> str:
    """"" if a server could bind host:port now (as it will, with SO_REUSEADDR: TIME_WAIT is no conflict)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return ""


def _device_flag(cfg: DeploymentConfig, inst: InstanceConfig) -> str:
    """The flag that put ``inst`` on its device, as the user would look for it."""
    if cfg.mode == "local" or cfg.prefill.device == cfg.decode.device:
        return "--device"
    return f"--{inst.role}-device"


def gpu_problems(cfg: DeploymentConfig, count_gpus=cuda_device_count) -> list[str]:
    """Every planned instance on CUDA whose GPUs (cuda:N .. N+tp-1) this host does not have."""
    cuda = [i for i in cfg.instances() if i.device.startswith("cuda")]
    if not cuda:
        return []
    count, why = count_gpus()
    out = []
    for inst in cuda:
        first = int(inst.device.split(":")[1]) if ":" in inst.device else 0
        flag = _device_flag(cfg, inst)
        if count == 0:
            out.append(f"{flag} {inst.device} ({inst.name}): {why}; use {flag} cpu, or run where a GPU is "
                       "visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            break  # one line says it for every instance
        if first + inst.tp > count:
            out.append(f"{flag} {inst.device} ({inst.name}, tp {inst.tp}) needs GPUs {first}..{first + inst.tp - 1}; "
                       f"{count} visible (0..{count - 1}): give {flag} a lower index, fewer instances or a "
                       "smaller tp")
    return out


def start_nixl_check() -> subprocess.Popen:
    """Import NIXL in a child interpreter (the supervisor stays free of torch); ``nixl_problems`` reads it."""
    return subprocess.Popen([sys.executable, "-c", f"import {NIXL_IMPORT}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def nixl_problems(proc: subprocess.Popen, timeout_s: float = NIXL_TIMEOUT_S) -> list[str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return [f"NIXL: `import {NIXL_IMPORT}` did not finish in {timeout_s:.0f} s"]
    if proc.returncode == 0:
        return []
    last = next((line for line in reversed(err.strip().splitlines()) if line.strip()), "no error text")
    return [f"NIXL does not import ({last}): every writer registers its KV pool with NIXL; install it into "
            f"this environment ({sys.executable} -m pip install nixl), with the UCX it needs, and check with "
            f"`{sys.executable} -c 'import {NIXL_IMPORT}'`"]


NIXL_PACKAGES = ("nixl", "nixl_cu12", "nixl_cu13", "torch")  # what `import nixl._api` loads


def nixl_fingerprint() -> Optional[str]:
    """What a passed NIXL check stands for: this interpreter and where NIXL's packages (and torch)
    would load from, with their files' times, found without importing them; None when no ``nixl``
    package is found at all."""
    parts = [sys.executable]
    for name in NIXL_PACKAGES:
        spec = importlib.util.find_spec(name)  # top-level names: nothing is imported
        if spec is None:
            if name == "nixl":
                return None
            continue
        where = spec.origin or next(iter(spec.submodule_search_locations or []), "")
        try:
            stamp = os.stat(where).st_mtime_ns
        except OSError:
            stamp = 0
        parts.append(f"{name}={where}@{stamp}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_dir() -> str:
    """Where pushkv remembers what it verified about this machine: $XDG_CACHE_HOME/pushkv, else
    ~/.cache/pushkv (a mark there only spares a check; a planted one spares nothing worse)."""
    base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pushkv")


def _verified_mark(fingerprint: Optional[str]) -> Optional[str]:
    """The file that says NIXL imported for ``fingerprint`` (None: nothing to remember)."""
    if fingerprint is None:
        return None
    return os.path.join(cache_dir(), f"nixl-imports-{fingerprint}")


def preflight(cfg: DeploymentConfig, writers: bool = True,
              then: Optional[Callable[[], list[str]]] = None) -> list[str]:
    """The problems of the planned ``cfg`` found before anything starts ([] = go). A port or GPU
    problem is answered at once, without waiting for NIXL's import, and so are ``then``'s (a check
    that needs the GPUs there: the pools' sizing), run once those passed. ``writers``: pushkv's own
    writers will run here (not on a router host, nor under a caller's own children), so NIXL must
    import."""
    mark = _verified_mark(nixl_fingerprint()) if writers and cfg.host_role != "router" else None
    known_good = mark is not None and os.path.exists(mark)
    nixl = start_nixl_check() if writers and cfg.host_role != "router" and not known_good else None
    try:
        problems = port_problems(cfg) + ipc_problems(cfg) + gpu_problems(cfg)
        if not problems and then is not None:
            problems = then()
    except BaseException:
        _reap(nixl)
        raise
    if problems or nixl is None:
        _reap(nixl)
        return problems
    problems = nixl_problems(nixl)
    if not problems and mark is not None:
        try:
            os.makedirs(os.path.dirname(mark), mode=0o700, exist_ok=True)
            with open(mark, "w"):
                pass
        except OSError:  # remembered or not, the check passed
            pass
    return problems


def _reap(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None:
        proc.kill()
        proc.communicate()
