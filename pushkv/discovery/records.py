"""What the registry holds about one instance, and what a watcher sees change."""
from __future__ import annotations

from typing import Union

import msgspec


class InstanceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One P or D instance as its supervisor announces it (JSON in etcd, under
    ``<prefix>/instances/<role>/<engine_id>``)."""

    engine_id: str  # unique per instance incarnation of a deployment
    role: str  # "prefill" | "decode"
    sched_endpoint: str  # the scheduler's ROUTER: where the router's DEALER connects
    handshake_endpoints: tuple[str, ...]  # one per writer rank: where peer writers connect
    tp: int = 1
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 0
    host: str = ""  # advertised address of the instance's host
    supervisor_pid: int = 0
    started_unix: float = 0.0
    # its host is stopping with --shutdown-timeout: the router chooses it for no new request, and its requests in
    # flight go on until the host leaves the registry (appended with a default: a reader without it ignores it)
    draining: bool = False


class InstanceUp(msgspec.Struct, frozen=True):
    record: InstanceRecord


class InstanceDown(msgspec.Struct, frozen=True):
    engine_id: str
    role: str
    reason: str  # "lease expired", "withdrawn", "deleted", "process exited: ...", ...


class InstanceHealth(msgspec.Struct, frozen=True):
    """One of the instance's processes stopped answering its supervisor's pings (``healthy`` false: hung, not
    dead), or every such process answers again."""

    engine_id: str
    role: str
    healthy: bool
    reason: str


DiscoveryEvent = Union[InstanceUp, InstanceDown, InstanceHealth]

encode_record = msgspec.json.Encoder().encode
decode_record = msgspec.json.Decoder(InstanceRecord).decode
