"""Checks before anything starts: a taken port, a missing GPU, NIXL that does not import. Each
`pushkv up` here must refuse before any child starts (exit 2), naming the flag and the fix."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.supervisor.plan import free_tcp_port
from pushkv.supervisor.preflight import cuda_device_count, gpu_problems, port_problems

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def up(tmp_path, *flags: str, env: dict | None = None) -> tuple[int, str]:
    """``pushkv up FLAGS`` (real children, were it to get that far): exit status and stderr."""
    argv = [sys.executable, "-m", "processes.cli", "up", "--model", "tiny", "--load-format", "dummy",
            "--num-blocks", "16", *flags]
    full = dict(os.environ, PUSHKV_REGISTRY_DIR=str(tmp_path / "registry"), **(env or {}))
    p = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=90, cwd=ROOT)
    return p.returncode, p.stderr


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def taken_port():
    """A port this test holds, below the ephemeral range, with the three after it free (the metrics
    tests plan those: an outgoing connection's port there would be a second 'taken' port)."""
    port = next(p for p in (free_tcp_port() for _ in range(200)) if all(_bindable(p + i) for i in (1, 2, 3)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield port


def test_taken_router_port_refused_before_anything_starts(tmp_path, taken_port):
    rc, err = up(tmp_path, "--mode", "local", "--port", str(taken_port))
    assert rc == 2, err
    assert f"--port {taken_port}: 127.0.0.1:{taken_port} is taken" in err and "give --port a free port" in err
    assert "READY" not in err and not (tmp_path / "registry").exists()  # no deployment was recorded


@pytest.mark.parametrize("mode,offset,flags", [
    ("local", 0, ()),
    ("push", 0, ()),  # P's
    ("push", 1, ()),  # D's: the port after P's
    ("push", 2, ("--prefill-instances", "2")),  # the second P's is +1, D's +2
])
def test_taken_metrics_port_names_its_flag(taken_port, mode, offset, flags):
    cfg = DeploymentConfig(mode=mode, metrics_port=taken_port - offset, port=free_tcp_port(),
                           prefill_instances=int(flags[1]) if flags else 1)
    got = port_problems(cfg)
    assert len(got) == 1 and got[0].startswith(f"--metrics-port {taken_port}:"), got


def test_a_router_on_a_unix_socket_asks_no_tcp_port(taken_port):
    """--uds: the router binds its socket file, so --port (8000 unless given) is neither checked nor bound; a port
    something else holds there refused a deployment that would never have used it."""
    assert port_problems(DeploymentConfig(mode="local", port=taken_port, uds="/tmp/pushkv-router.sock")) == []


def test_free_ports_pass():
    assert port_problems(DeploymentConfig(port=free_tcp_port())) == []
    assert port_problems(DeploymentConfig(port=free_tcp_port(), host_role="prefill", registry="etcd://h:1",
                                          advertise="127.0.0.1")) == []  # a P host binds no router port


@pytest.mark.parametrize("devices,count,want", [
    (("cpu", "cpu"), 0, []),
    (("cuda", "cuda"), 0, ["--device cuda (prefill): no GPU visible; use --device cpu"]),
    (("cuda:0", "cpu"), 0, ["--prefill-device cuda:0 (prefill): no GPU visible"]),
    (("cuda:0", "cuda:1"), 2, []),
    (("cuda:0", "cuda:2"), 2, ["--decode-device cuda:2 (decode, tp 1) needs GPUs 2..2; 2 visible (0..1)"]),
])
def test_gpu_problems(devices, count, want):
    cfg = DeploymentConfig(prefill=InstanceConfig(role="prefill", device=devices[0]),
                           decode=InstanceConfig(role="decode", device=devices[1]))
    got = gpu_problems(cfg, lambda: (count, "no GPU visible" if count == 0 else ""))
    assert len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want)), got


def test_cuda_without_a_gpu_refused(tmp_path):
    if cuda_device_count()[0]:
        pytest.skip("this host has a GPU")
    rc, err = up(tmp_path, "--mode", "local", "--device", "cuda", "--port", str(free_tcp_port()))
    assert rc == 2, err
    assert "--device cuda (local): " in err and "use --device cpu" in err
    assert "Traceback" not in err and not (tmp_path / "registry").exists()


def test_nixl_that_does_not_import_refused(tmp_path):
    broken = tmp_path / "site" / "nixl"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libnixl.so: cannot open shared object file')\n")
    path = os.pathsep.join([str(tmp_path / "site"), ROOT, os.environ.get("PYTHONPATH", "")])
    rc, err = up(tmp_path, "--mode", "push", "--port", str(free_tcp_port()), env={"PYTHONPATH": path})
    assert rc == 2, err
    assert "NIXL does not import (ImportError: libnixl.so: cannot open shared object file)" in err
    assert "pip install nixl" in err and "Traceback" not in err and not (tmp_path / "registry").exists()


def test_a_nixl_that_imported_is_remembered_for_the_same_install(tmp_path, monkeypatch):
    """The NIXL import (seconds: it imports torch) runs once per install: a later check over the
    same interpreter and files reads the mark; another install (a nixl found elsewhere) is checked."""
    from pushkv.supervisor import preflight as pf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    reg = tmp_path / "cache" / "pushkv"
    cfg = DeploymentConfig(mode="local")
    started = []

    class Passed:  # an import check that went well, without a child
        returncode = 0

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(pf, "start_nixl_check", lambda: started.append(1) or Passed())
    monkeypatch.setattr(pf, "port_problems", lambda cfg: [])
    assert pf.preflight(cfg) == [] and len(started) == 1
    assert [p.name for p in reg.iterdir()] == [f"nixl-imports-{pf.nixl_fingerprint()}"]
    assert pf.preflight(cfg) == [] and len(started) == 1  # remembered: no second import
    other = tmp_path / "site" / "nixl"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "nixl", raising=False)  # a test before may have imported the real one
    assert pf.preflight(cfg) == [] and len(started) == 2  # another nixl: checked afresh


