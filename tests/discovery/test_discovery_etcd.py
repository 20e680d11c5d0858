"""The etcd registry against a real etcd (tests/support/etcd_server.py), plus tables for its pure half."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pushkv.discovery import etcd_keys as K
from pushkv.discovery.etcd import (EtcdAnnouncer, EtcdAuthError, EtcdUnavailable, EtcdWatcher, SyncGateway,
                                   check_readable, retry_delay_s, target_of)
from pushkv.discovery.records import InstanceDown, InstanceRecord, InstanceUp, encode_record
from tests.support.etcd_server import etcd_server, free_port, make_tls
from tests.support import ROOT

pytestmark = pytest.mark.unit  # a real etcd and stand-in announcer processes, no pushkv deployment

TTL_S = 2  # etcd's smallest lease TTL with its default election timeout
EVENT_TIMEOUT_S = 10.0


# -- pure: URLs ------------------------------------------------------------------------

@pytest.mark.parametrize("url, want", [
    ("etcd://h:1", K.EtcdTarget("h", 1, "/pushkv")),
    ("etcd://h", K.EtcdTarget("h", 2379, "/pushkv")),
    ("etcd://u:p%40ss@h:1/dep/a/", K.EtcdTarget("h", 1, "/dep/a", user="u", password="p@ss")),
    ("etcds://u:p@h:1?ca=/ca.pem", K.EtcdTarget("h", 1, "/pushkv", tls=True, user="u", password="p",
                                                 ca_file="/ca.pem")),
    ("etcd://h:1?user=u&password_file=/pw", K.EtcdTarget("h", 1, user="u", password="from-file")),
    ("etcd://[::1]:7", K.EtcdTarget("::1", 7)),
])
def test_registry_url(url, want):
    assert K.parse_registry_url(url, read_file=lambda p: "from-file\n") == want


@pytest.mark.parametrize("url, fragment", [
    ("http://h:1", "etcd:// or etcds://"),
    ("etcd://:1", "no host"),
    ("etcd://h:x", "bad port"),
    ("etcd://h:1?bogus=1", "unknown registry URL option"),
    ("etcd://h:1?ca=/x", "need an etcds://"),
])
def test_registry_url_refused(url, fragment):
    with pytest.raises(K.RegistryURLError, match=fragment):
        K.parse_registry_url(url)


def test_target_redacts_password():
    t = K.parse_registry_url("etcd://u:secret@h:1/x")
    assert "secret" not in repr(t) and "secret" not in t.redacted()
    assert t.base_url == "http://h:1" and K.parse_registry_url("etcds://[::1]:2").base_url == "https://[::1]:2"


@pytest.mark.parametrize("prefix, end", [("/a/", b"/a0"), ("a", b"b"), (b"a\xff", b"b"), (b"\xff", b"\0")])
def test_range_end(prefix, end):
    assert K.unb64(K.range_end(prefix)) == end


@pytest.mark.parametrize("failures, retry_s, ttl_s, want", [
    (1, 0.5, 6, 0.5), (2, 0.5, 6, 1.0), (3, 0.5, 6, 2.0), (4, 0.5, 6, 2.0), (50, 0.5, 6, 2.0),
    (1, 0.5, 1, 0.5),  # a TTL shorter than 3 retries: never below retry_s
    (0, 0.2, 2, 0.2),
])
def test_retry_delay(failures, retry_s, ttl_s, want):
    assert retry_delay_s(failures, retry_s, ttl_s) == pytest.approx(want)


# -- pure: the view ------------------------------------------------------------------------

def rec(eid: str, role: str = "decode", **kw) -> InstanceRecord:
    return InstanceRecord(engine_id=eid, role=role, sched_endpoint="tcp://h:1",
                          handshake_endpoints=("tcp://h:2",), **kw)


def kv(key: str, value: bytes = b"", lease: int = 0, rev: int = 1) -> dict:
    return {"key": K.b64(key), "value": K.b64(value), "lease": str(lease), "mod_revision": str(rev)}


def put(r: InstanceRecord, lease: int = 7, rev: int = 2) -> dict:
    return {"kv": kv(K.instance_key("/p", r.role, r.engine_id), encode_record(r), lease, rev)}


def delete(r: InstanceRecord, lease: int = 7, rev: int = 3) -> dict:
    key = K.instance_key("/p", r.role, r.engine_id)
    return {"type": "DELETE", "kv": {"key": K.b64(key), "mod_revision": str(rev)},
            "prev_kv": kv(key, encode_record(r), lease)}


def marker(*names: tuple[str, str], lease: int = 7) -> dict:
    return {"kv": kv(K.marker_key("/p", lease), K.marker_value(names).encode(), lease)}


A, B = rec("a"), rec("b", "prefill")


@pytest.mark.parametrize("name, responses, live, want", [
    ("put is up", [[put(A)]], (), [InstanceUp(A)]),
    ("same put again is silent", [[put(A)], [put(A)]], (), [InstanceUp(A)]),
    ("changed put is up again", [[put(A)], [put(rec("a", num_blocks=3))]], (),
     [InstanceUp(A), InstanceUp(rec("a", num_blocks=3))]),
    ("draining mark is an up with it, then the withdrawal", [[put(A)], [put(rec("a", draining=True))],
                                                              [delete(A), marker(("decode", "a"))]], (),
     [InstanceUp(A), InstanceUp(rec("a", draining=True)), InstanceDown("a", "decode", K.REASON_WITHDRAWN)]),
    ("delete with its marker: withdrawn", [[put(A)], [delete(A), marker(("decode", "a"))]], (),
     [InstanceUp(A), InstanceDown("a", "decode", K.REASON_WITHDRAWN)]),
    ("marker in another response: lease expired", [[put(A)], [delete(A)], [marker(("decode", "a"))]],
     (), [InstanceUp(A), InstanceDown("a", "decode", K.REASON_LEASE)]),
    ("marker naming another: lease expired", [[put(A)], [delete(A), marker(("prefill", "a"))]], (),
     [InstanceUp(A), InstanceDown("a", "decode", K.REASON_LEASE)]),
    ("delete, lease alive: by hand", [[put(A)], [delete(A)]], (7,),
     [InstanceUp(A), InstanceDown("a", "decode", K.REASON_DELETED)]),
    ("delete of a key without lease: by hand", [[put(A, lease=0)], [delete(A, lease=0)]], (),
     [InstanceUp(A), InstanceDown("a", "decode", K.REASON_DELETED)]),
    ("delete of an unknown key is silent", [[delete(B)]], (), []),
    ("withdraw of two in one marker", [[put(A), put(B)], [delete(A), delete(B),
                                                          marker(("decode", "a"), ("prefill", "b"))]],
     (), [InstanceUp(A), InstanceUp(B), InstanceDown("a", "decode", K.REASON_WITHDRAWN),
          InstanceDown("b", "prefill", K.REASON_WITHDRAWN)]),
    ("other keys are ignored", [[{"kv": kv("/p/other/x", b"{}")}, {"kv": kv("/p/instances/decode", b"{}")}]],
     (), []),
    ("unreadable record is skipped", [[{"kv": kv(K.instance_key("/p", "decode", "z"), b"nope")}]], (), []),
])
def test_view_apply(name, responses, live, want):
    view = K.RegistryView("/p")
    got = []
    for i, events in enumerate(responses):
        got += view.apply(events, i + 1, frozenset(live))
    assert got == want and view.revision == len(responses)


def test_a_reader_without_the_draining_field_reads_a_draining_record():
    """The field is appended with a default: a router of a release before it reads the record (and ignores it)."""
    import msgspec

    class Before(msgspec.Struct, frozen=True, kw_only=True):
        engine_id: str
        role: str
        sched_endpoint: str
        handshake_endpoints: tuple[str, ...]
        started_unix: float = 0.0

    old = msgspec.json.decode(encode_record(rec("a", draining=True, started_unix=5.0)), type=Before)
    assert (old.engine_id, old.started_unix) == ("a", 5.0)
    assert msgspec.json.decode(encode_record(A), type=InstanceRecord).draining is False


def test_view_unexplained_deletes_and_load():
    view = K.RegistryView("/p")
    view.apply([put(A), put(B, lease=9)], 2)
    assert view.unexplained_deletes([delete(A), delete(B, lease=9), marker(("prefill", "b"))]) == \
        [K.Deleted("decode", "a", 7)]
    # a resync: A gone, B changed, C new
    c = rec("c")
    b2 = rec("b", "prefill", tp=2)
    got = view.load([put(b2)["kv"], put(c)["kv"]], 10)
    assert got == [InstanceDown("a", "decode", K.REASON_MISSED), InstanceUp(b2), InstanceUp(c)]
    assert view.revision == 10 and sorted(view.records) == [("decode", "c"), ("prefill", "b")]


# -- real etcd -------------------------------------------------------------------------

@pytest.fixture
def etcd(tmp_path):
    with etcd_server(tmp_path) as server:
        yield server


def run(body, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(body, timeout_s))


async def next_event(events, timeout_s: float = EVENT_TIMEOUT_S):
    return await asyncio.wait_for(events.__anext__(), timeout_s)


class Announcer:
    """tests/support/etcd_announcer_child.py as a real process: a host's supervisor, killable."""

    def __init__(self, url: str, engine_id: str, role: str = "decode", ttl_s: int = TTL_S):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.etcd_announcer_child", url, engine_id, role, str(ttl_s)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.line = ""

    async def readline(self, timeout_s: float = EVENT_TIMEOUT_S) -> str:
        self.line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        return self.line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.proc.stdout.close()


