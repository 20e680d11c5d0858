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


def test_status_finds_a_deployment_recorded_without_a_runtime_dir(tmp_path, monkeypatch, capsys):
    """pushkv up as a systemd service (no XDG_RUNTIME_DIR) records under /tmp; the same user's login shell (which has
    one) ran pushkv status and stop against its runtime dir and said 'no running pushkv deployments'. Both are read
    now; /tmp's, when not safely ours, is skipped with a warning (and never fails the other)."""
    from pushkv.supervisor import deployments, registry

    monkeypatch.delenv("PUSHKV_REGISTRY_DIR", raising=False)
    monkeypatch.setattr(registry, "TMP_ROOT", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "xdg").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    service = tmp_path / "tmp" / f"pushkv-{os.getuid()}"
    write_record(DeploymentRecord("svc00001", 2 ** 22 + 1, "ipc://c", "ipc://e", "http://x",
                                  str(tmp_path / "pushkv-svc00001"), "push", 0.0), str(service))
    write_record(DeploymentRecord("shell001", 2 ** 22 + 2, "ipc://c", "ipc://e", "http://y",
                                  str(tmp_path / "pushkv-shell001"), "push", 0.0))  # the runtime dir's
    assert registry.reading_dirs() == [registry_dir(), str(service)]
    assert sorted(r.deployment_id for r in registry.list_records()) == ["shell001", "svc00001"]
    assert deployments.status("svc00001") == 1  # found, and its supervisor (a pid never ours) is gone: stale
    out = capsys.readouterr().out
    assert "deployment svc00001  mode=push  http://x" in out and "stale" in out, out
    assert deployments.stop("svc00001") == 0  # the stale record is removed where it was
    assert not (service / "svc00001.json").exists()
    os.chmod(service, 0o755)  # open to others: not read, the runtime dir's still are
    assert [r.deployment_id for r in registry.list_records()] == ["shell001"]


def test_a_command_without_a_runtime_dir_finds_a_login_shells_deployment(tmp_path, monkeypatch, capsys):
    """`pushkv up` from a login shell records under its XDG_RUNTIME_DIR (/run/user/$UID); `pushkv status` or `stop`
    run where there is none (cron, sudo, a service) looked under /tmp only and said 'no running pushkv deployments'.
    The runtime dir logind makes is read too; when not safely ours, it is skipped with a warning."""
    from pushkv.supervisor import deployments, registry

    monkeypatch.delenv("PUSHKV_REGISTRY_DIR", raising=False)
    monkeypatch.setattr(registry, "TMP_ROOT", str(tmp_path / "tmp"))
    monkeypatch.setattr(registry, "RUN_USER_ROOT", str(tmp_path / "run" / "user"))
    (tmp_path / "tmp").mkdir()
    runtime = tmp_path / "run" / "user" / str(os.getuid())
    runtime.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the login shell's `pushkv up`
    write_record(DeploymentRecord("shell002", 2 ** 22 + 3, "ipc://c", "ipc://e", "http://z",
                                  str(tmp_path / "pushkv-shell002"), "push", 0.0))
    monkeypatch.delenv("XDG_RUNTIME_DIR")  # cron's `pushkv status`, `pushkv stop`
    assert [r.deployment_id for r in registry.list_records()] == ["shell002"]
    assert registry.reading_dirs() == [registry_dir(), str(runtime / "pushkv-deployments")]
    assert deployments.status("shell002") == 1  # found; its supervisor (a pid never ours) is gone: stale
    assert "deployment shell002  mode=push  http://z" in capsys.readouterr().out
    assert deployments.stop("shell002") == 0  # the stale record is removed where it was
    assert not (runtime / "pushkv-deployments" / "shell002.json").exists()
    write_record(DeploymentRecord("shell003", 2 ** 22 + 4, "ipc://c", "ipc://e", "http://z",
                                  str(tmp_path / "pushkv-shell003"), "push", 0.0), str(runtime / "pushkv-deployments"))
    os.chmod(runtime / "pushkv-deployments", 0o755)  # open to others: not read
    assert registry.list_records() == []


# --- a registry no one else can plant ------------------------------------------------------------
NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another uid owns")


def _plant(kind: str, tmp_path) -> str:
    """A registry directory as someone else could have left it at our path first."""
    d = str(tmp_path / "reg")
    if kind == "other uid":
        os.mkdir(d, 0o700)
        os.chown(d, NOBODY, NOBODY)
    elif kind == "symlink":
        os.mkdir(tmp_path / "elsewhere", 0o700)
        os.symlink(tmp_path / "elsewhere", d)
    elif kind == "open mode":
        os.mkdir(d)
        os.chmod(d, 0o777)
    elif kind == "file":
        open(d, "w").close()
    return d


