"""An instance's /metrics read while a load runs: the experiments that count how many requests run at once
(preempt_concurrency, chunk_alloc) sample its gauges from a thread while the load's threads run."""
from __future__ import annotations

import threading
import time
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families


def scraper(url: str) -> Callable[[], dict[str, float]]:
    """One read of ``url``'s samples by name (a histogram's buckets left out: their names repeat per bound)."""
    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=10) as r:
            return {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples
                    if not s.labels.get("le")}
    return scrape


def sampled(load: list[threading.Thread], scrape: Callable[[], dict[str, float]],
            every_s: float) -> tuple[float, list[dict[str, float]]]:
    """Run ``load``'s threads to their end, reading ``scrape`` every ``every_s`` meanwhile: the wall seconds and
    the reads."""
    done = threading.Event()
    reads: list[dict[str, float]] = []

    def poll() -> None:
        while not done.is_set():
            reads.append(scrape())
            time.sleep(every_s)  # sampling a gauge, not synchronising

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.monotonic()
    for t in load:
        t.start()
    for t in load:
        t.join()
    wall = time.monotonic() - t0
    done.set()
    poller.join()
    return wall, reads
