"""A stand-in supervisor for the etcd tests: announce one instance, keep the lease, and on
SIGTERM withdraw and close. Prints ``ready <lease hex>`` once announced, then a line per rejoin.

    python -m tests.support.etcd_announcer_child URL ENGINE_ID ROLE TTL_S
"""
from __future__ import annotations

import logging
import signal
import sys
import time

from pushkv.discovery.etcd import EtcdAnnouncer
from pushkv.discovery.records import InstanceRecord

TICK_S = 0.05  # the loop's pace (a supervisor ticks about this often)


def main() -> None:
    url, engine_id, role, ttl_s = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ann = EtcdAnnouncer(url, ttl_s=ttl_s, timeout_s=0.5, retry_s=0.2)
    ann.connect()
    ann.announce(InstanceRecord(engine_id=engine_id, role=role, sched_endpoint="tcp://10.0.0.1:1",
                                handshake_endpoints=("tcp://10.0.0.1:2",), started_unix=time.time()))
    print(f"ready {ann.lease_id:x}", flush=True)
    granted = ann.leases_granted
    while not stop:
        ann.tick(time.monotonic())
        if ann.leases_granted != granted:
            granted = ann.leases_granted
            print(f"rejoined {ann.lease_id:x}", flush=True)
        time.sleep(TICK_S)
    ann.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
