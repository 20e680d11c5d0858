"""One small JSON file per running deployment, so ``pushkv status`` / ``stop``
can find supervisors. Directory: $PUSHKV_REGISTRY_DIR, else per user: $XDG_RUNTIME_DIR/pushkv-deployments
or /tmp/pushkv-$UID (made 0700, so one user's records are neither readable nor in the way of another's)."""
from __future__ import annotations

import os
from typing import Optional

import msgspec

from pushkv import envs


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


def registry_dir(environ=os.environ) -> str:
    chosen = envs.get("PUSHKV_REGISTRY_DIR", environ)
    if chosen:
        return chosen
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "pushkv-deployments")
    return f"/tmp/pushkv-{os.getuid()}"


def record_path(deployment_id: str, directory: Optional[str] = None) -> str:
    return os.path.join(directory or registry_dir(), f"{deployment_id}.json")


def write_record(rec: DeploymentRecord, directory: Optional[str] = None) -> str:
    path = record_path(rec.deployment_id, directory)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(rec))
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def remove_record(deployment_id: str, directory: Optional[str] = None) -> None:
    try:
        os.unlink(record_path(deployment_id, directory))
    except FileNotFoundError:
        pass


def list_records(directory: Optional[str] = None) -> list[DeploymentRecord]:
    d = directory or registry_dir()
    if not os.path.isdir(d):
        return []
    out = []
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, fn), "rb") as f:
                out.append(msgspec.json.decode(f.read(), type=DeploymentRecord))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue  # half-removed or foreign file
    return out
