"""The etcd registry across namespace "hosts": a host cut off from etcd drops out of the
registry when its lease lapses, and rejoins by itself once its link is back."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from pushkv.discovery.etcd import EtcdAnnouncer, EtcdWatcher
from pushkv.discovery.records import InstanceDown, InstanceUp
from tests.support import netns
from tests.support.etcd_server import etcd_server
from tests.support import ROOT

pytestmark = pytest.mark.unit  # a real etcd and stand-in processes in namespaces, no pushkv deployment

TTL_S = 2


@pytest.mark.timeout(90)
def test_cut_off_host_lapses_then_rejoins(tmp_path):
    with netns.hosts(1) as net, etcd_server(tmp_path, extra_hosts=(net.root_addr,)) as etcd:
        host = net[1]
        url = etcd.url(host=net.root_addr)
        child = host.popen([sys.executable, "-m", "tests.support.etcd_announcer_child", url, "d-h1", "decode",
                            str(TTL_S)], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)

        async def line(timeout_s=15.0) -> str:
            return await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout_s)

        async def body():
            watcher = EtcdWatcher(etcd.url())
            try:
                assert (await line()).startswith("ready")
                events = watcher.events()
                up = await asyncio.wait_for(events.__anext__(), 10)
                assert isinstance(up, InstanceUp) and up.record.engine_id == "d-h1"
                t_cut = time.monotonic()
                host.cut()
                down = await asyncio.wait_for(events.__anext__(), TTL_S + 10)
                detect_s = time.monotonic() - t_cut
                assert down == InstanceDown("d-h1", "decode", "lease expired")
                assert detect_s <= TTL_S + 1.5
                t_restore = time.monotonic()
                host.restore()
                assert (await line()).startswith("rejoined")
                up = await asyncio.wait_for(events.__anext__(), 10)
                rejoin_s = time.monotonic() - t_restore
                assert isinstance(up, InstanceUp) and up.record.engine_id == "d-h1"
                print(f"cut -> lease expired in {detect_s:.2f}s (TTL {TTL_S}s); "
                      f"restore -> Up again in {rejoin_s:.2f}s")
                assert rejoin_s <= 5.0  # retry every 0.2 s, each call bounded by 0.5 s
            finally:
                await watcher.close()

        try:
            asyncio.run(asyncio.wait_for(body(), 60))
        finally:
            child.kill()
            child.wait(5)
            child.stdout.close()


@pytest.mark.timeout(90)
def test_cut_off_router_catches_up(tmp_path):
    """The watching side (a router's host) is cut off from etcd: its silent watch is reopened
    (and fails while the link is down); once restored, it reports what changed meanwhile."""
    with netns.hosts(1) as net, etcd_server(tmp_path, extra_hosts=(net.root_addr,)) as etcd:
        host = net[1]
        ann = EtcdAnnouncer(etcd.url(), ttl_s=30)
        child = host.popen([sys.executable, "-m", "tests.support.etcd_watcher_child",
                            etcd.url(host=net.root_addr), "1.0"],
                           cwd=ROOT, stdout=subprocess.PIPE, text=True)
        lines = iter(child.stdout.readline, "")
        try:
            ann.connect()
            assert next(lines) == "ready\n"
            ann.announce(_rec("a"))
            assert next(lines) == "up a\n"
            host.cut()
            ann.withdraw("a", "decode")
            ann.announce(_rec("b"))
            t_cut = time.monotonic()
            line = next(lines)  # the first thing it says while cut off: the reopen failed
            assert line.startswith("log etcd watch broke"), line
            noticed_s = time.monotonic() - t_cut
            host.restore()
            t_restore = time.monotonic()
            seen = [next(lines)]
            while seen[-1].startswith("log "):
                seen.append(next(lines))
            seen.append(next(lines))
            caught_up_s = time.monotonic() - t_restore
            assert [s for s in seen if not s.startswith("log ")] == ["down a withdrawn\n", "up b\n"]
            print(f"router cut off: reopen failed after {noticed_s:.2f}s (idle 1 s + connect timeout); "
                  f"caught up {caught_up_s:.2f}s after restore")
            assert caught_up_s <= 5.0  # reconnect backoff <= 2 s
        finally:
            ann.close()
            child.kill()
            child.wait(5)
            child.stdout.close()


def _rec(eid: str):
    from pushkv.discovery.records import InstanceRecord

    return InstanceRecord(engine_id=eid, role="decode", sched_endpoint="tcp://h:1", handshake_endpoints=())
