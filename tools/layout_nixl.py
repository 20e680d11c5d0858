"""WRITE timing of one layout's transfer over real NIXL between two processes, for
a fresh pool (contiguous block ids), a fragmented one (ids from an allocator
whose free space is runs of 2 blocks on P and 3 on D), and the "unplanned" pools
(each side laid out for itself alone, without the common sub-block and head
groups of ``layout.transfer_geometry``): what merging and the cut save.

Every rank of each side gets its own pool, laid out back to back in one
registered buffer per process; all (P rank, D rank) WRITEs are posted at once,
as P's writers do, and timed from the first post to the last completion.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from pushkv.kv import layout as L
from pushkv.protocol.mapping import map_transfer
from pushkv.protocol.tp import head_overlap, producers_for
from pushkv.transport.nixl_agent import NixlAgent
from tools.fragment import fragmented_table

DONE_TIMEOUT_S = 60.0


def _pools(cfg, inst, planned: bool = True):
    if planned:
        lays = [L.instance_layout(cfg, inst, r) for r in range(inst.tp)]
    else:
        lays = [L.layout_for(cfg.model, inst.tp, r, inst.num_blocks, inst.block_size) for r in range(inst.tp)]
    offs, total = [], 0
    for lay in lays:
        offs.append(total)
        total += L.pool_bytes(lay)
    return lays, offs, total


def _decode_side(conn, nbytes: int, device: str) -> None:
    if device != "cpu":
        torch.cuda.set_device(device)
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched pages, like a real pool
    agent = NixlAgent("layout-nixl-d", device=device)
    agent.register(buf.data_ptr(), nbytes)
    conn.send((agent.metadata(), buf.data_ptr()))
    while not conn.poll(0.0005):  # no progress thread: drive UCX (accepting the connection)
        agent.poll_notifs()
    conn.recv()
    agent.deregister()


def _regions(combo, n: int, p_tables, d_tables, num_blocks: int, planned: bool = True):
    """Regions (pool offsets applied) per (p, d) pair."""
    cfg = combo.config(num_blocks)
    total = cfg.model.cache_kv_heads
    p_lays, p_offs, _ = _pools(cfg, cfg.prefill, planned)
    d_lays, d_offs, _ = _pools(cfg, cfg.decode, planned)
    out = []
    for d in range(combo.d_tp):
        for p in producers_for(d, combo.d_tp, combo.p_tp, total):
            heads = head_overlap(p, combo.p_tp, d, combo.d_tp, total)
            regs = map_transfer(p_lays[p], p_tables, d_lays[d], d_tables, n, heads)
            out.append([(s + p_offs[p], t + d_offs[d], k) for s, t, k in regs])
    return out


def time_writes(combo, n: int, num_blocks: int, reps: int = 3,
                devices: tuple[str, str] = ("cpu", "cpu")) -> dict:
    """``devices``: where P's and D's pools live (``cuda:N`` for GPU memory)."""
    nbp, nbd = L.blocks_for(n, combo.p_bs), L.blocks_for(n, combo.d_bs)
    num_blocks = max(num_blocks, 6 * max(nbp, nbd) + 8)
    fresh = (list(range(nbp)), list(range(nbd)))
    cases = {  # name: (tables, planned layouts)
        "fresh": (fresh, True),
        "frag": ((fragmented_table(num_blocks, 2, nbp), fragmented_table(num_blocks, 3, nbd)), True),
        "unplanned": (fresh, False),
    }
    cfg = combo.config(num_blocks)
    _, _, p_bytes = _pools(cfg, cfg.prefill)
    _, _, d_bytes = _pools(cfg, cfg.decode)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, d_bytes, devices[1]), daemon=True)
    proc.start()
    out: dict = {}
    try:
        if devices[0] != "cpu":
            torch.cuda.set_device(devices[0])
        src = torch.randint(0, 255, (p_bytes,), dtype=torch.uint8, device=devices[0])
        agent = NixlAgent("layout-nixl-p", device=devices[0])
        d_dev = 0 if devices[1] == "cpu" else int(devices[1].split(":")[-1])
        agent.register(src.data_ptr(), p_bytes)
        if not parent.poll(DONE_TIMEOUT_S):
            raise TimeoutError("decode side did not start")
        meta, d_base = parent.recv()
        remote = agent.add_remote(meta)
        for case, ((pt, dt), planned) in cases.items():
            pairs = _regions(combo, n, pt, dt, num_blocks, planned)
            nbytes = sum(k for regs in pairs for _, _, k in regs)
            times = []
            for _ in range(reps + 1):  # first: warm-up (connection, registration caches)
                t0 = time.perf_counter()
                handles = [agent.post("WRITE", regs, src.data_ptr(), remote, d_base, remote_dev=d_dev)
                           for regs in pairs]
                end = time.monotonic() + DONE_TIMEOUT_S
                while handles:
                    st = [agent.state(h) for h in handles]
                    if "ERR" in st:
                        raise RuntimeError(f"WRITE failed ({case})")
                    for h, s in zip(list(handles), st):
                        if s == "DONE":
                            agent.release(h)
                            handles.remove(h)
                    if time.monotonic() > end:
                        raise TimeoutError(f"WRITE not done in {DONE_TIMEOUT_S}s ({case})")
                times.append(time.perf_counter() - t0)
            secs = statistics.median(times[1:])
            out[f"nixl_{case}_descs"] = sum(len(r) for r in pairs)
            out[f"nixl_{case}_gbps"] = nbytes / secs / 1e9
            out[f"nixl_{case}_ms"] = secs * 1e3
        agent.remove_remote(remote)
        agent.deregister()
    finally:
        parent.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out
