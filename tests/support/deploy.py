"""A whole deployment for tests, checked for leftovers on the way out
(processes, shared memory, the port) and for block accounting."""
from __future__ import annotations

import socket
import subprocess
import threading
from contextlib import contextmanager

from pushkv import messages as m
from tools.launch import Deployment, launched
from pushkv.supervisor.lifecycle import shm_leftovers


def in_threads(fn, items, timeout_s: float = 300) -> list:
    """``fn(item)`` for every item at once, each on its own thread: the results in order; any error raised here."""
    items = list(items)
    out: list = [None] * len(items)
    errs: list = []

    def one(i, item):
        try:
            out[i] = fn(item)
        except Exception as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=one, args=(i, item)) for i, item in enumerate(items)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)
    assert not errs, errs
    return out


def concurrent(dep: Deployment, prompts, max_tokens: int) -> list[list[int]]:
    return in_threads(lambda p: dep.tokens(p, max_tokens), prompts)


def wait_pools_free(dep: Deployment, timeout_s: float = 30.0) -> dict[str, m.Stats]:
    return dep.wait_pools_free(timeout_s)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a new server would; TIME_WAIT is fine
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextmanager
def deployment(tmp_path, *flags: str, session: bool = False):
    dep_id = None
    with launched(*flags, log_path=str(tmp_path / "up.log"), registry=str(tmp_path / "registry"),
                  session=session) as dep:
        dep_id = dep.cfg.deployment_id
        yield dep
    assert shm_leftovers(dep_id) == [], "shared memory leaked"
    # a child is titled `pushkv <what> <id>` once it runs (processes/common.py), its run dir in argv before
    left = subprocess.run(["pgrep", "-f", f"pushkv-{dep_id}/|^pushkv .* {dep_id}$"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
    assert _port_free(dep.port), "router port still bound"


def local_references(tmp_path_factory, prompts: dict, max_tokens: int, num_blocks: int):
    """get(model, tp) -> local-mode tokens of every prompt, each (model, tp) deployment started
    once (on first use) and stopped at once: the reference P/D tokens are compared with."""
    cache: dict = {}

    def get(model: str, tp: int) -> dict:
        if (model, tp) not in cache:
            tmp = tmp_path_factory.mktemp(f"local-{model}-tp{tp}")
            with deployment(tmp, "--mode", "local", "--model", model, "--tp", str(tp),
                            "--num-blocks", str(num_blocks)) as dep:
                cache[(model, tp)] = {n: dep.tokens(p, max_tokens) for n, p in prompts.items()}
        return cache[(model, tp)]

    return get
