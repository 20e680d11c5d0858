"""The pure half of the etcd registry: the URL, the key layout, and the watcher's view.

Nothing here does I/O or reads a clock; ``etcd.py`` is the I/O around it. Keys under the
deployment's prefix (default ``/pushkv``):

- ``<prefix>/instances/<role>/<engine_id>``: the InstanceRecord (JSON), under the announcing
  supervisor's lease, so it vanishes when that lease lapses;
- ``<prefix>/withdrawn/<lease-id hex>``: the announcer's withdrawal marker, a JSON list of
  ``"<role>/<engine_id>"`` written in the same transaction as the deletes of a withdrawal.

etcd reports a key removed by lease expiry and one removed by a delete the same way (a DELETE
event). The marker tells them apart: a DELETE of an instance key whose revision also holds a
marker naming it is "withdrawn"; one without is "lease expired" when its lease is gone and
"deleted" when the lease still lives (someone removed the key by hand). etcd never splits one
revision's events across watch responses, so the view decides per response.
"""
from __future__ import annotations

import base64
import json
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec

from pushkv.discovery.records import DiscoveryEvent, InstanceDown, InstanceRecord, InstanceUp, decode_record

DEFAULT_PREFIX = "/pushkv"
DEFAULT_PORT = 2379
REASON_WITHDRAWN = "withdrawn"
REASON_LEASE = "lease expired"
REASON_DELETED = "deleted"  # removed by hand while its lease still lives
REASON_MISSED = "gone while the watch was down"
REASON_BAD = "unreadable record"


class RegistryURLError(ValueError):
    pass


@dataclass(frozen=True)
class EtcdTarget:
    """Where the registry is and who we are to it: ``etcd://[user:password@]HOST:PORT[/prefix]``,
    or ``etcds://`` for TLS. Query options: ``ca=FILE`` (CA bundle for etcds), ``cert=FILE`` and
    ``key=FILE`` (client certificate), ``password_file=FILE`` (the password, instead of in the URL),
    ``user=NAME``."""

    host: str
    port: int = DEFAULT_PORT
    prefix: str = DEFAULT_PREFIX
    tls: bool = False
    user: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def redacted(self) -> str:
        cred = f"{self.user}:***@" if self.user else ""
        return f"{'etcds' if self.tls else 'etcd'}://{cred}{self.host}:{self.port}{self.prefix}"


def parse_registry_url(url: str, read_file=None) -> EtcdTarget:
    """Parse a registry URL; ``read_file(path) -> str`` reads ``password_file`` (default: open)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("etcd", "etcds"):
        raise RegistryURLError(f"registry URL must start with etcd:// or etcds://, got {url!r}")
    if not u.hostname:
        raise RegistryURLError(f"registry URL names no host: {url!r}")
    try:
        port = u.port or DEFAULT_PORT
    except ValueError:
        raise RegistryURLError(f"registry URL has a bad port: {url!r}") from None
    opts = dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True))
    known = {"ca", "cert", "key", "password_file", "user"}
    if set(opts) - known:
        raise RegistryURLError(f"unknown registry URL option(s) {sorted(set(opts) - known)}; "
                               f"known: {sorted(known)}")
    prefix = u.path.rstrip("/") or DEFAULT_PREFIX
    user = urllib.parse.unquote(u.username or "") or opts.get("user", "")
    password = urllib.parse.unquote(u.password or "")
    if "password_file" in opts:
        read = read_file or (lambda p: open(os.path.expanduser(p)).read())
        password = read(opts["password_file"]).strip()
    if password and not user:
        raise RegistryURLError("registry URL gives a password but no user")
    if u.scheme == "etcd" and ({"ca", "cert", "key"} & set(opts)):
        raise RegistryURLError("ca/cert/key need an etcds:// (TLS) registry URL")
    return EtcdTarget(host=u.hostname, port=port, prefix=prefix, tls=u.scheme == "etcds",
                      user=user, password=password, ca_file=opts.get("ca", ""),
                      cert_file=opts.get("cert", ""), key_file=opts.get("key", ""))


# -- keys ------------------------------------------------------------------------------

def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(data: str) -> bytes:
    return base64.b64decode(data or "")


def range_end(prefix: str | bytes) -> str:
    """etcd's range_end for "every key starting with prefix" (prefix + 1 in its last byte)."""
    end = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b64(b"\0")  # every key
    end[-1] += 1
    return b64(bytes(end))


def instances_prefix(prefix: str) -> str:
    return f"{prefix}/instances/"


def instance_key(prefix: str, role: str, engine_id: str) -> str:
    return f"{prefix}/instances/{role}/{engine_id}"