def test_announce_withdraw_close(etcd):
    url = etcd.url()

    async def body():
        watcher = EtcdWatcher(url)
        ann = EtcdAnnouncer(url, ttl_s=TTL_S)
        try:
            ann.connect()
            ann.announce(rec("d0"))
            await watcher.start()
            assert watcher.snapshot() == [rec("d0")]
            events = watcher.events()
            assert await next_event(events) == InstanceUp(rec("d0"))  # from the snapshot
            ann.announce(rec("p0", "prefill"))
            assert await next_event(events) == InstanceUp(rec("p0", "prefill"))
            ann.withdraw("d0", "decode")
            assert await next_event(events) == InstanceDown("d0", "decode", "withdrawn")
            etcd.call("kv/deleterange", {"key": K.b64(K.instance_key("/pushkv", "prefill", "p0"))})
            assert await next_event(events) == InstanceDown("p0", "prefill", "deleted")
            ann.announce(rec("p1", "prefill"))
            assert await next_event(events) == InstanceUp(rec("p1", "prefill"))
            ann.close()
            assert await next_event(events) == InstanceDown("p1", "prefill", "withdrawn")
            assert etcd.keys("/pushkv/") == []  # the revoke took the marker too
        finally:
            ann.close()
            await watcher.close()

    run(body())


