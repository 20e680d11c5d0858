"""Every test gets exactly one group marker, so the suite runs in pieces (docs/testing.md):

- ``unit``: in one process or with helper processes (TP ranks, fake children), no deployment;
- ``e2e``: starts real pushkv processes (a deployment, a supervisor, a router or writers);
- ``faults``: kills processes at protocol phases (``test_faults*``);
- ``gpu``: needs a CUDA GPU (``test_gpu*``, or a ``skipif`` that names CUDA/GPU); skipped without one.

A marker written on a test (or its module) wins; otherwise the group is inferred, so a new
test is grouped without anyone remembering to: a test whose function or fixtures call a
process starter (``deployment``, ``launched``, ``children``, ``Popen``) is ``e2e``.

With ``CI=true`` (``.ci/run``) a skip is a failure, unless what is missing is a CUDA GPU: CI
installs etcd, ``ip`` (network namespaces, as root) and vLLM, so a test that skips for want of
them has found CI broken, not a machine without them.
"""
from __future__ import annotations

import functools
import os

import pytest

# the deployments the tests start (hundreds, on two cores) do not load xgrammar as their routers come up: a
# structured-output request loads it when it comes, as before PUSHKV_WARM_GRAMMARS
# (tests/router/test_parse_off_loop.py turns it on and checks it)
os.environ.setdefault("PUSHKV_WARM_GRAMMARS", "0")

GROUPS = ("unit", "e2e", "faults", "gpu")
CI = os.environ.get("CI", "").lower() == "true"
MAY_SKIP_IN_CI = ("CUDA",)  # a skip whose reason names one of these is a skip in CI too
STARTERS = frozenset({"deployment", "launched", "children", "Popen"})


@functools.lru_cache(maxsize=1)
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class _Code:
    """A nested function's code seen through its enclosing function's module."""

    def __init__(self, code, outer):
        self.__code__, self.__globals__ = code, getattr(outer, "__globals__", {})
        self.__module__ = getattr(outer, "__module__", None)


def _starts_processes(item) -> bool:
    codes = [getattr(item, "function", None)]
    for defs in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
        codes += [d.func for d in defs]
    seen = set()
    while codes:
        fn = codes.pop()
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        if STARTERS & set(code.co_names):
            return True
        # helpers the test calls in its own module (e.g. a fixture's start() closure)
        for c in code.co_consts:
            if hasattr(c, "co_names"):
                codes.append(_Code(c, fn))
        mod = getattr(fn, "__globals__", {})
        for n in code.co_names:
            obj = mod.get(n)
            if not callable(obj) or getattr(obj, "__module__", "") != getattr(fn, "__module__", None):
                continue
            if isinstance(obj, type):  # a helper class: its methods
                codes += [v for v in vars(obj).values() if hasattr(v, "__code__")]
            else:
                codes.append(obj)
    return False


def _group(item) -> str:
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
    if "gpu" in module:
        return "gpu"
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason or "GPU" in reason:
            return "gpu"
    if "fault" in module:
        return "faults"
    return "e2e" if _starts_processes(item) else "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        own = [g for g in GROUPS if item.get_closest_marker(g)]
        group = own[0] if own else _group(item)
        if not own:
            item.add_marker(group)
        if group == "gpu" and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="gpu group: needs a CUDA GPU"))


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def _fail_skip_in_ci(report) -> None:
    if not CI or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(word in reason for word in MAY_SKIP_IN_CI):
        return
    report.outcome = "failed"
    report.longrepr = f"CI=true: this would have skipped ({reason}); in CI only a missing CUDA GPU may skip"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips as a whole (``pytest.importorskip("vllm")`` at its top)."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


# --------------------------------------------------------------------------- where the time goes
_SECONDS: dict[tuple[str, str], float] = {}  # (kind, name) -> seconds of setup + call + teardown


def pytest_runtest_logreport(report):
    parts = report.nodeid.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else "tests"
    group = next((g for g in GROUPS if g in report.keywords), "unit")
    for key in (("group", group), ("folder", folder)):
        _SECONDS[key] = _SECONDS.get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The tests' time by group (unit, e2e, faults, gpu) and by subsystem folder: what CI spends where."""
    if not _SECONDS:
        return
    for kind in ("group", "folder"):
        rows = sorted(((s, n) for (k, n), s in _SECONDS.items() if k == kind), reverse=True)
        terminalreporter.write_line(f"time by {kind}: " + ", ".join(f"{n} {s:.0f} s" for s, n in rows))
