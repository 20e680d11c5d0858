"""The bench tools against a router started with an API key: the key from PUSHKV_API_KEY or
OPENAI_API_KEY (as ``vllm bench serve`` sends it) gets every request through; without it every
request is a 401, and ``pushkv bench`` saves the run as usual and exits 1 (any failed request)."""
from __future__ import annotations

import asyncio
import json
import socket

import msgspec
import pytest

from tests.support.router_fakes import Harness, make_cfg, stage, tokens
from tools import bench, chat_bench

pytestmark = pytest.mark.timeout(90)

KEY = "sekrit-bench-key"
PORTS = range(18440, 18470)  # this test's share of the tests' port range


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


def script(g):
    n = g.max_tokens
    out = [(None, tokens(g, [65 + i])) for i in range(n - 1)]
    out.append((None, tokens(g, [90], True, "length", (stage("scheduled"), stage("finished")))))
    return out


def against_router(tmp_path, run):
    """``run(url)`` in a thread (the tools run their own event loop) against a router that wants KEY."""
    async def body():
        cfg = msgspec.structs.replace(make_cfg(tmp_path, "local"), port=free_port())
        h = Harness(cfg, {"local": script})
        h.router.api_key = KEY
        async with h:
            return await asyncio.to_thread(run, h.router.url)

    return asyncio.run(asyncio.wait_for(body(), 60))


@pytest.mark.parametrize("environ, want", [
    ({}, {}),
    ({"OPENAI_API_KEY": "o"}, {"Authorization": "Bearer o"}),
    ({"PUSHKV_API_KEY": "p"}, {"Authorization": "Bearer p"}),
    ({"PUSHKV_API_KEY": "p", "OPENAI_API_KEY": "o"}, {"Authorization": "Bearer p"}),  # pushkv's own first
    ({"PUSHKV_API_KEY": "", "OPENAI_API_KEY": "o"}, {"Authorization": "Bearer o"}),  # empty is unset
])
def test_auth_headers(environ, want):
    assert bench.auth_headers(environ) == want


def bench_argv(url, out_dir) -> list[str]:
    return ["--url", url, "--mode", "local", "--qps", "inf", "--num-prompts", "3", "--input-len", "8",
            "--output-len", "3", "--warmup", "1", "--result-dir", str(out_dir), "--no-progress"]


@pytest.mark.parametrize("var", ["PUSHKV_API_KEY", "OPENAI_API_KEY"])
def test_bench_sends_the_key_from_the_environment(tmp_path, monkeypatch, capsys, var):
    monkeypatch.delenv("PUSHKV_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv(var, KEY)
    assert against_router(tmp_path, lambda url: bench.main(bench_argv(url, tmp_path / "runs"))) == 0
    (path,) = (tmp_path / "runs").iterdir()
    s = json.loads(path.read_text())
    assert (s["completed"], s["failed"]) == (3, 0), s["errors"]
    assert "requests failed" not in capsys.readouterr().err


def test_bench_without_the_key_fails_with_401_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PUSHKV_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert against_router(tmp_path, lambda url: bench.main(bench_argv(url, tmp_path / "runs"))) == 1
    (path,) = (tmp_path / "runs").iterdir()  # the failed run is saved as any run is
    s = json.loads(path.read_text())
    assert (s["completed"], s["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 401") for e in s["errors"]), s["errors"]
    out, err = capsys.readouterr()
    assert "completed 0  failed 3" in out and "first error: HTTP 401" in out
    assert "3 of 3 requests failed" in err and "exit status 1" in err


def test_bench_with_a_wrong_key_exits_1(tmp_path, monkeypatch):
    monkeypatch.setenv("PUSHKV_API_KEY", "not-the-key")
    assert against_router(tmp_path, lambda url: bench.main(bench_argv(url, tmp_path / "runs"))) == 1


def test_bench_exits_1_when_some_requests_failed(tmp_path, monkeypatch, capsys):
    """Some completed, some failed (a run saved as fine before): exit 1 all the same."""
    ok = bench.RequestResult(True, 8, 3, ttft=0.1, itl=[0.01, 0.01], latency=0.12)
    bad = bench.RequestResult(False, 8, error="HTTP 503: lease expired; retry")
    monkeypatch.setattr(bench, "run_load", lambda *a, **k: _done(([ok, bad, ok], 1.0)))
    assert bench.main(bench_argv("http://127.0.0.1:1", tmp_path)) == 1
    out, err = capsys.readouterr()
    assert "completed 2  failed 1" in out and "1 of 3 requests failed" in err
    assert len(list(tmp_path.iterdir())) == 1


async def _done(value):
    return value


def chat_argv(url, out) -> list[str]:
    return ["--base-url", url, "--conversations", "2", "--rate", "0", "--turns", "1", "2", "--system-len", "8",
            "--user-len", "4", "4", "--output-len", "2", "--think-s", "0", "--out", str(out)]


def test_chat_workload_sends_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("PUSHKV_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert against_router(tmp_path, lambda url: chat_bench.main(chat_argv(url, tmp_path / "chat.json"))) == 0
    turns = json.loads((tmp_path / "chat.json").read_text())["turns"]
    assert turns and all(t["ok"] for t in turns), turns

    monkeypatch.delenv("OPENAI_API_KEY")
    assert against_router(tmp_path, lambda url: chat_bench.main(chat_argv(url, tmp_path / "chat.json"))) == 1
    turns = json.loads((tmp_path / "chat.json").read_text())["turns"]
    assert turns and all(t["error"].startswith("HTTP 401") for t in turns), turns


@pytest.mark.timeout(240)
def test_a_sweep_against_deployments_with_a_key(tmp_path, monkeypatch):
    """PUSHKV_API_KEY set: the sweep's `pushkv up` takes it as its --api-key and its bench runs send it;
    the key given only in --up-args (nothing in the environment): every request a 401, exit 1."""
    from tools import sweep

    def argv(out, *up_args):
        return ["--modes", "local", "--qps", "inf", "--inputs", "16", "--num-prompts", "2", "--output-len", "2",
                "--warmup", "0", "--port", str(free_port()), "--result-dir", str(out), "--health-timeout", "120",
                "--up-args", " ".join(["--model", "small", "--num-blocks", "64", *up_args])]

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("PUSHKV_API_KEY", KEY)
    assert sweep.main(argv(tmp_path / "with")) == 0
    (run,) = (tmp_path / "with").glob("local_*.json")
    s = json.loads(run.read_text())
    assert (s["completed"], s["failed"]) == (2, 0), s["errors"]

    monkeypatch.delenv("PUSHKV_API_KEY")
    assert sweep.main(argv(tmp_path / "without", "--api-key", KEY)) == 1
    (run,) = (tmp_path / "without").glob("local_*.json")
    s = json.loads(run.read_text())
    assert s["completed"] == 0 and all(e.startswith("HTTP 401") for e in s["errors"]), s["errors"]
