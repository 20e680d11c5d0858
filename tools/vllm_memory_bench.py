"""``python -m tools.vllm_memory_bench``: what the shared-memory KV cache costs.

1. Allocation: vLLM's own ``torch.zeros`` of the KV buffer against the same
   size through :class:`SharedKVAllocation` (memfd, every page touched).
2. Zero copy: a byte the "worker" writes into its tensor is read by a second
   mapping of the memfd in another process, with no copy in between.
3. Transfer: two writer-like processes, each with its own mapping of its own
   memfd registered with NIXL (UCX), one WRITE of N bytes as one descriptor
   and as one descriptor per 4 KiB page (what a per-layer, per-block list of
   the tiny model's 128-token blocks would be); against the staging copy a
   design without shared memory would add (torch copy of the same bytes).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from pushkv.vllm.memory import SharedKVAllocation, map_fd, mapping_addr

MiB = 2**20


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def alloc_cost(nbytes: int, reps: int = 3) -> tuple[float, float]:
    plain, shared = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        t = torch.zeros(nbytes, dtype=torch.int8)
        t[::4096] = 1  # touch, as the model would
        plain.append(time.perf_counter() - t0)
        del t
        a = SharedKVAllocation("bench")
        t0 = time.perf_counter()
        with a:
            torch.zeros(nbytes, dtype=torch.int8)
        shared.append(time.perf_counter() - t0)
        a.tensor = None
        a.mm.close()
        os.close(a.fd)
    return _median(plain), _median(shared)


def _reader(fd: int, nbytes: int, q) -> None:
    mm = map_fd(fd, nbytes)
    q.put(mm[12345])
    mm.close()


def zero_copy_check() -> bool:
    a = SharedKVAllocation("bench")
    with a:
        kv = torch.zeros(1 * MiB, dtype=torch.int8)
    kv[12345] = 42
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_reader, args=(a.fd, a.nbytes, q))
    p.start()
    seen = q.get(timeout=30)
    p.join()
    os.close(a.fd)
    return seen == 42


def _target(nbytes: int, conn) -> None:
    from pushkv.transport.nixl_agent import NixlAgent

    fd = os.memfd_create("bench-d")
    os.ftruncate(fd, nbytes)
    mm = map_fd(fd, nbytes)
    agent = NixlAgent("bench-d")
    agent.register(mapping_addr(mm), nbytes)
    conn.send((agent.metadata(), mapping_addr(mm)))
    peer = conn.recv()
    agent.add_remote(peer)
    while not (conn.poll(0.001) and conn.recv() == "stop"):
        agent.poll_notifs()  # UCX's connection setup needs the target's progress too
    agent.deregister()


def transfer(sizes_mib=(1.5, 16, 64), page: int = 4096, reps: int = 5) -> list[dict]:
    from pushkv.transport.nixl_agent import NixlAgent

    top = int(max(sizes_mib) * MiB)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_target, args=(top, child))
    proc.start()
    meta, remote_base = parent.recv()
    a = SharedKVAllocation("bench-p")
    with a:
        src = torch.zeros(top, dtype=torch.int8)
    src.fill_(3)
    agent = NixlAgent("bench-p")
    agent.register(a.base_addr, a.nbytes)
    parent.send(agent.metadata())
    remote = agent.add_remote(meta)
    out = []
    for mib in sizes_mib:
        n = int(mib * MiB)
        row = {"MiB": mib}
        for label, regions in (("1 desc", [(0, 0, n)]),
                               (f"{n // page} descs", [(o, o, page) for o in range(0, n, page)])):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                h = agent.post("WRITE", regions, a.base_addr, remote, remote_base)
                while agent.state(h) == "PROC":
                    pass
                times.append(time.perf_counter() - t0)
                agent.release(h)
            row[label] = _median(times)
        dst = torch.empty(n, dtype=torch.int8)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src[:n])
            times.append(time.perf_counter() - t0)
        row["staging copy"] = _median(times)
        out.append(row)
    parent.send("stop")
    proc.join(30)
    agent.deregister()
    return out


def main() -> None:
    torch.set_num_threads(1)
    plain, shared = alloc_cost(256 * MiB)
    print(f"allocation of 256 MiB: torch.zeros {plain * 1e3:.1f} ms, "
          f"memfd + touch {shared * 1e3:.1f} ms (once, at start)")
    print(f"zero copy: another process's mapping reads the worker's write: {zero_copy_check()}")
    print("| KV bytes | WRITE, 1 descriptor | WRITE, 4 KiB descriptors | staging copy a non-shared design adds |")
    print("| --- | --- | --- | --- |")
    for r in transfer():
        keys = [k for k in r if k.endswith("descs")]
        many = r[keys[0]]
        print(f"| {r['MiB']} MiB | {r['1 desc'] * 1e3:.2f} ms ({r['MiB'] / 1024 / r['1 desc']:.2f} GB/s) | "
              f"{many * 1e3:.2f} ms ({keys[0]}) | {r['staging copy'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