def marker_key(prefix: str, lease_id: int) -> str:
    return f"{prefix}/withdrawn/{lease_id:x}"


def marker_value(names: Iterable[tuple[str, str]]) -> str:
    return json.dumps([f"{role}/{engine_id}" for role, engine_id in names])


def split_instance_key(prefix: str, key: str) -> Optional[tuple[str, str]]:
    """(role, engine_id) of an instance key, None for any other key."""
    head = instances_prefix(prefix)
    if not key.startswith(head):
        return None
    role, _, engine_id = key[len(head):].partition("/")
    return (role, engine_id) if role and engine_id and "/" not in engine_id else None


# -- the watcher's view ----------------------------------------------------------------------

@dataclass(frozen=True)
class Deleted:
    """One instance key's DELETE that needs its lease checked before it has a reason."""
    role: str
    engine_id: str
    lease_id: int


class RegistryView:
    """The instances as the watcher last saw them; turns ranges and watch responses into
    InstanceUp/InstanceDown. An Up repeats only when a record changes (a re-announce)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.records: dict[tuple[str, str], InstanceRecord] = {}
        self.revision = 0  # the last revision applied
        self.unreadable = 0  # records that did not decode (counted, skipped)

    def _decode(self, value_b64: str) -> Optional[InstanceRecord]:
        try:
            return decode_record(unb64(value_b64))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self.unreadable += 1
            return None

    def load(self, kvs: list[dict], revision: int) -> list[DiscoveryEvent]:
        """A range over the instances (the first snapshot, or a resync after the watch was
        down): Up for what is new or changed, Down for what is gone."""
        fresh: dict[tuple[str, str], InstanceRecord] = {}
        for kv in kvs:
            name = split_instance_key(self.prefix, unb64(kv.get("key", "")).decode(errors="replace"))
            rec = self._decode(kv.get("value", "")) if name else None
            if name is not None and rec is not None:
                fresh[name] = rec
        out: list[DiscoveryEvent] = [InstanceDown(eid, role, REASON_MISSED)
                                     for (role, eid) in self.records if (role, eid) not in fresh]
        out += [InstanceUp(rec) for name, rec in fresh.items() if self.records.get(name) != rec]
        self.records = fresh
        self.revision = max(self.revision, revision)
        return out

    def unexplained_deletes(self, events: list[dict]) -> list[Deleted]:
        """The DELETEs in one watch response that no withdrawal marker explains: the I/O side
        asks etcd whether each one's lease still lives, then calls ``apply``."""
        marked = self._marked(events)
        out = []
        for ev in events:
            if ev.get("type") != "DELETE":
                continue
            name = split_instance_key(self.prefix, unb64(ev["kv"]["key"]).decode(errors="replace"))
            lease = int((ev.get("prev_kv") or {}).get("lease", 0) or 0)
            if name and name in self.records and name not in marked and lease:
                out.append(Deleted(name[0], name[1], lease))
        return out

    def _marked(self, events: list[dict]) -> set[tuple[str, str]]:
        head = f"{self.prefix}/withdrawn/"
        marked: set[tuple[str, str]] = set()
        for ev in events:
            if ev.get("type", "PUT") != "PUT":
                continue
            if not unb64(ev["kv"]["key"]).decode(errors="replace").startswith(head):
                continue
            try:
                names = json.loads(unb64(ev["kv"].get("value", "")))
            except ValueError:
                continue
            for n in names if isinstance(names, list) else []:
                role, _, eid = str(n).partition("/")
                marked.add((role, eid))
        return marked

    def apply(self, events: list[dict], revision: int,
              live_leases: frozenset[int] = frozenset()) -> list[DiscoveryEvent]:
        """One watch response's events (etcd's JSON, PUT's ``type`` omitted) at ``revision``;
        ``live_leases``: leases of unexplained deletes that still live (so "deleted")."""
        marked = self._marked(events)
        out: list[DiscoveryEvent] = []
        for ev in events:
            kv = ev.get("kv") or {}
            name = split_instance_key(self.prefix, unb64(kv.get("key", "")).decode(errors="replace"))
            if name is None:
                continue
            if ev.get("type", "PUT") == "PUT":
                rec = self._decode(kv.get("value", ""))
                if rec is None or self.records.get(name) == rec:
                    continue
                self.records[name] = rec
                out.append(InstanceUp(rec))
            elif self.records.pop(name, None) is not None:
                if name in marked:
                    reason = REASON_WITHDRAWN
                else:
                    lease = int((ev.get("prev_kv") or {}).get("lease", 0) or 0)
                    reason = REASON_DELETED if not lease or lease in live_leases else REASON_LEASE
                out.append(InstanceDown(name[1], name[0], reason))
        self.revision = max(self.revision, revision)
        return out
