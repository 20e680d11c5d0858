"""A stand-in router for the etcd tests: watch the registry and print each event as a line
``up <engine_id>`` / ``down <engine_id> <reason>``; the watcher's log goes to the same stdout.

    python -m tests.support.etcd_watcher_child URL IDLE_S
"""
from __future__ import annotations

import asyncio
import logging
import sys

from pushkv.discovery.etcd import EtcdWatcher
from pushkv.discovery.records import InstanceUp


async def watch(url: str, idle_s: float) -> None:
    watcher = EtcdWatcher(url, idle_s=idle_s)
    await watcher.start()
    print("ready", flush=True)
    async for ev in watcher.events():
        if isinstance(ev, InstanceUp):
            print(f"up {ev.record.engine_id}", flush=True)
        else:
            print(f"down {ev.engine_id} {ev.reason}", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="log %(message)s")
    asyncio.run(watch(sys.argv[1], float(sys.argv[2])))


if __name__ == "__main__":
    main()