@pytest.mark.parametrize("kind,says", [
    pytest.param("other uid", f"owned by uid {NOBODY}", marks=ROOT_ONLY),
    ("symlink", "is a symlink"),
    ("open mode", "mode is 0777"),
    ("file", "not a directory"),
])
def test_planted_registry_dir_is_refused(kind, says, tmp_path, monkeypatch, capsys):
    from processes import cli
    from pushkv.supervisor.registry import RegistryError, list_records

    d = _plant(kind, tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(RegistryError, match=says):
        list_records(d)
    with pytest.raises(RegistryError, match=says):
        write_record(DeploymentRecord("dep", 1, "ipc://c", "ipc://e", "http://x", "/run", "push", 0.0), d)
    monkeypatch.setenv("PUSHKV_REGISTRY_DIR", d)
    assert cli.main(["up", "--mode", "push", "--model", "tiny"]) == 2  # refused before anything starts
    assert says in capsys.readouterr().err
    assert cli.main(["stop", "--all"]) == 2 and says in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written next to it or into it
    if kind != "file":
        assert os.listdir(d) == []


def _victim_dir(path) -> str:
    os.mkdir(path, 0o700)
    with open(os.path.join(path, "precious"), "w") as f:
        f.write("mine")
    return str(path)


@pytest.mark.parametrize("where,pid_owner", [
    ("elsewhere", "us"),  # a 0700 directory of ours that no deployment made
    ("symlink in form", "us"),  # .../pushkv-<id> that is a link to it
    ("elsewhere", "other uid"),
])
def test_planted_record_deletes_nothing_and_signals_nothing(where, pid_owner, tmp_path, monkeypatch, capsys):
    import subprocess

    from pushkv.supervisor import deployments

    if pid_owner == "other uid" and os.geteuid() != 0:
        pytest.skip("needs root for a process of another uid")
    reg = str(tmp_path / "reg")
    os.mkdir(reg, 0o700)
    victim = _victim_dir(tmp_path / "victim")
    dep_id = "planted1"
    run_dir = victim
    if where == "symlink in form":
        run_dir = str(tmp_path / f"pushkv-{dep_id}")
        os.symlink(victim, run_dir)
    argv = ["sleep", "600"] if pid_owner == "us" else ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                                        "--clear-groups", "sleep", "600"]
    bystander = subprocess.Popen(argv)
    try:
        write_record(DeploymentRecord(dep_id, bystander.pid, f"ipc://{tmp_path}/no.sock", "ipc://e", "http://x",
                                      run_dir, "push", 0.0), reg)
        monkeypatch.setenv("PUSHKV_REGISTRY_DIR", reg)
        deployments.status()  # a stale record: reported, nothing done
        deployments.stop(dep_id, timeout_s=1.0)
        err = capsys.readouterr().err
        assert "nothing it names was deleted" in err, err
        assert bystander.poll() is None, "a pid from a planted record was signalled"
        assert open(os.path.join(victim, "precious")).read() == "mine"
        assert os.listdir(reg) == []  # the record itself went
        write_record(DeploymentRecord(dep_id, bystander.pid, "ipc://c", "ipc://e", "http://x", run_dir, "push",
                                      0.0), reg)
        deployments.sweep_residue()  # pushkv up's sweep
        assert bystander.poll() is None and os.path.exists(os.path.join(victim, "precious"))
    finally:
        bystander.kill()
        bystander.wait()


def test_a_dead_deployments_own_run_dir_is_still_cleaned(tmp_path, monkeypatch):
    """The form check keeps the sweep's purpose: a record of pushkv's form whose supervisor is gone
    (here: its pid now belongs to some other process of ours) has its run dir removed, and that
    process is left alone."""
    import subprocess

    from pushkv.supervisor import deployments

    reg = str(tmp_path / "reg")
    os.mkdir(reg, 0o700)
    run_dir = _victim_dir(tmp_path / "pushkv-dead1")
    reused = subprocess.Popen(["sleep", "600"])
    try:
        write_record(DeploymentRecord("dead1", reused.pid, "ipc://c", "ipc://e", "http://x", run_dir, "push", 0.0),
                     reg)
        monkeypatch.setenv("PUSHKV_REGISTRY_DIR", reg)
        deployments.sweep_residue()
        assert not os.path.exists(run_dir) and os.listdir(reg) == []
        assert reused.poll() is None
    finally:
        reused.kill()
        reused.wait()


def test_is_our_supervisor_reads_uid_and_title(tmp_path):
    import subprocess
    import sys

    from pushkv.supervisor.lifecycle import is_our_supervisor

    child = subprocess.Popen([sys.executable, "-c", "import setproctitle, sys; "
                              "setproctitle.setproctitle('pushkv supervisor abc123'); print('titled', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "titled"
        assert is_our_supervisor(child.pid, "abc123")
        assert not is_our_supervisor(child.pid, "abc12")  # another deployment's id
        assert not is_our_supervisor(os.getpid(), "abc123")  # a process of ours, not titled so
        assert not is_our_supervisor(1, "abc123")
    finally:
        child.stdin.close()
        child.wait(timeout=30)
