"""Does a NIXL WRITE posted from a second thread leave the first free to read notifications?

Over UCX's TCP transport from GPU memory the post call itself moves the data (a 64 MiB WRITE's
post returns when it is done: docs/results/stream_layer section 3), so P's writer reads nothing
while it posts. This probe posts one large WRITE from a thread while the main thread keeps
calling ``get_new_notifs`` and D sends P a small notification every millisecond. Per NIXL thread
sync mode it prints the post call's duration, how many of D's notifications P read while the post
ran, and the longest gap between two of P's ``get_new_notifs`` calls returning.

    UCX_TLS=tcp,cuda_copy python experiments/post_thread_probe.py --device cuda:0 --size-mib 256
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time


def _agent(name: str, mode: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = None if mode == "none" else getattr(nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{mode.upper()}")
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync))


def _buf(device: str, nbytes: int):
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _mem(device: str) -> tuple[str, int]:
    return ("DRAM", 0) if device == "cpu" else ("VRAM", int(device.split(":")[-1] or 0))


def decode_side(device: str, nbytes: int, mode: str, conn) -> None:
    a = _agent("probe-d", mode)
    buf = _buf(device, nbytes)
    kind, dev = _mem(device)
    a.register_memory([(buf.data_ptr(), nbytes, dev, "")], kind)
    conn.send((a.get_agent_metadata(), buf.data_ptr()))
    peer = a.add_remote_agent(conn.recv())
    while not conn.poll():  # progress P's warm-up WRITE (the TCP lane needs the target to progress)
        a.get_new_notifs()
    conn.recv()  # go
    end = time.monotonic() + 4.0
    n = 0
    while time.monotonic() < end:
        a.send_notif(peer, b"tick")
        n += 1
        t = time.monotonic() + 0.001
        while time.monotonic() < t:
            a.get_new_notifs()
    conn.send(n)


def prefill_side(device: str, nbytes: int, mode: str, inline: bool = False, second: bool = False) -> dict:
    a = _agent("probe-p", mode)
    buf = _buf(device, nbytes)
    kind, dev = _mem(device)
    a.register_memory([(buf.data_ptr(), nbytes, dev, "")], kind)
    here, there = mp.Pipe()
    child = mp.get_context("spawn").Process(target=decode_side, args=(device, nbytes, mode, there), daemon=True)
    child.start()
    meta, remote_base = here.recv()
    peer = a.add_remote_agent(meta)
    here.send(a.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer

    def handle():
        ldesc = a.get_xfer_descs([(buf.data_ptr(), nbytes, dev)], kind)
        rdesc = a.get_xfer_descs([(remote_base, nbytes, dev)], kind)
        return a.initialize_xfer("WRITE", ldesc, rdesc, peer, b"")

    warm = handle()  # connect and warm the lanes
    a.transfer(warm)
    while a.check_xfer_state(warm) == "PROC":
        pass
    a.release_xfer_handle(warm)
    here.send("go")
    time.sleep(0.5)  # D's ticks flowing
    h = handle()
    posted = {}

    poster = a
    if second:  # a second agent of our own posts, from the thread: no lock shared with the polling agent
        poster = _agent("probe-p-post", "none")
        poster.register_memory([(buf.data_ptr(), nbytes, dev, "")], kind)
        poster.add_remote_agent(meta)
        ldesc = poster.get_xfer_descs([(buf.data_ptr(), nbytes, dev)], kind)
        rdesc = poster.get_xfer_descs([(remote_base, nbytes, dev)], kind)
        warm2 = poster.initialize_xfer("WRITE", ldesc, rdesc, peer, b"")
        poster.transfer(warm2)
        while poster.check_xfer_state(warm2) == "PROC":
            pass
        poster.release_xfer_handle(warm2)
        a.release_xfer_handle(h)
        h = poster.initialize_xfer("WRITE", ldesc, rdesc, peer, b"")

    def post():
        posted["start"] = time.monotonic()
        posted["state"] = poster.transfer(h)
        posted["end"] = time.monotonic()

    th = threading.Thread(target=post)
    ticks_during, gaps, last = 0, [], time.monotonic()
    if inline:  # the baseline: post on this thread, as the writer does today
        post()
    else:
        th.start()
    while (th.is_alive() or "end" not in posted) and not inline:
        got = a.get_new_notifs()
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        if th.is_alive():
            ticks_during += sum(len(v) for v in got.values())
    if not inline:
        th.join()
    while poster.check_xfer_state(h) == "PROC":
        pass
    done = time.monotonic()
    poster.release_xfer_handle(h)
    sent = here.recv()
    child.join(10)
    return {"mode": mode + (" inline" if inline else " second agent's thread" if second else " thread"), "post_ms": (posted["end"] - posted["start"]) * 1e3,
            "done_ms": (done - posted["start"]) * 1e3, "ticks_read_during_post": ticks_during,
            "max_gap_ms": max(gaps, default=0.0) * 1e3, "polls": len(gaps), "ticks_sent": sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=["inline", "strict", "rw"],
                    help="NIXL thread sync modes (strict, rw, none) of one agent posting from a thread; inline: post on "
                         "the polling thread; second: a second agent posts from the thread")
    args = ap.parse_args()
    for mode in args.modes:  # each in its own process: NONE may crash when two threads call in
        print(_run(mode, args.device, args.size_mib << 20), flush=True)


def _run(mode: str, device: str, nbytes: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(mode, device, nbytes, q))
    p.start()
    p.join(60)
    if p.exitcode is None:
        p.kill()
        return {"mode": mode, "error": "timed out (60 s)"}
    if p.exitcode != 0:
        return {"mode": mode, "error": f"exit code {p.exitcode}"}
    return q.get()


def _child(mode: str, device: str, nbytes: int, q) -> None:
    if mode == "inline":
        q.put(prefill_side(device, nbytes, "none", inline=True))
    elif mode == "second":
        q.put(prefill_side(device, nbytes, "none", second=True))
    else:
        q.put(prefill_side(device, nbytes, mode))


if __name__ == "__main__":
    main()