@pytest.mark.timeout(60)
def test_sigkill_lapses_the_lease_then_rejoin(etcd):
    """A host's supervisor dies by SIGKILL: the router hears "lease expired" within the TTL
    bound; a new incarnation announces and is Up again."""
    url = etcd.url()
    bound_s = TTL_S + 1.5  # lease TTL + etcd's 0.5 s expiry scan + delivery

    async def body():
        watcher = EtcdWatcher(url)
        host = Announcer(url, "d0")
        again = None
        try:
            assert (await host.readline()).startswith("ready")
            events = watcher.events()
            up = await next_event(events)
            assert isinstance(up, InstanceUp) and up.record.engine_id == "d0"
            t_kill = time.monotonic()
            host.proc.send_signal(signal.SIGKILL)
            down = await next_event(events, bound_s + 5)
            detect_s = time.monotonic() - t_kill
            assert down == InstanceDown("d0", "decode", "lease expired")
            print(f"SIGKILL -> lease expired in {detect_s:.2f}s (TTL {TTL_S}s, bound {bound_s}s)")
            assert TTL_S / 3 <= detect_s <= bound_s
            again = Announcer(url, "d0b")
            assert (await host.readline(1)) == ""  # the killed one said nothing more
            assert (await again.readline()).startswith("ready")
            up = await next_event(events)
            assert isinstance(up, InstanceUp) and up.record.engine_id == "d0b"
            again.proc.send_signal(signal.SIGTERM)  # a clean stop withdraws
            assert await next_event(events) == InstanceDown("d0b", "decode", "withdrawn")
            assert (await again.readline()) == "closed\n"
        finally:
            host.stop()
            if again is not None:
                again.stop()
            await watcher.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_lost_lease_rejoins(etcd):
    """The lease vanishes under a live announcer (what a host cut off longer than the TTL
    finds on its return): its next refresh re-grants and re-announces."""
    url = etcd.url()

    async def body():
        watcher = EtcdWatcher(url)
        host = Announcer(url, "d0")
        try:
            lease = int((await host.readline()).split()[1], 16)
            events = watcher.events()
            assert isinstance(await next_event(events), InstanceUp)
            etcd.call("lease/revoke", {"ID": str(lease)})
            assert await next_event(events) == InstanceDown("d0", "decode", "lease expired")
            assert (await host.readline()).startswith("rejoined")
            up = await next_event(events)
            assert isinstance(up, InstanceUp) and up.record.engine_id == "d0"
        finally:
            host.stop()
            await watcher.close()

    run(body(), 50)


