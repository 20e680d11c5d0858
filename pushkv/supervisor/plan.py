"""Deployment planning: ids, run dir, endpoints, and the list of processes.

Pure apart from picking free TCP ports; the port picker is injectable so
tests get deterministic plans.
"""
from __future__ import annotations

import os
import random
import socket
import sys
from typing import Callable, Iterable, Iterator, Optional

import msgspec

from pushkv.config import TRACE_AUTO, DeploymentConfig, InstanceConfig, ipc, new_deployment_id
from pushkv.kv.layout import plan_transfer
from pushkv.protocol import kv_events
from pushkv.supervisor.geometry import check_deployment

RUN_ROOT = "/tmp"
LOOPBACK = "127.0.0.1"
# TRACE_AUTO (config.py): the trace_endpoint placeholder, an ipc socket in run_dir.
# Tracing on: processes PUB to trace_endpoint, the supervisor forwards to
# trace_tap_endpoint, where taps SUB (pushkv.trace.TraceForwarder).

# Start stages: every process of a stage is ready before the next stage starts.
# A worker maps the pool its writer owns, a scheduler talks to ready workers
# and writers, the router to ready schedulers.
KIND_STAGE = {"writer": 0, "worker": 1, "scheduler": 2, "router": 3}

PortPicker = Callable[[], int]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_tcp_port(host: str = LOOPBACK) -> int:
    """A port that is free now and *below the kernel's ephemeral range*.

    A port taken by binding to 0 comes from the ephemeral range, where any
    outgoing connection (HTTP clients, ZMQ, UCX) may take it as its source
    port in the seconds before our process listens on it (seen here: a TP
    rank's TCPStore failing with EADDRINUSE). Ports below the range are only
    ever taken by explicit binds.
    """
    lo, _ = _ephemeral_range()
    if lo > 12000:
        for _ in range(200):
            port = random.randint(10000, lo - 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _unique_ports(pick: PortPicker, taken: Iterable[int] = ()) -> Iterator[int]:
    """Ports from pick, never one twice and never one in taken (the router's port: it
    is probed free now but only bound later, so a planned TCPStore could take it first)."""
    seen: set[int] = set(taken)
    while True:
        port = pick()
        if port in seen:  # the kernel may hand back a just-closed port
            continue
        seen.add(port)
        yield port


def _plan_instance(inst: InstanceConfig, dep_id: str, run_dir: str, ports: Iterator[int],
                   advertise: str = "") -> InstanceConfig:
    """``advertise``: this host's address for other hosts (``pushkv up --role``): the router's
    way in (the scheduler's ROUTER) and the writers' handshakes are tcp:// on it, and the engine
    id names the host; the sockets inside the instance stay ipc://. On one host every socket is
    ipc:// in the run dir (0700), the handshakes included."""
    role, tp, name = inst.role, inst.tp, inst.name
    if tp < 1:
        raise ValueError(f"{role}: tp must be >= 1, got {tp}")

    def per_rank(given: tuple[str, ...], make: Callable[[int], str], what: str) -> tuple[str, ...]:
        if given:
            if len(given) != tp:
                raise ValueError(f"{role}: {len(given)} {what} for tp={tp}")
            return given
        return tuple(make(r) for r in range(tp))

    dist_init = inst.dist_init
    if not dist_init and tp > 1:
        dist_init = f"tcp://{LOOPBACK}:{next(ports)}"
    return msgspec.structs.replace(
        inst,
        engine_id=inst.engine_id or (f"{name}-{advertise}-{dep_id}" if advertise else f"{name}-{dep_id}"),
        sched_endpoint=inst.sched_endpoint or (
            f"tcp://{advertise}:{next(ports)}" if advertise else ipc(run_dir, f"{name}-scheduler.sock")),
        worker_endpoints=per_rank(inst.worker_endpoints, lambda r: ipc(run_dir, f"{name}-worker-{r}.sock"),
                                  "worker endpoints"),
        writer_endpoints=per_rank(inst.writer_endpoints, lambda r: ipc(run_dir, f"{name}-writer-{r}.sock"),
                                  "writer endpoints"),
        # one host: ipc in the 0700 run dir, so no other uid can reach the Hello (NIXL metadata,
        # pool base) without a secret; several hosts: tcp on advertise, under CURVE (--secret-file)
        handshake_endpoints=per_rank(
            inst.handshake_endpoints,
            lambda r: f"tcp://{advertise}:{next(ports)}" if advertise else ipc(run_dir, f"{name}-handshake-{r}.sock"),
            "handshake endpoints",
        ),
        dist_init=dist_init,
        metrics_port=inst.metrics_port or next(ports),
    )


def instance_copies(template: InstanceConfig, count: int, first_gpu: int) -> list[InstanceConfig]:
    """``count`` instances of one role from its template: instance i gets index i, and on CUDA
    the GPUs after the previous instance's (its TP ranks take consecutive GPUs from
    ``first_gpu``). Endpoints and engine ids a config file pinned hold for the first only."""
    if count < 1:
        raise ValueError(f"{template.role}: at least one instance, got {count}")
    out = [template]
    for i in range(1, count):
        dev = template.device if template.device == "cpu" else f"cuda:{first_gpu + i * template.tp}"
        out.append(msgspec.structs.replace(
            template, index=i, device=dev, engine_id="", sched_endpoint="", worker_endpoints=(),
            writer_endpoints=(), handshake_endpoints=(), dist_init="",
            metrics_port=template.metrics_port + i if template.metrics_port else 0))
    return out


def _gpu_base(inst: InstanceConfig) -> int:
    return int(inst.device.split(":")[1]) if ":" in inst.device else 0


def plan_deployment(
    cfg: DeploymentConfig, pick_port: PortPicker = free_tcp_port, run_root: str = RUN_ROOT
) -> DeploymentConfig:
    """Fill every id, directory and endpoint left empty in ``cfg``.

    Fields already set are kept (a config file may pin them), except the transfer plan, which is
    decided here from the user's fields (``kv.layout.plan_transfer``). Only the
    instances the mode uses are planned; with ``prefill_instances`` /
    ``decode_instances`` above 1, ``prefills`` / ``decodes`` hold every one
    (the first is also ``prefill`` / ``decode``). A value outside a field's closed set (a mode,
    a switch) never gets here: the config refuses it when built or decoded.
    """
    if cfg.host_role and (not cfg.registry or cfg.mode == "local"):
        raise ValueError("--role needs --registry etcd://HOST:PORT and --mode push or pull")
    if cfg.host_role in ("prefill", "decode") and not cfg.advertise:
        raise ValueError(f"--role {cfg.host_role} needs --advertise ADDR (this host's address for the others)")
    if cfg.registry_ttl_s < 1:
        raise ValueError(f"registry TTL must be >= 1 s, got {cfg.registry_ttl_s}")
    if cfg.mode == "local" and (cfg.prefill_instances, cfg.decode_instances) != (1, 1):
        raise ValueError("--prefill-instances / --decode-instances need --mode push or pull")
    if cfg.push_stream_groups < 1:
        raise ValueError(f"push stream groups must be >= 1, got {cfg.push_stream_groups}")
    for inst in (cfg.prefill, cfg.decode, cfg.local):
        if inst.prefill_chunk < 0:
            raise ValueError(f"prefill chunk must be >= 0 tokens, got {inst.prefill_chunk}")
        for name in ("max_num_seqs", "max_batch_tokens"):  # vLLM refuses 0 so: it would start and never run a request
            if getattr(inst, name) < 1:
                raise ValueError(f"{inst.role} instance: {name} (--{name.replace('_', '-')}) must be >= 1, "
                                 f"got {getattr(inst, name)}")
        if inst.max_batch_tokens < inst.max_num_seqs:  # vLLM's SchedulerConfig refuses it, chunked prefill or not
            raise ValueError(f"{inst.role} instance: max_batch_tokens (--max-batch-tokens, vLLM's "
                             f"--max-num-batched-tokens) ({inst.max_batch_tokens}) must be greater than or equal to "
                             f"max_num_seqs (--max-num-seqs) ({inst.max_num_seqs}), as vLLM's: a step holds a token of "
                             f"each sequence it runs")
    if cfg.timeouts.lease_max_s < cfg.timeouts.lease_s:
        raise ValueError(f"lease_max_s ({cfg.timeouts.lease_max_s}) must be >= lease_s ({cfg.timeouts.lease_s})")
    if cfg.router_queue < 0:
        raise ValueError(f"router_queue must be >= 0, got {cfg.router_queue}")
    if cfg.router_max_in_flight < 1:
        raise ValueError(f"router_max_in_flight must be >= 1, got {cfg.router_max_in_flight}")
    # what the transfers do, decided here once for every process (never kept from a config file: it
    # follows from the flags above, which a pinned copy might not)
    cfg = msgspec.structs.replace(cfg, transfer=plan_transfer(cfg))
    check_deployment(cfg)  # P/D geometry: refuse before any process starts
    cfg = _fixed_metrics_ports(cfg)
    if clash := port_clash(cfg):
        raise ValueError(clash)
    dep_id = cfg.deployment_id or new_deployment_id()
    run_dir = cfg.run_dir or os.path.join(run_root, f"pushkv-{dep_id}")
    ports = _unique_ports(pick_port, (cfg.port, *(port for _, port in fixed_ports(cfg))))
    changes: dict = {
        "deployment_id": dep_id,
        "run_dir": run_dir,
        "control_endpoint": cfg.control_endpoint or ipc(run_dir, "control.sock"),
        "events_endpoint": cfg.events_endpoint or ipc(run_dir, "events.sock"),
    }
    if cfg.trace_endpoint == TRACE_AUTO or (cfg.trace_tap_endpoint and not cfg.trace_endpoint):
        changes["trace_endpoint"] = ipc(run_dir, "trace.sock")
    if (cfg.trace_endpoint or cfg.trace_tap_endpoint) and not cfg.trace_tap_endpoint:
        changes["trace_tap_endpoint"] = ipc(run_dir, "trace-tap.sock")
    if cfg.mode == "local":
        changes["local"] = _plan_instance(cfg.local, dep_id, run_dir, ports)
        return msgspec.structs.replace(cfg, **changes)
    if cfg.host_role:  # one part of a deployment over several hosts
        return msgspec.structs.replace(cfg, **changes, **_plan_host(cfg, dep_id, run_dir, ports))
    p, d = cfg.prefill, cfg.decode
    several = cfg.prefill_instances > 1 or cfg.decode_instances > 1
    if several and d.device != "cpu" and d.device == p.device:
        # one --device for both roles: D's instances take the GPUs after the last P instance's
        d = msgspec.structs.replace(d, device=f"cuda:{_gpu_base(p) + cfg.prefill_instances * p.tp}")
    d_first = _gpu_base(d)
    prefills = tuple(_plan_instance(i, dep_id, run_dir, ports)
                     for i in instance_copies(p, cfg.prefill_instances, _gpu_base(p)))
    decodes = tuple(_plan_instance(i, dep_id, run_dir, ports)
                    for i in instance_copies(d, cfg.decode_instances, d_first))
    changes.update(prefill=prefills[0], decode=decodes[0])
    if len(prefills) > 1 or len(decodes) > 1:
        changes.update(prefills=prefills, decodes=decodes)
    return msgspec.structs.replace(cfg, **changes)


def _fixed_metrics_ports(cfg: DeploymentConfig) -> DeploymentConfig:
    """--metrics-port N: the first instance planned takes N, each next one the port after (P's
    instances, then D's; the copies of a template add their index, ``instance_copies``)."""
    base = cfg.metrics_port
    if not base:
        return cfg
    if cfg.mode == "local":
        return msgspec.structs.replace(cfg, local=msgspec.structs.replace(cfg.local, metrics_port=base))
    p_count = cfg.prefill_instances if cfg.host_role in ("", "prefill") else 0
    p_port, d_port = base, base + p_count
    return msgspec.structs.replace(cfg, prefill=msgspec.structs.replace(cfg.prefill, metrics_port=p_port),
                                   decode=msgspec.structs.replace(cfg.decode, metrics_port=d_port))


def instances_here(cfg: DeploymentConfig) -> int:
    """How many P / D / local instances this host runs (each takes the next port, or the next ``_N`` ipc name)."""
    return 1 if cfg.mode == "local" else (
        (cfg.prefill_instances if cfg.host_role in ("", "prefill") else 0)
        + (cfg.decode_instances if cfg.host_role in ("", "decode") else 0))


def _port_ranges(cfg: DeploymentConfig) -> list[tuple[str, str, int, int]]:
    """(flag, what it sets, first port, how many) of each TCP port range the user fixed that this host will bind:
    the router's --port (not with --uds), the instances' --metrics-port range, and their KV-event sockets where bound
    on TCP (each instance the port after the one before it)."""
    out: list[tuple[str, str, int, int]] = []
    if cfg.host_role in ("", "router") and not cfg.uds:  # (with --uds the router binds its socket file, no port)
        out.append(("--port", "--port", cfg.port, 1))
    n = instances_here(cfg)
    if cfg.metrics_port and cfg.host_role != "router":
        out.append(("--metrics-port", "--metrics-port", cfg.metrics_port, n))
    ev = cfg.kv_events
    if ev.on and cfg.host_role != "router":
        for name, ep in (("endpoint", ev.endpoint), ("replay_endpoint", ev.replay_endpoint)):
            port = int(ep.rsplit(":", 1)[1]) if ep and ep.startswith("tcp://") and kv_events.binds(ep) else 0
            if port:  # (port 0: each instance binds one the system picks)
                out.append(("--kv-events-config", f"--kv-events-config {name}", port, n))
    return out


def fixed_ports(cfg: DeploymentConfig) -> list[tuple[str, int]]:
    """The TCP ports the user fixed that this host will bind, with the flag that sets each:
    the router's --port, the instances' --metrics-port range and their KV-event sockets. Free ports the planner
    picks are not here (it only picks free ones)."""
    return [(flag, first + i) for flag, _, first, n in _port_ranges(cfg) for i in range(n)]


def port_clash(cfg: DeploymentConfig) -> str:
    """Why two of the port ranges the user fixed share a port ("" where none do): with several instances each takes
    the port after the one before it, so a KV-event endpoint and its replay endpoint one apart (5557 and 5558) meet
    at the second instance, whose scheduler then fails to bind only once every model has loaded."""
    ranges = _port_ranges(cfg)
    for i, (_, what, first, n) in enumerate(ranges):
        for _, other, first2, n2 in ranges[:i]:
            both = range(max(first, first2), min(first + n, first2 + n2))
            if both:
                def span(a: int, k: int) -> str:
                    return f"port {a}" if k == 1 else f"ports {a}..{a + k - 1}"
                return (f"{what} takes {span(first, n)} and {other} {span(first2, n2)} on this host "
                        f"(one port per instance, each the one after the one before); both want {both[0]}: "
                        f"give them ranges that do not meet")
    return ""


def _plan_host(cfg: DeploymentConfig, dep_id: str, run_dir: str, ports: Iterator[int]) -> dict:
    """A router host plans no instance; a P or D host plans only its role's, reachable on
    ``advertise`` (the other role's template stays unplanned: those instances are other hosts',
    found through the registry)."""
    role = cfg.host_role
    if role not in ("prefill", "decode"):  # the router's host
        return {}
    template = cfg.instance(role)
    count = cfg.prefill_instances if role == "prefill" else cfg.decode_instances
    planned = tuple(_plan_instance(i, dep_id, run_dir, ports, cfg.advertise)
                    for i in instance_copies(template, count, _gpu_base(template)))
    out: dict[str, object] = {role: planned[0]}
    if len(planned) > 1:
        out[role + "s"] = planned
    return out


class ProcessSpec(msgspec.Struct, frozen=True):
    name: str  # "prefill-writer-0", "local-scheduler", "router"
    kind: str  # "writer" | "worker" | "scheduler" | "router"
    role: str  # "prefill" | "decode" | "local" | "" (router)
    rank: int  # TP rank; 0 for scheduler and router
    argv: tuple[str, ...]
    stage: int  # start stage (KIND_STAGE)
    instance: int = 0  # index of the instance of its role

    @property
    def instance_name(self) -> str:
        """``prefill``, ``prefill1``, ... (InstanceConfig.name); "" for the router."""
        return self.role if self.instance == 0 else f"{self.role}{self.instance}"


def config_path(cfg: DeploymentConfig) -> str:
    return os.path.join(cfg.run_dir, "config.json")


def child_argv(kind: str, config_file: str, role: Optional[str] = None, rank: int = 0,
               instance: int = 0) -> tuple[str, ...]:
    argv = [sys.executable, "-m", f"processes.{kind}", "--config", config_file]
    if role is not None:
        argv += ["--role", role, "--rank", str(rank)]
    if instance:
        argv += ["--instance", str(instance)]
    return tuple(argv)


def process_specs(cfg: DeploymentConfig) -> list[ProcessSpec]:
    """Every child of a planned deployment, in start order."""
    if not cfg.run_dir:
        raise ValueError("process_specs needs a planned config (run_dir is empty)")
    path = config_path(cfg)
    specs: list[ProcessSpec] = []
    for inst in cfg.instances():
        role, name, idx = inst.role, inst.name, inst.index
        for kind in ("writer", "worker"):
            for r in range(inst.tp):
                specs.append(ProcessSpec(
                    name=f"{name}-{kind}-{r}", kind=kind, role=role, rank=r,
                    argv=child_argv(kind, path, role, r, idx), stage=KIND_STAGE[kind], instance=idx,
                ))
        specs.append(ProcessSpec(
            name=f"{name}-scheduler", kind="scheduler", role=role, rank=0,
            argv=child_argv("scheduler", path, role, 0, idx), stage=KIND_STAGE["scheduler"], instance=idx,
        ))
    if cfg.host_role in ("", "router"):
        specs.append(ProcessSpec(
            name="router", kind="router", role="", rank=0,
            argv=child_argv("router", path), stage=KIND_STAGE["router"],
        ))
    return specs


def event_topic(spec: ProcessSpec, event: str) -> str:
    """``prefill-writer-0`` + ``exit`` -> ``pushkv.prefill.writer.exit`` (the rank is in
    the payload); the router, which has no role, -> ``pushkv.router.exit``."""
    head = f"{spec.role}.{spec.kind}" if spec.role else spec.kind
    return f"pushkv.{head}.{event}"
