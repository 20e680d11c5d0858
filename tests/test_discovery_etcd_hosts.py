"""The etcd registry across namespace "hosts": a host cut off from etcd drops out of the
registry when its lease lapses, and rejoins by itself once its link is back."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from pushkv.discovery.etcd import EtcdWatcher
from pushkv.discovery.records import InstanceDown, InstanceUp
from tests import netns
from tests.etcd_server import etcd_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TTL_S = 2


@pytest.mark.timeout(90)
def test_cut_off_host_lapses_then_rejoins(tmp_path):
    with netns.hosts(1) as net, etcd_server(tmp_path, extra_hosts=(net.root_addr,)) as etcd:
        host = net[1]
        url = etcd.url(host=net.root_addr)
        child = host.popen([sys.executable, "-m", "tests.etcd_announcer_child", url, "d-h1", "decode",
                            str(TTL_S)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
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