@pytest.mark.timeout(90)
def test_watch_survives_an_etcd_restart(tmp_path):
    """The watch stream breaks when etcd stops; the watcher reconnects from its revision and
    misses nothing (an announce made while it was away arrives)."""

    async def body():
        with etcd_server(tmp_path) as etcd:
            url = etcd.url()
            watcher = EtcdWatcher(url)
            ann = EtcdAnnouncer(url, ttl_s=30)
            try:
                ann.connect()
                await watcher.start()
                events = watcher.events()
                ann.announce(rec("a"))
                assert await next_event(events) == InstanceUp(rec("a"))  # through the watch
                pending = asyncio.ensure_future(next_event(events, 40))
                await asyncio.to_thread(etcd.restart)  # the watcher runs meanwhile
                ann.announce(rec("b"))
                assert await pending == InstanceUp(rec("b"))
                assert watcher.reconnects >= 1
            finally:
                ann.close()
                await watcher.close()

    run(body(), 80)


@pytest.mark.timeout(60)
def test_changes_made_while_etcd_is_down_reach_it_later(etcd):
    """announce/withdraw while etcd is down stay pending (each try bounded by the call
    timeout, retries backing off) and land on the first tick after etcd is back."""
    ann = EtcdAnnouncer(etcd.url(), ttl_s=30, timeout_s=0.5, retry_s=0.2)
    try:
        ann.connect()
        ann.announce(rec("a"))
        assert etcd.keys("/pushkv/instances/") == ["/pushkv/instances/decode/a"]
        etcd.stop()
        t0 = time.monotonic()
        ann.tick(t0 + 100)  # the refresh fails: backoff starts
        ann.withdraw("a", "decode")  # during backoff: not even tried
        ann.announce(rec("b"))
        assert time.monotonic() - t0 < 1.5 and ann.failures == 1
        assert ann.unwithdrawn == {("decode", "a")} and ann.unput == {("decode", "b")}
        etcd.start()
        ann.tick(time.monotonic() + 100)
        assert ann.failures == 0 and not ann.unwithdrawn and not ann.unput
        assert etcd.keys("/pushkv/instances/") == ["/pushkv/instances/decode/b"]
    finally:
        ann.close()


def test_unreachable_etcd_is_a_clear_error():
    url = f"etcd://127.0.0.1:{free_port()}"
    ann = EtcdAnnouncer(url, timeout_s=0.5)
    with pytest.raises(EtcdUnavailable, match="127.0.0.1"):
        ann.connect()
    ann.close()


