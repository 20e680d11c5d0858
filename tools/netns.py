""""Hosts" on one machine: network namespaces joined by veth pairs on a bridge (root only).

Used by the tests (``tests/support/netns.py`` re-exports it) and by tools that measure between hosts.

    with hosts(3) as net:                   # three namespaces on a fresh bridge
        h1, h2 = net[1], net[2]             # each with one address, e.g. 10.213.57.1/24
        proc = h2.popen([sys.executable, "-m", "some.server", h2.addr])
        h1.run([sys.executable, "-c", "..."])
        h2.cut(); ...; h2.restore()         # its link down, then up again
        h1.cap("1gbit"); h1.uncap()         # what h1 sends goes out at 1 Gbit/s at most (tc tbf)
    # namespaces, veths and the bridge are gone, and so is every process left inside them

The root namespace holds the bridge and the address ``net.root_addr`` (``.254``), so a service in
the root namespace (etcd, a router) is reachable from every host; nothing is routed beyond the
bridge (no forwarding, no default route in the namespaces). Names carry this process's pid and a
counter (``pushkv-<pid>-<k>-h<i>``, ``pkb<pid>k``), so concurrent runs never collide, and
``sweep_stale()`` removes what a dead run left. Cleanup runs however the block ends. A host's
rate cap (``Host.cap``: a tbf qdisc on its end of the veth pair) goes with its namespace.
"""
from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

SUBNET = "10.213"  # 10.213.<X>.0/24, X chosen per run among those unused on this machine
NS_PREFIX = "pushkv-"
LOCK_PATH = "/tmp/pushkv-netns.lock"
_runs = itertools.count()
DEV = "eth0"  # a host's end of its veth pair
# The rate cap (``Host.cap``) is a tbf qdisc on the host's DEV, so it bounds what the host sends.
# burst: the bucket must hold one GSO packet (a veth hands tbf TCP segments of up to 64 KiB;
# tbf would split or drop bigger ones) and 1 ms at the rate, so that a qdisc timer firing late on
# a busy machine costs no rate; a transfer of N bytes takes at least (N - burst) / rate.
# latency: the queue bound (rate x latency bytes, 2.5 MB at 1 Gbit/s). TCP's small-queue limit
# keeps one stream's standing queue far below it (measured over these veths at 1 Gbit/s with
# 5-100 ms: 957-960 Mbit/s, no drops, a 1-byte round trip behind the stream 0.9 ms median),
# so 20 ms only has to absorb bursts of several connections at once without dropping.
CAP_BURST_S = 1e-3
CAP_MIN_BURST_BYTES = 128 << 10
CAP_LATENCY_MS = 20
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> Optional[float]:
    """A rate as tc writes it (``100mbit``, ``1gbit``, ``2.5gbit``) in bits per second; ``none``
    (no cap) is None."""
    if text.strip().lower() == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: want e.g. 100mbit, 1gbit, 10gbit or none")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def cap_burst_bytes(rate_bps: float) -> int:
    return max(int(rate_bps / 8 * CAP_BURST_S), CAP_MIN_BURST_BYTES)


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], check=check, capture_output=True, text=True, timeout=20)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


@dataclass
class Host:
    index: int
    ns: str  # the namespace's name
    addr: str  # its address on the bridge
    veth: str  # the root side of its veth pair (what cut/restore flip)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kw)

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kw)

    def cut(self) -> None:
        """Take this host off the network (its veth down: no carrier on either end)."""
        ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        ip("link", "set", self.veth, "up")

    def cap(self, rate: str) -> None:
        """Let this host send at most ``rate`` (tc syntax, e.g. ``1gbit``; ``none`` removes the
        cap): a tbf qdisc at the root of its ``eth0`` (burst and queue bound: see CAP_*)."""
        bps = parse_rate(rate)
        if bps is None:
            self.uncap()
            return
        tc("-n", self.ns, "qdisc", "replace", "dev", DEV, "root", "tbf", "rate", f"{int(bps)}bit",
           "burst", str(cap_burst_bytes(bps)), "latency", f"{CAP_LATENCY_MS}ms")

    def uncap(self) -> None:
        tc("-n", self.ns, "qdisc", "del", "dev", DEV, "root", check=False)  # none there: fine

    def qdisc(self) -> dict:
        """The root qdisc of ``eth0`` with its counters (tc's JSON: kind, options.rate in bytes/s,
        bytes, packets, drops, ...); ``kind`` is ``noqueue`` when no cap is set."""
        got = json.loads(tc("-n", self.ns, "-s", "-j", "qdisc", "show", "dev", DEV).stdout or "[]")
        return next((q for q in got if q.get("root")), {"kind": "none"})

    def pids(self) -> list[int]:
        got = ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in got.stdout.split()]


