"""Where deployments are recorded: per user, never a directory every user shares."""
import os
import stat

import pytest

from pushkv.supervisor.registry import DeploymentRecord, registry_dir, write_record


@pytest.mark.parametrize("env,want", [
    ({"PUSHKV_REGISTRY_DIR": "/x/reg"}, "/x/reg"),
    ({"XDG_RUNTIME_DIR": "RUNTIME"}, os.path.join("RUNTIME", "pushkv-deployments")),
    ({"XDG_RUNTIME_DIR": "/no/such/dir"}, f"/tmp/pushkv-{os.getuid()}"),  # a runtime dir that is not there
    ({}, f"/tmp/pushkv-{os.getuid()}"),
])
def test_registry_dir_is_per_user(env, want, tmp_path):
    env = {k: (str(tmp_path) if v == "RUNTIME" else v) for k, v in env.items()}
    assert registry_dir(env) == want.replace("RUNTIME", str(tmp_path))


def test_registry_dir_is_private(tmp_path):
    d = tmp_path / "reg"
    write_record(DeploymentRecord("dep", 1, "ipc://c", "ipc://e", "http://x", "/run", "push", 0.0), str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