@pytest.mark.timeout(60)
def test_auth(etcd):
    """With auth on: the pushkv user works within its prefix; a wrong password, no user, or a
    prefix outside its role are refused with an error that says so."""
    etcd.enable_auth("rootpw", "pushkv", "s3cret", "/pushkv")
    good = etcd.url(user="pushkv", password="s3cret")

    async def body():
        watcher = EtcdWatcher(good)
        ann = EtcdAnnouncer(good, ttl_s=TTL_S)
        try:
            ann.connect()
            ann.announce(rec("d0"))
            events = watcher.events()
            assert await next_event(events) == InstanceUp(rec("d0"))
            ann.withdraw("d0", "decode")
            assert await next_event(events) == InstanceDown("d0", "decode", "withdrawn")
            ann.announce(rec("d1"))
            assert await next_event(events) == InstanceUp(rec("d1"))
            etcd.call("kv/deleterange", {"key": K.b64(K.instance_key("/pushkv", "decode", "d1"))})
            assert await next_event(events) == InstanceDown("d1", "decode", "deleted")  # timetolive allowed
        finally:
            ann.close()
            await watcher.close()
        for url, fragment in ((etcd.url(user="pushkv", password="wrong"), "authentication failed"),
                              (etcd.url(), "user name is empty"),
                              (etcd.url(user="pushkv", password="s3cret", prefix="/other"),
                               "permission denied")):
            bad = EtcdAnnouncer(url)
            with pytest.raises(EtcdAuthError, match=fragment) as e:
                bad.connect()  # at connect, before any process starts: the grants are tried too
            assert "refused" in str(e.value) and "wrong" not in str(e.value)
            bad.close()
            gw = SyncGateway(target_of(url))
            with pytest.raises(EtcdAuthError, match=fragment):
                check_readable(gw, gw.t)  # a router host's check
            gw.drop()
            w = EtcdWatcher(url)
            with pytest.raises(EtcdAuthError, match=fragment):
                await w.start()
            await w.close()

    run(body())


@pytest.mark.timeout(60)
def test_tls(tmp_path):
    """etcds:// with the CA works; without it (the system CAs) the certificate is refused."""
    tls = make_tls(tmp_path)

    async def body():
        with etcd_server(tmp_path, tls=tls) as etcd:
            url = etcd.url()
            assert url.startswith("etcds://")
            watcher = EtcdWatcher(url)
            ann = EtcdAnnouncer(url, ttl_s=TTL_S)
            try:
                ann.connect()
                events = watcher.events()
                ann.announce(rec("d0"))
                assert await next_event(events) == InstanceUp(rec("d0"))
            finally:
                ann.close()
                await watcher.close()
            no_ca = url.split("?")[0]
            with pytest.raises(EtcdUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                EtcdAnnouncer(no_ca).connect()
            w = EtcdWatcher(no_ca)
            with pytest.raises(EtcdUnavailable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await w.start()
            await w.close()

    run(body())


@pytest.mark.timeout(90)
def test_pushkv_up_refuses_credentials_and_grants_before_anything_starts(etcd, tmp_path):
    """`pushkv up --role ...` tries the registry as the host will use it: no user where etcd asks for one, or a
    user without the prefix, stops a P/D host at once (status 2, one line, no process started); so does a router
    host whose credentials cannot read the instances."""
    etcd.enable_auth("rootpw", "pushkv", "s3cret", "/pushkv")
    cases = [("decode", etcd.url(), "user name is empty"),
             ("prefill", etcd.url(user="pushkv", password="s3cret", prefix="/other"), "permission denied"),
             ("router", etcd.url(user="pushkv", password="wrong"), "authentication failed"),
             ("router", etcd.url(prefix="/pushkv"), "user name is empty")]
    for role, url, fragment in cases:
        argv = [sys.executable, "-m", "processes.cli", "up", "--role", role, "--registry", url, "--insecure",
                "--advertise", "127.0.0.1", "--model", "small", "--load-format", "dummy"]
        env = {**os.environ, "PUSHKV_REGISTRY_DIR": str(tmp_path / "reg")}
        got = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert got.returncode == 2 and fragment in got.stderr, (role, got.returncode, got.stderr[-2000:])
        assert "Traceback" not in got.stderr and "READY" not in got.stdout, got.stderr[-2000:]
