"""What ``pushkv up`` says once a host is ready (a P or D host of several runs no router: it names
its role, address and instances, not an empty URL), and ``--insecure``'s warning said first, before
any check that can refuse the start."""
from __future__ import annotations

import io
import json
import logging

import pytest

from processes import cli
from pushkv.supervisor.plan import plan_deployment
from pushkv.supervisor.supervisor import Supervisor, ready_what

pytestmark = pytest.mark.timeout(120)

REG = "etcd://127.0.0.1:1"  # nothing listens there


def planned(*flags: str):
    args = cli.build_parser().parse_args(["up", "--model", "tiny", *flags])
    ports = iter(range(18470, 18500))  # numbers only: nothing binds them
    return plan_deployment(cli.config_from_args(args), pick_port=lambda: next(ports), run_root="/tmp/x")


def test_a_router_host_names_its_url():
    for flags in ((), ("--role", "router", "--advertise", "10.0.0.9", "--registry", REG)):
        assert ready_what(planned(*flags, "--port", "18480"), "http://10.0.0.9:18480") == "http://10.0.0.9:18480"


def test_a_prefill_or_decode_host_names_its_role_address_and_instances():
    cfg = planned("--role", "prefill", "--advertise", "10.0.0.1", "--prefill-instances", "2", "--registry", REG)
    ids = [i.engine_id for i in cfg.instances()]
    what = ready_what(cfg, "")
    assert what == f"prefill host 10.0.0.1, no router here: instances prefill ({ids[0]}), prefill1 ({ids[1]})"
    assert ids[0].startswith("prefill-10.0.0.1-")
    cfg = planned("--role", "decode", "--advertise", "10.0.0.3", "--registry", REG)
    assert ready_what(cfg, "").startswith("decode host 10.0.0.3, no router here: instances decode (decode-10.0.0.3-")


@pytest.mark.parametrize("flags", [
    ("--port", "18481"),
    ("--role", "decode", "--advertise", "10.0.0.3", "--registry", REG),
])
def test_the_ready_log_line_and_stdout(caplog, flags):
    cfg = planned(*flags)
    out = io.StringIO()
    sup = Supervisor(cfg, out=out)
    with caplog.at_level(logging.INFO, logger="pushkv.supervisor.supervisor"):
        sup._now_running(0.0)
    (line,) = [r.getMessage() for r in caplog.records if " ready: " in r.getMessage()]
    head, _, what = line.partition(" ready: ")
    assert head == f"deployment {cfg.deployment_id}" and what
    lines = out.getvalue().splitlines()
    if cfg.host_role:
        assert what.startswith("decode host 10.0.0.3, no router here: instances decode (")
        assert lines == ["instances " + " ".join(i.engine_id for i in cfg.instances()), "READY"]
    else:  # the router's URL, on the log line and first on stdout, as before
        assert what == sup.router_url and what.endswith(":18481")
        assert lines == [sup.router_url, "READY"]


def test_insecure_is_said_before_a_config_check_refuses_the_start(capsys):
    """--role prefill without --advertise is refused by the config check; the warning came first."""
    assert cli.main(["up", "--model", "tiny", "--role", "prefill", "--insecure", "--registry", REG]) == 2
    err = capsys.readouterr().err
    warning = err.index("WARNING --insecure: prefill host without --secret-file")
    refused = err.index("bad configuration: --role prefill needs --advertise")
    assert warning < refused
    assert err.count("WARNING --insecure") == 1


def test_insecure_is_said_before_a_bad_flag_value_is_refused(capsys):
    assert cli.main(["up", "--model", "tiny", "--role", "decode", "--advertise", "127.0.0.1", "--insecure",
                     "--max-model-len", "100000000", "--registry", REG]) == 2
    err = capsys.readouterr().err
    assert err.index("WARNING --insecure: decode host without --secret-file: its ZMQ sockets on 127.0.0.1") \
        < err.index("bad configuration: --max-model-len")


def test_no_insecure_warning_with_a_secret_or_without_a_role(tmp_path, capsys):
    secret = tmp_path / "curve.secret"
    secret.write_text("x" * 32)
    secret.chmod(0o600)
    # refused later (no --advertise), but CURVE would be on: nothing to warn of
    assert cli.main(["up", "--model", "tiny", "--role", "prefill", "--insecure", "--secret-file", str(secret),
                     "--registry", REG]) == 2
    assert "WARNING --insecure" not in capsys.readouterr().err
    assert cli.main(["up", "--model", "tiny", "--insecure", "--max-model-len", "100000000"]) == 2
    assert "WARNING --insecure" not in capsys.readouterr().err


def test_insecure_with_the_role_in_a_config_file_is_said_once_the_file_is_read(tmp_path, capsys):
    conf = tmp_path / "host.json"
    conf.write_text(json.dumps({"model": "tiny", "host_role": "prefill", "advertise": "127.0.0.1",
                                "registry": REG}))
    assert cli.main(["up", "--config", str(conf), "--insecure"]) == 2  # refused at the registry, later
    err = capsys.readouterr().err
    assert err.count("WARNING --insecure: prefill host without --secret-file: its ZMQ sockets on 127.0.0.1") == 1
    assert err.index("WARNING --insecure") < err.index("registry")