@dataclass
class Network:
    tag: str  # "<pid>-<k>": in every name this run made
    bridge: str
    subnet: str  # "10.213.X"
    hosts: dict[int, Host] = field(default_factory=dict)

    @property
    def root_addr(self) -> str:
        return f"{self.subnet}.254"

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts.values())


def _used_subnets() -> set[str]:
    out = ip("-4", "addr", "show").stdout + ip("-4", "route", "show").stdout
    return set(re.findall(rf"\b({re.escape(SUBNET)}\.\d+)\.\d+", out))


def _pick_subnet(seed: int) -> str:
    used = _used_subnets()
    for k in range(254):
        cand = f"{SUBNET}.{(seed + k) % 254 + 1}"
        if cand not in used:
            return cand
    raise RuntimeError(f"every {SUBNET}.X.0/24 is in use on this machine")


def _kill_inside(ns: str) -> None:
    """SIGKILL what is still running inside one of our namespaces (processes this run started)."""
    for pid in [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove(tag: str) -> None:
    """Remove every namespace, veth and bridge carrying ``tag``; idempotent."""
    for ns in list_namespaces(tag):
        _kill_inside(ns)
        ip("netns", "del", ns, check=False)  # takes the namespace's veth end, hence the pair
    for link in list_links(tag):
        ip("link", "del", link, check=False)


def list_namespaces(tag: str = "") -> list[str]:
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{NS_PREFIX}{tag}")]


def _link_names(tag: str) -> tuple[str, ...]:
    pid, _, k = tag.partition("-")
    return (f"pkb{pid}{k}", f"pk{pid}{k}v")


def list_links(tag: str) -> list[str]:
    """Our bridge and root-side veths for ``tag`` (they are named from its pid and counter)."""
    bridge, veth = _link_names(tag)
    out = ip("-o", "link", "show").stdout
    names = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", out, re.M)]
    return [n for n in names if n == bridge or re.fullmatch(rf"{re.escape(veth)}\d+", n)]


def leftovers(tag: str) -> list[str]:
    return list_namespaces(tag) + list_links(tag)


def sweep_stale() -> None:
    """Remove namespaces (and their links) left by runs whose process is gone."""
    for ns in list_namespaces():
        m = re.match(rf"{NS_PREFIX}(\d+)-(\d+)-h\d+$", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            remove(f"{m.group(1)}-{m.group(2)}")


def make(n: int) -> Network:
    """Make ``n`` hosts (1..n) on a new bridge; on any failure what was made is removed."""
    if os.geteuid() != 0:
        raise PermissionError("network-namespace hosts need root (ip netns, veth, bridge)")
    k = next(_runs)
    tag = f"{os.getpid()}-{k}"
    bridge, veth_prefix = _link_names(tag)
    if len(bridge) > 15 or len(f"{veth_prefix}{n}") > 15:
        raise RuntimeError(f"interface names too long for pid {os.getpid()}")
    sweep_stale()
    try:
        with open(LOCK_PATH, "a") as lock:  # one run at a time picks a subnet and claims it
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = _pick_subnet(os.getpid() * 7 + k)
            net = Network(tag, bridge, subnet)
            ip("link", "add", bridge, "type", "bridge")
            ip("addr", "add", f"{net.root_addr}/24", "dev", bridge)
            ip("link", "set", bridge, "up")
        for i in range(1, n + 1):
            h = Host(i, f"{NS_PREFIX}{tag}-h{i}", f"{subnet}.{i}", f"{veth_prefix}{i}")
            ip("netns", "add", h.ns)
            ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            ip("link", "set", h.veth, "master", bridge, "up")
            ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            ip("-n", h.ns, "link", "set", "eth0", "up")
            ip("-n", h.ns, "link", "set", "lo", "up")
            net.hosts[i] = h
    except BaseException:
        remove(tag)
        raise
    return net


@contextmanager
def hosts(n: int):
    """``n`` namespace hosts for the block; always removed afterwards (processes inside too)."""
    net: Optional[Network] = None
    try:
        net = make(n)
        yield net
    finally:
        if net is not None:
            remove(net.tag)
