"""``pushkv``, the one command: deployment commands and every tool as subcommands, run
through the installed console script (no PYTHONPATH, from any working directory)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tools import cli

BIN = os.path.dirname(sys.executable)


def _pushkv(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([os.path.join(BIN, "pushkv"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(cli.TOOLS))
def test_every_tool_resolves_to_a_function_taking_argv(name):
    if name == "vllm-proxy":
        pytest.importorskip("vllm")
    run = cli.tool(name)
    assert callable(run) and "argv" in run.__code__.co_varnames[:run.__code__.co_argcount], name


def test_help_lists_deployment_commands_and_tools(tmp_path):
    r = _pushkv("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("up", "status", "stop", *cli.TOOLS):
        assert re.search(rf"^ {{4}}{re.escape(name)}(\s|$)", r.stdout, re.M), name


def test_bench_help_names_the_chat_workload_whose_own_help_follows(capsys):
    with pytest.raises(SystemExit):
        cli.bench(["--help"])
    assert "--workload chat" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        cli.bench(["--workload", "chat", "--help"])
    assert "--conversations" in capsys.readouterr().out


def test_a_bad_up_flag_is_one_line_and_a_pointer_to_help(capsys):
    from processes import cli as deployment

    with pytest.raises(SystemExit) as e:
        deployment.build_parser().parse_args(["up", "--mode", "bogus"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2, err
    assert err[0].startswith("pushkv up: error: argument --mode: invalid choice") and "push" in err[0], err
    assert err[1] == "(pushkv up --help: its flags)"


def test_unknown_command_is_refused_naming_the_choices(tmp_path):
    r = _pushkv("nope", cwd=tmp_path)
    assert r.returncode == 2
    assert "invalid choice: 'nope'" in r.stderr and "'bench'" in r.stderr and "'up'" in r.stderr


def test_a_tool_runs_as_a_subcommand_outside_the_checkout(tmp_path):
    """``pushkv stages DIR`` from a directory that is not the checkout: the installed package."""
    result = {"median_ttft_ms": 12.5, "median_tpot_ms": 2.25, "stages": {"prefill.prefill_end": 7.0}}
    (tmp_path / "push_qps1_in16_out2_iter0.json").write_text(json.dumps(result))
    r = _pushkv("stages", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "push_qps1_in16_out2_iter0.json: ttft 12.5 tpot 2.2 | prefill_end=7.0"


def test_stages_refuses_a_directory_that_is_not_there(tmp_path, capsys):
    from tools import stages

    assert stages.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"pushkv stages: {tmp_path / 'nope'}: no such directory"
    with pytest.raises(SystemExit):
        stages.main(["--help"])
    assert "usage: pushkv stages" in capsys.readouterr().out


def test_status_goes_to_the_deployment_commands(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PUSHKV_REGISTRY_DIR"] = str(tmp_path / "reg")
    r = subprocess.run([os.path.join(BIN, "pushkv"), "status"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stderr.splitlines()[-1]) == (1, "no running pushkv deployments"), r.stderr


def test_demo_console_script_is_installed():
    assert shutil.which("pushkv-demo", path=BIN)



def test_a_reader_that_leaves_first_gets_no_traceback(monkeypatch):
    """`pushkv status | head -0`: the reader is gone before the output is written (a pipe's, buffered, at the
    end); pushkv stops with a shell's SIGPIPE status, not a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before anything is written: every write fails, whatever the timing
    with open(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        monkeypatch.setattr(cli, "_main", lambda argv: print("deployment 1234abcd ...") or 0)
        assert cli.main(["status"]) == 141
        print("after", flush=True)  # stdout now goes nowhere, without an error
