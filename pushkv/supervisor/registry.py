"""One small JSON file per running deployment, so ``pushkv status`` / ``stop``
can find supervisors. Directory: $PUSHKV_REGISTRY_DIR, else per user: $XDG_RUNTIME_DIR/pushkv-deployments
or /tmp/pushkv-$UID (made 0700, so one user's records are neither readable nor in the way of another's).

A record says which directory to delete and which pid to signal, so whoever can write one can make
us delete and kill. /tmp/pushkv-$UID is a name anyone can take first: the directory is used only if
it is a real directory (not a symlink), ours, and 0700 (``RegistryError`` says which it is not); and
a record's run dir is deleted only in pushkv's own form (``run_dir_problem``), its pid signalled only
when it is our supervisor of that deployment (``lifecycle.is_our_supervisor``)."""
from __future__ import annotations

import logging
import os
import re
import stat
from typing import Mapping, Optional

import msgspec

from pushkv import envs

log = logging.getLogger(__name__)

DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # new_deployment_id's, or a config's own


class RegistryError(Exception):
    """The registry directory is not safe to use (someone else's, a symlink, open to others)."""


class DeploymentRecord(msgspec.Struct):
    deployment_id: str
    pid: int  # supervisor
    control_endpoint: str
    events_endpoint: str
    router_url: str
    run_dir: str
    mode: str
    started_wall: float
    trace_endpoint: str = ""
    trace_tap_endpoint: str = ""  # where pushkv tap connects (the supervisor's XPUB)
    shutdown_timeout_s: float = 0.0  # --shutdown-timeout: how much longer `pushkv stop` waits for the drain
    trace_tap_secured: bool = False  # the taps' end is a CURVE server: pushkv tap needs the deployment's secret


TMP_ROOT = "/tmp"  # where a user without a runtime directory keeps the registry (tests point it elsewhere)
RUN_USER_ROOT = "/run/user"  # where systemd-logind makes a login's XDG_RUNTIME_DIR, /run/user/$UID (tests: elsewhere)


def registry_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where ``pushkv up`` records its deployment: $PUSHKV_REGISTRY_DIR, else under $XDG_RUNTIME_DIR, else /tmp's."""
    chosen: str = envs.get("PUSHKV_REGISTRY_DIR", environ)
    if chosen:
        return chosen
    runtime: str = envs.get("XDG_RUNTIME_DIR", environ)
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "pushkv-deployments")
    return _tmp_dir()


def _tmp_dir() -> str:
    return os.path.join(TMP_ROOT, f"pushkv-{os.getuid()}")


def reading_dirs(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Where ``pushkv status|stop|tap`` look for records: the registry directory, and without PUSHKV_REGISTRY_DIR the
    other place the same user's deployments record: a deployment started without XDG_RUNTIME_DIR (a systemd service,
    cron, sudo) records under /tmp, which a login shell (which has one) must still find; and one started from a login
    shell records under its runtime dir, /run/user/$UID, which a command without one (cron's ``pushkv stop``) must
    find too."""
    first = registry_dir(environ)
    if envs.get("PUSHKV_REGISTRY_DIR", environ):
        return [first]
    if first == _tmp_dir():
        return [first, os.path.join(RUN_USER_ROOT, str(os.getuid()), "pushkv-deployments")]
    return [first, _tmp_dir()]


def private_dir_problem(path: str) -> str:
    """Why ``path`` is not a directory only we can write ("" when it is): checked on the entry
    itself (lstat), so a symlink to a directory of ours does not pass."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by us (uid {os.getuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return ""


def checked_dir(directory: Optional[str] = None, create: bool = False) -> str:
    """The registry directory, made 0700 first if ``create`` and absent; RegistryError when it
    is not safe to use. Never chmods or takes over what is there: an existing directory that is
    someone else's, a symlink or open to others is refused, and the operator decides."""
    d = directory or registry_dir()
    if create and not os.path.lexists(d):
        parent = os.path.dirname(os.path.abspath(d))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(d, 0o700)  # not exist_ok: one planted meanwhile is checked below like any other
        except FileExistsError:
            pass
    why = private_dir_problem(d)
    if why and not (why == "it does not exist" and not create):
        raise RegistryError(f"registry directory {d}: {why}; pushkv will not read or write records there "
                            "(remove it if it is not yours to use, or set PUSHKV_REGISTRY_DIR to a 0700 "
                            "directory of your own)")
    return d


def run_dir_problem(rec: DeploymentRecord) -> str:
    """Why a record's run dir is not one pushkv would have made for it ("" when it is): an absolute,
    normalised ``.../pushkv-<deployment id>`` that, if present, is a real 0700 directory of ours. Only
    then does cleaning up after the record delete it."""
    rd = rec.run_dir
    if not DEPLOYMENT_ID.fullmatch(rec.deployment_id):
        return f"deployment id {rec.deployment_id!r} is not of pushkv's form"
    if not os.path.isabs(rd) or os.path.normpath(rd) != rd or os.path.basename(rd) != f"pushkv-{rec.deployment_id}":
        return f"run dir {rd!r} is not <root>/pushkv-{rec.deployment_id}"
    if os.path.realpath(os.path.dirname(rd)) != os.path.dirname(rd):
        return f"run dir {rd!r} lies under a symlink"
    if os.path.lexists(rd):
        why = private_dir_problem(rd)
        if why:
            return f"run dir {rd}: {why}"
    return ""


def record_path(deployment_id: str, directory: Optional[str] = None) -> str:
    return os.path.join(directory or registry_dir(), f"{deployment_id}.json")


def write_record(rec: DeploymentRecord, directory: Optional[str] = None) -> str:
    path = record_path(rec.deployment_id, checked_dir(directory, create=True))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(rec))
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def remove_record(deployment_id: str, directory: Optional[str] = None) -> None:
    """Remove the record wherever it was read from (``reading_dirs``; only from a directory that is safely ours)."""
    for d in [directory] if directory else reading_dirs():
        if d != (directory or registry_dir()) and private_dir_problem(d):
            continue
        try:
            os.unlink(record_path(deployment_id, d))
        except FileNotFoundError:
            pass


def list_records(directory: Optional[str] = None) -> list[DeploymentRecord]:
    """The records in ``directory``, else in every directory of ``reading_dirs`` (none where one is absent);
    RegistryError if the registry directory is not ours. /tmp's, read besides, is skipped when it is not ours: it is
    refused as ever where it is the one pushkv up writes."""
    if directory:
        return _records_in(directory)
    dirs = reading_dirs()
    out = _records_in(dirs[0])
    seen = {r.deployment_id for r in out}
    for d in dirs[1:]:
        if os.path.lexists(d) and private_dir_problem(d):
            log.warning("registry directory %s: %s; its records are not read", d, private_dir_problem(d))
            continue
        out += [r for r in _records_in(d) if r.deployment_id not in seen]
    return out


def _records_in(directory: str) -> list[DeploymentRecord]:
    d = checked_dir(directory)
    if not os.path.lexists(d):
        return []
    out = []
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, fn), "rb") as f:
                rec = msgspec.json.decode(f.read(), type=DeploymentRecord)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue  # half-removed or foreign file
        if fn != f"{rec.deployment_id}.json":  # we write each under its own id: this one we did not
            log.warning("registry %s: %s names deployment %r; ignored", d, fn, rec.deployment_id)
            continue
        out.append(rec)
    return out
