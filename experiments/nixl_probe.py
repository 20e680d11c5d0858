"""Raw NIXL WRITE timing between two processes, below pushkv's writer: where a transfer's
fixed cost comes from.

P and D each own one registered buffer (host memory, or one GPU each) and one
``NixlAgent``; metadata goes over a pipe. P WRITEs ``sizes`` into D, each way
below, and spins on the transfer state (the writer's loop does the same while a
transfer is young). Per size and way it prints the post call, post->DONE on P,
and post->notification seen on D (D spins on its notifications; CLOCK_MONOTONIC
is shared by both processes), against a plain torch copy of the same bytes
between the same devices, measured in the same run.

Ways: ``adhoc`` (descriptors built per transfer, ``initialize_xfer``), ``adhoc+notif``,
``prepped+notif`` (prepared lists of 1 MiB entries, posted by index), and
``split64+notif`` (the same bytes as 64 descriptors). Run under different ``UCX_*``
settings to see what the transport does (``UCX_PROTO_INFO=y`` prints its choice).

    python -m experiments.nixl_probe --device cuda:0 --peer-device cuda:1 --sizes-mib 0.25 1 16 64 256
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np

CHUNK = 1 << 20  # prepared-list entry
DONE_TIMEOUT_S = 30.0


def _buffer(device: str, nbytes: int):
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t.fill_(7 if device == "cpu" else 0)
    return t


def _agent(name: str, device: str, buf):
    from pushkv.transport.nixl_agent import NixlAgent

    a = NixlAgent(name, device=device)
    a.register(buf.data_ptr(), buf.numel())
    return a


def _rows(base: int, nbytes: int, dev: int) -> np.ndarray:
    n = nbytes // CHUNK
    return np.array([[base + i * CHUNK, CHUNK, dev] for i in range(n)], dtype=np.int64)


def _decode_side(device: str, nbytes: int, conn, poll_us: float = 0.0) -> None:
    import torch

    if device != "cpu":
        torch.cuda.set_device(device)
    buf = _buffer(device, nbytes)
    a = _agent("probe-d", device, buf)
    conn.send((a.metadata(), buf.data_ptr(), a.dev_id))
    p_meta = conn.recv()
    a.add_remote(p_meta)
    seen: dict[bytes, float] = {}
    while True:  # spin on notifications (or, with poll_us, busy that long between polls); the parent says when to stop
        if poll_us:  # a loop whose other work takes poll_us between its NIXL polls (it holds the core, as work does)
            end = time.perf_counter() + poll_us / 1e6
            while time.perf_counter() < end:
                pass
        for _, payloads in a.poll_notifs().items():
            now = time.perf_counter()
            for p in payloads:
                seen[p] = now
        if conn.poll():
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "seen":
                conn.send(seen)
                seen = {}
            elif cmd == "check":
                conn.send(int(buf[: 1 << 20].sum().item()))
    a.deregister()
    conn.send("bye")


def _wait_done(a, h) -> float:
    end = time.perf_counter() + DONE_TIMEOUT_S
    while True:
        st = a.state(h)
        if st == "DONE":
            return time.perf_counter()
        if st == "ERR" or time.perf_counter() > end:
            raise RuntimeError(f"transfer state {st}")


def probe(device: str, peer_device: str, sizes_mib: list[float], reps: int, gap_ms: float = 0.0,
          gap_spin: bool = False, heartbeat_ms: float = 0.0, local_ms: float = 0.0, op: str = "WRITE",
          ways: tuple[str, ...] = ("adhoc", "adhoc+notif", "prepped+notif", "split64+notif"),
          d_poll_us: float = 0.0) -> dict:
    import torch

    from tools.copy_speed import plain_copy_gbps

    if device != "cpu":
        torch.cuda.set_device(device)
    nbytes = int(max(sizes_mib) * 2**20)
    nbytes = max(CHUNK * 64, (nbytes + CHUNK - 1) // CHUNK * CHUNK)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_decode_side, args=(peer_device, nbytes, there, d_poll_us), daemon=True)
    child.start()
    rows = []
    try:
        buf = _buffer(device, nbytes)
        if device == "cpu":
            buf.fill_(9)
        else:
            buf.fill_(9)
            torch.cuda.synchronize()
        a = _agent("probe-p", device, buf)
        d_meta, d_base, d_dev = here.recv()
        here.send(a.metadata())
        remote = a.add_remote(d_meta)
        a.prepare_local(_rows(buf.data_ptr(), nbytes, a.dev_id))
        a.prepare_remote(remote, _rows(d_base, nbytes, d_dev))
        seq = 0

        made: list[float] = []  # prepped posts: make_prepped_xfer's share of the post
        one = np.zeros(1, dtype=np.int64)
        scratch = torch.empty(2, 1024, device=device) if device != "cpu" else None

        def beat() -> None:
            """The keep-warm candidates: a one-chunk WRITE to the peer (the bytes it already holds),
            or a 4 KiB copy on our own GPU."""
            if heartbeat_ms:
                h = a.post_prepped("WRITE", one, remote, one)
                _wait_done(a, h)
                a.release(h)
            if local_ms and scratch is not None:
                scratch[0].copy_(scratch[1])
                torch.cuda.synchronize()

        def once(way: str, size: int) -> tuple[float, float, bytes, float]:
            nonlocal seq
            seq += 1
            tag = f"n{seq}".encode() if "notif" in way else b""
            t0 = time.perf_counter()
            if way.startswith("prepped"):
                idx = np.arange(max(1, size // CHUNK), dtype=np.int64)
                h = a._agent.make_prepped_xfer(op, a._local_dlist, idx, a._remote_dlists[remote], idx, tag)
                made.append(time.perf_counter() - t0)
                if a._agent.transfer(h) == "ERR":
                    raise RuntimeError("post failed")
            elif way.startswith("split64"):
                part = size // 64
                h = a.post(op, [(i * part, i * part, part) for i in range(64)], buf.data_ptr(),
                           remote, d_base, tag, d_dev)
            else:
                h = a.post(op, [(0, 0, size)], buf.data_ptr(), remote, d_base, tag, d_dev)
            t1 = time.perf_counter()
            t2 = _wait_done(a, h)
            a.release(h)
            return t1 - t0, t2 - t0, tag, t0

        for way in ways:
            for s in sizes_mib:
                size = int(s * 2**20)
                if way.startswith("prepped") and size % CHUNK:
                    continue
                once(way, size)  # warm (first touch, handle caches)
                posts, dones, notes = [], [], []
                for _ in range(reps):
                    if gap_ms and gap_spin:  # between transfers, a loop that keeps polling NIXL
                        end = time.perf_counter() + gap_ms / 1e3
                        every = (heartbeat_ms or local_ms) / 1e3
                        nxt = time.perf_counter() + every
                        while time.perf_counter() < end:
                            a.poll_notifs()
                            if every and time.perf_counter() >= nxt:
                                beat()
                                nxt = time.perf_counter() + every
                    elif gap_ms:  # idle between transfers, as a writer is between requests
                        time.sleep(gap_ms / 1e3)
                    made.clear()
                    post, done, tag, t0 = once(way, size)
                    posts.append(post)
                    dones.append(done)
                    if tag:
                        notes.append((tag, t0))
                if notes:
                    here.send("seen")
                    seen = here.recv()
                    lat = [seen[t] - t0 for t, t0 in notes if t in seen]
                else:
                    lat = []
                row = {"way": way, "mib": s, "post_us": statistics.median(posts) * 1e6,
                       "done_us": statistics.median(dones) * 1e6,
                       "done_min_us": min(dones) * 1e6,
                       "notif_us": statistics.median(lat) * 1e6 if lat else float("nan"),
                       "gbps": size / statistics.median(dones) / 1e9,
                       "make_us": made[-1] * 1e6 if made else float("nan")}
                rows.append(row)
                print(f"{op} {way:>14} {s:>8.2f} MiB  post {row['post_us']:>8.1f} us  done {row['done_us']:>9.1f} us "
                      f"(min {row['done_min_us']:>9.1f})  notif seen {row['notif_us']:>9.1f} us  "
                      f"{row['gbps']:>7.2f} GB/s  (last post's make_prepped_xfer {row['make_us']:.1f} us)", flush=True)
        here.send("check")
        ok = here.recv() == 9 * (1 << 20) if op == "WRITE" else (
            int(buf[: 1 << 20].sum().item()) == (7 if peer_device == "cpu" else 0) * (1 << 20))  # the peer's fill
        a.deregister()
    finally:
        here.send("stop")
        child.join(30)
        if child.is_alive():
            child.kill()
    copies = {s: plain_copy_gbps(int(s * 2**20), device=device, dst_device=peer_device) for s in sizes_mib}
    print(f"plain copy {device} -> {peer_device}: " + ", ".join(f"{s} MiB {g:.1f} GB/s" for s, g in copies.items()))
    print(f"bytes arrived: {ok}")
    return {"rows": rows, "copy_gbps": copies, "bytes_ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peer-device", default=None)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep between transfers (idle writer)")
    ap.add_argument("--gap-spin", action="store_true", help="spin polling NIXL in the gap instead of sleeping")
    ap.add_argument("--heartbeat-ms", type=float, default=0.0,
                    help="with --gap-spin: a one-chunk WRITE to the peer this often in the gap (keep-warm candidate)")
    ap.add_argument("--local-ms", type=float, default=0.0,
                    help="with --gap-spin: a 4 KiB copy on our GPU this often in the gap (keep-warm candidate)")
    ap.add_argument("--op", choices=("WRITE", "READ"), default="WRITE",
                    help="READ: the first process reads the peer's buffer into its own (pull's direction)")
    ap.add_argument("--ways", nargs="+", default=["adhoc", "adhoc+notif", "prepped+notif", "split64+notif"])
    ap.add_argument("--d-poll-us", type=float, default=0.0,
                    help="the peer keeps its core busy this long between its NIXL polls (a writer loop's other work; "
                         "0: it spins on them): over UCX TCP the receiver's progress moves the bytes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = probe(a.device, a.peer_device or a.device, a.sizes_mib, a.reps, a.gap_ms, a.gap_spin, a.heartbeat_ms,
                a.local_ms, a.op, tuple(a.ways), a.d_poll_us)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
