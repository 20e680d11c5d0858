"""pushkv/envs.py is every PUSHKV_* variable the code reads (and the other tools' variables it reads),
typed for mypy and read when asked, and docs/running.md's table is generated from it."""
from __future__ import annotations

import ast
import os
import re

import pytest

from pushkv import envs
from tests.support import ROOT

SHIPPED = ("pushkv", "processes", "tools")
TABLE = re.compile(r"<!-- envs table: python -m pushkv.envs -->\n(.*?)<!-- end of envs table -->\n", re.S)


def _names_in_code() -> dict[str, set[str]]:
    """Every string constant of shipped code that is a PUSHKV_ name, or a declared name of another
    tool's variable -> the files holding it."""
    found: dict[str, set[str]] = {}
    for package in SHIPPED:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path == envs.__file__:
                    continue
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        for var in re.findall(r"\bPUSHKV_[A-Z0-9_]+\b", node.value):
                            if node.value == var:  # the name itself, not a mention in a docstring
                                found.setdefault(var, set()).add(os.path.relpath(path, ROOT))
                        if node.value in envs.VARS:
                            found.setdefault(node.value, set()).add(os.path.relpath(path, ROOT))
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                            and node.value.id == "envs" and node.attr in envs.VARS:  # envs.NAME
                        found.setdefault(node.attr, set()).add(os.path.relpath(path, ROOT))
    return found


def test_every_variable_the_code_reads_is_declared():
    undeclared = {n: sorted(f) for n, f in _names_in_code().items() if n not in envs.VARS}
    assert not undeclared, f"declare these in pushkv/envs.py: {undeclared}"


def test_every_declared_variable_is_used():
    unused = set(envs.VARS) - set(_names_in_code())
    assert not unused, f"declared in pushkv/envs.py, read nowhere (delete them): {sorted(unused)}"


def test_the_typed_names_are_the_table():
    """envs.NAME's type for mypy (the TYPE_CHECKING block) is the declared variable's, for every one."""
    with open(envs.__file__) as f:
        tree = ast.parse(f.read())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    typed = {a.target.id: ast.unparse(a.annotation) for a in block.body
             if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    assert typed == {v.name: v.type.__name__ for v in envs.VARS.values()}


def test_no_raw_read_of_a_declared_variable():
    """Shipped code reads a declared variable through envs, never os.environ / os.getenv by its name."""
    raw = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*\"(\w+)\"")
    found = []
    for package in SHIPPED:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and path != envs.__file__:
                    with open(path) as f:
                        found += [f"{os.path.relpath(path, ROOT)}: {mo.group(2)}" for mo in raw.finditer(f.read())
                                  if mo.group(2) in envs.VARS]
    assert set(found) <= set(RAW_READS_LEFT), found


RAW_READS_LEFT: list[str] = []  # every variable is read through pushkv.envs


def test_the_docs_table_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "running.md")) as f:
        m = TABLE.search(f.read())
    assert m, "docs/running.md lost its envs table markers"
    assert m.group(1) == envs.markdown_table(), "regenerate docs/running.md's table: python -m pushkv.envs"


@pytest.mark.parametrize("name, raw, want", [
    ("PUSHKV_THREADS", None, 1),
    ("PUSHKV_THREADS", "4", 4),
    ("PUSHKV_CUDA_GRAPHS", None, True),
    ("PUSHKV_CUDA_GRAPHS", "0", False),
    ("PUSHKV_CUDA_GRAPHS", "", True),  # empty is unset for a typed variable
    ("PUSHKV_FUSED", "off", False),
    ("PUSHKV_VLLM_TIMING", "true", True),
    ("PUSHKV_SAMPLER", "torch", "torch"),
    ("PUSHKV_LOG", "", ""),
    ("PUSHKV_REGISTRY_DIR", "/srv/reg", "/srv/reg"),
])
def test_get_parses_by_type(name, raw, want):
    environ = {} if raw is None else {name: raw}
    assert envs.get(name, environ) == want


@pytest.mark.parametrize("name, raw, says", [
    ("PUSHKV_THREADS", "four", "PUSHKV_THREADS='four': invalid literal for int()"),
    ("PUSHKV_CUDA_GRAPHS", "2", "PUSHKV_CUDA_GRAPHS='2': not one of 1/true/yes/on/0/false/no/off"),
    ("PUSHKV_SAMPLER", "gpu", "PUSHKV_SAMPLER='gpu': not one of auto, torch, triton"),
    ("PUSHKV_CHECKSUM", "cuda", "PUSHKV_CHECKSUM='cuda': not one of triton, torch"),
])
def test_a_bad_value_is_refused_naming_the_variable(name, raw, says):
    with pytest.raises(ValueError) as e:
        envs.get(name, {name: raw})
    assert str(e.value).startswith(says)


def test_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv("PUSHKV_THREADS", "3")
    assert envs.PUSHKV_THREADS == 3
    monkeypatch.setenv("PUSHKV_THREADS", "5")
    assert envs.PUSHKV_THREADS == 5
    with pytest.raises(AttributeError):
        envs.PUSHKV_NO_SUCH_THING  # noqa: B018