def test_the_pools_sizing_runs_once_ports_and_gpus_pass_and_does_not_wait_for_nixl(taken_port, monkeypatch):
    """A model that does not fit is answered as fast as a taken port: the sizing runs before NIXL's
    import is waited for, and not at all when a cheaper check already failed."""
    from pushkv.supervisor import preflight as pf

    monkeypatch.setattr(pf, "nixl_problems", lambda proc, timeout_s=0: pytest.fail("waited for NIXL"))
    monkeypatch.setattr(pf, "_verified_mark", lambda fingerprint: None)  # never remembered: NIXL is checked
    calls = []

    def sizing():
        calls.append(1)
        return ["prefill: the model does not fit"]

    ok = DeploymentConfig(mode="local", port=free_tcp_port())
    assert pf.preflight(ok, then=sizing) == ["prefill: the model does not fit"] and calls == [1]
    taken = DeploymentConfig(mode="local", port=taken_port)
    assert pf.preflight(taken, then=sizing)[0].startswith(f"--port {taken_port}") and calls == [1]


EV = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}'


@pytest.mark.parametrize("kw,events,clash", [
    # vLLM's endpoint and a replay endpoint the port after: the second instance (here D) publishes on the replay's
    (dict(mode="push"), (5557, 5558), "--kv-events-config replay_endpoint takes ports 5558..5559 and "
                                      "--kv-events-config endpoint ports 5557..5558 on this host"),
    (dict(mode="local"), (5557, 5558), ""),  # one instance: one port each
    (dict(mode="push", prefill_instances=2, decode_instances=2), (5557, 5600), ""),  # running.md's example
    (dict(mode="push", prefill_instances=3), (5557, 5560), "both want 5560"),
    (dict(mode="push", metrics_port=9100, port=9101), None, "--metrics-port takes ports 9100..9101 and --port"),
    (dict(mode="push", metrics_port=5559), (5557, 5600), ""),  # side by side
    (dict(mode="push", metrics_port=5558), (5557, 5600), "--kv-events-config endpoint takes ports 5557..5558 and "
                                                         "--metrics-port ports 5558..5559 on this host"),
    (dict(mode="push", host_role="router", registry="etcd://h:1", port=5557), (5557, 5558), ""),  # binds neither
    (dict(mode="push", uds="/tmp/router.sock", port=9100, metrics_port=9100), None, ""),  # --uds: no TCP port
])
def test_fixed_port_ranges_that_meet_are_refused_before_anything_starts(kw, events, clash):
    from pushkv.protocol import kv_events
    from pushkv.supervisor.plan import plan_deployment, port_clash

    cfg = DeploymentConfig(**kw, kv_events=kv_events.parse_config(EV % events) if events else
                           DeploymentConfig().kv_events)
    got = port_clash(cfg)
    assert (clash in got) if clash else got == "", got
    if clash:
        with pytest.raises(ValueError, match="give them ranges that do not meet"):
            plan_deployment(cfg, run_root="/nonexistent")


def test_an_ipc_kv_events_path_in_use_is_refused(tmp_path):
    """A second deployment given the first's ipc:// KV-events path took its sockets over silently (ZeroMQ's ipc bind
    removes the file first): a live socket there, or a file that is no socket, is refused; a leftover is not."""
    import zmq

    from pushkv.protocol import kv_events
    from pushkv.supervisor.preflight import ipc_problems

    def cfg(path: str, **kw) -> DeploymentConfig:
        return DeploymentConfig(**kw, kv_events=kv_events.parse_config(
            '{"enable_kv_cache_events": true, "endpoint": "ipc://%s"}' % path))

    live = str(tmp_path / "kv.sock")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{live}_1")  # another deployment's second instance (here D's)
    try:
        assert ipc_problems(cfg(live, mode="local")) == []  # one instance: kv.sock alone, which is free
        (got,) = ipc_problems(cfg(live, mode="push"))
        assert got == (f"--kv-events-config endpoint ipc://{live}: {live}_1 is a socket another process listens on "
                       "(another deployment's?); binding it would take it over: give each deployment a "
                       "path of its own")
        assert ipc_problems(cfg(live, mode="push", host_role="router", registry="etcd://h:1")) == []  # binds none
    finally:
        pub.close(0)
        ctx.term()
    left = tmp_path / "left.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(left))  # bound, never listening: what a killed publisher leaves
    assert ipc_problems(cfg(str(left), mode="local")) == []
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    assert "exists and is no socket" in ipc_problems(cfg(str(plain), mode="local"))[0]
    # --trace ipc://PATH: the taps' end, bound by the supervisor, alike
    tap = tmp_path / "tap.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tap))
        s.listen()
        traced = DeploymentConfig(mode="local", trace_endpoint=f"ipc://{tmp_path}/t.sock",
                                  trace_tap_endpoint=f"ipc://{tap}")
        assert ipc_problems(traced) == [f"--trace ipc://{tap}: {tap} is a socket another process listens on (another "
                                        "deployment's?); binding it would take it over: give each deployment a "
                                        "path of its own"]


def test_kv_event_ports_that_meet_stop_pushkv_up_before_any_process(tmp_path):
    base = free_tcp_port()
    rc, err = up(tmp_path, "--mode", "push", "--port", str(free_tcp_port()), "--kv-events-config",
                 EV % (base, base + 1))
    assert rc == 2, err
    assert f"both want {base + 1}" in err and "READY" not in err and not (tmp_path / "registry").exists()
