"""vLLM's --log-config-file over a real deployment: every process (supervisor, router, schedulers, workers,
writers) applies the dictConfig in place of pushkv's own format, and a config dictConfig refuses stops `pushkv up`
before any child starts."""
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.deploy import deployment

pytestmark = pytest.mark.timeout(240)


def test_every_process_logs_through_the_given_dictconfig(tmp_path):
    out = tmp_path / "all.log"
    conf = tmp_path / "logging.json"
    conf.write_text(json.dumps({
        "version": 1,
        "formatters": {"mine": {"format": "MINE pid=%(process)d %(name)s %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(out), "formatter": "mine"}},
        "root": {"level": "DEBUG", "handlers": ["file"]},
    }))
    with deployment(tmp_path, "--mode", "push", "--model", "small", "--num-blocks", "64",
                    "--log-config-file", str(conf)) as dep:
        assert len(dep.tokens([5, 6, 7], 2)) == 2
    lines = out.read_text().splitlines()
    assert lines and all(line.startswith("MINE pid=") for line in lines)
    names = {line.split()[2].split(".")[1] for line in lines if line.split()[2].startswith("pushkv.")}
    assert {"supervisor", "router", "scheduler", "model", "writer"} <= names, names  # (a worker's: pushkv.model)
    # the supervisor, the router, and P's and D's scheduler, worker and writer: 8 processes
    assert len({line.split()[1] for line in lines}) == 8


def test_a_config_dictconfig_refuses_stops_up_before_any_child(tmp_path):
    conf = tmp_path / "logging.json"
    conf.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    env = dict(os.environ, PUSHKV_REGISTRY_DIR=str(tmp_path / "registry"))
    r = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--mode", "local", "--model", "tiny",
                        "--load-format", "dummy", "--log-config-file", str(conf)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--log-config-file: logging.config.dictConfig refused it" in r.stderr and "handler 'h'" in r.stderr
