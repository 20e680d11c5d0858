"""The KV transfer alone, between two real writer processes (no model, no scheduler):
this process plays both schedulers, sends D's ExpectKV and P's SendKV, and times
each push. What it reports per size:

- ``post->done``: P writer's own time from the WRITE's post to its completion
  (what ``KVSent.secs`` carries: mapping, descriptors, post, UCX, completion seen);
- ``post``: the part of that spent on P's writer before the WRITE is under way (mapping,
  descriptors or indices, post): the per-transfer CPU cost that prepared lists cut;
- ``send->received``: wall time here from sending SendKV to D's KVReceived (adds
  the ZMQ hops and the WriteDone notification);

and the fixed cost of a transfer two ways: the time of a one-block push, and the
intercept of a least-squares line of time against bytes over the sizes measured.
"""
from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Optional

import zmq

from pushkv import envs
from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, encode_config, preset
from pushkv.kv import layout as L
from pushkv.supervisor.lifecycle import read_cpu_seconds
from pushkv.supervisor.plan import plan_deployment

# the checkout whose writers run (default: the installed pushkv): point it at a checkout of an older
# commit for a before/after comparison; ``python -m`` finds the packages of its working directory
# first (its writers must speak the same scheduler messages)
WRITERS_ROOT = envs.PUSHKV_WRITERS_ROOT or None
READY_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 60.0


@contextmanager
def writer_pair(model: str, block_size: int, num_blocks: int, device: str = "cpu",
                decode_device: Optional[str] = None, warm: str = "auto"):
    """A planned push config with P's and D's writer rank 0 running (``warm``: their
    writer_warm); yields (cfg, P, D) sockets
    to the writers' scheduler channels. Always stops the writers and removes the run dir."""
    root = tempfile.mkdtemp(prefix="pushkv-xfer-")
    cfg = DeploymentConfig(
        mode="push", model=preset(model), writer_warm=warm,
        prefill=InstanceConfig(role="prefill", num_blocks=num_blocks, block_size=block_size, device=device),
        decode=InstanceConfig(role="decode", num_blocks=num_blocks, block_size=block_size,
                              device=decode_device or device),
    )
    cfg = plan_deployment(cfg, run_root=root)
    os.makedirs(cfg.run_dir, exist_ok=True)
    path = os.path.join(cfg.run_dir, "config.json")
    with open(path, "wb") as f:
        f.write(encode_config(cfg))
    ctx = zmq.Context.instance()
    ctl = ctx.socket(zmq.ROUTER)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.bind(cfg.control_endpoint)
    procs: list[subprocess.Popen] = []
    socks: list[zmq.Socket] = []
    try:
        for role in ("prefill", "decode"):
            procs.append(subprocess.Popen([sys.executable, "-m", "processes.writer", "--config", path,
                                           "--role", role, "--rank", "0"], cwd=WRITERS_ROOT))
        pending, end = {"prefill-writer-0", "decode-writer-0"}, time.monotonic() + READY_TIMEOUT_S
        while pending:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a writer exited during startup")
            if time.monotonic() > end:
                raise TimeoutError(f"writers not ready: {sorted(pending)}")
            if ctl.poll(200):
                msg = m.DEC_CONTROL.decode(ctl.recv_multipart()[-1])
                if isinstance(msg, m.Ready):
                    pending.discard(msg.name)
        for ep in (cfg.prefill.writer_endpoints[0], cfg.decode.writer_endpoints[0]):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            socks.append(s)
        yield cfg, socks[0], socks[1], procs
    finally:
        for s in socks:
            s.close(0)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ctl.close(0)
        shutil.rmtree(root, ignore_errors=True)


def _recv(sock: zmq.Socket, timeout_s: float = REPLY_TIMEOUT_S):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no reply from a writer within {timeout_s:.0f}s")
    return m.DEC_WRITER_TO_SCHED.decode(sock.recv_multipart()[-1])


def _wait_registered(p_sock: zmq.Socket, tid: str) -> None:
    end = time.monotonic() + REPLY_TIMEOUT_S
    want = int(tid.rsplit("#", 1)[-1]) + 1
    while time.monotonic() < end:
        p_sock.send(m.encode(m.GetStats()))
        st = _recv(p_sock)
        if st.counters.get("registrations_received", 0) >= want:
            return
    raise TimeoutError(f"P never saw D's registration of {tid}")


def push_once(cfg, p_sock, d_sock, tid: str, p_blocks, d_blocks, num_tokens: int, gap_s: float = 0.0) -> dict:
    src = m.PrefillSource(cfg.prefill.engine_id, cfg.prefill.tp, cfg.prefill.handshake_endpoints)
    d_sock.send(m.encode(m.ExpectKV(tid, 0, tuple(d_blocks), num_tokens, src, REPLY_TIMEOUT_S)))
    # registration first (the push steady state): wait until P has it, then prefill "ends"
    _wait_registered(p_sock, tid)
    if gap_s:  # the rest of the prefill that push overlaps: the writers get no message meanwhile
        time.sleep(gap_s)
    t0 = time.perf_counter()
    p_sock.send(m.encode(m.SendKV(tid, 0, tuple(p_blocks), num_tokens, first_token=1)))
    got_d = _recv(d_sock)
    t1 = time.perf_counter()
    got_p = _recv(p_sock)
    if not isinstance(got_d, m.KVReceived) or not isinstance(got_p, m.KVSent):
        raise RuntimeError(f"transfer {tid} failed: D {got_d}, P {got_p}")
    st = dict(got_p.timeline)
    post = st["write_posted"] - st["write_post_start"] if "write_post_start" in st else float("nan")
    # the post's parts on P's writer: indices and the NIXL post, then the wake hint to D
    posted = st.get("write_post_returned", float("nan")) - st.get("write_post_start", float("nan"))
    woke = st.get("write_woke", float("nan")) - st.get("write_post_returned", float("nan"))
    return {"secs": got_p.transfer_s, "e2e": t1 - t0, "post": post, "nbytes": got_p.nbytes,
            "descs": got_p.num_descs, "posted": posted, "wake": woke}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (intercept a, slope b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def measure(model: str, block_size: int, sizes_mib: list[float], reps: int, device: str = "cpu",
            decode_device: Optional[str] = None, warm: str = "auto", gap_ms: float = 0.0) -> dict:
    mcfg = preset(model)
    lay_bytes = mcfg.kv_bytes_per_token() * block_size  # one logical block, every layer and head
    counts = sorted({1} | {max(1, round(s * 2**20 / lay_bytes)) for s in sizes_mib})
    # fresh-pool shape: P's blocks from 0, D's from the second half (both contiguous)
    num_blocks = 2 * max(counts) + 8
    rows = []
    with writer_pair(model, block_size, num_blocks, device, decode_device, warm) as (cfg, p, d, _):
        lay = L.instance_layout(cfg, cfg.prefill, 0)
        assert L.block_bytes(lay) == lay_bytes, (L.block_bytes(lay), lay_bytes)
        seq = 0
        push_once(cfg, p, d, f"warm#{seq}", [0], [num_blocks // 2], block_size)  # handshake, first-touch
        for n in counts:
            runs = []
            for _ in range(reps):
                seq += 1
                runs.append(push_once(cfg, p, d, f"t{n}#{seq}", list(range(n)),
                                      list(range(num_blocks // 2, num_blocks // 2 + n)), n * block_size,
                                      gap_ms / 1e3))
            rows.append({"blocks": n, "nbytes": runs[0]["nbytes"], "descs": runs[0]["descs"],
                         "secs": statistics.median(r["secs"] for r in runs),
                         "e2e": statistics.median(r["e2e"] for r in runs),
                         "post": statistics.median(r["post"] for r in runs),
                         "posted": statistics.median(r["posted"] for r in runs),
                         "wake": statistics.median(r["wake"] for r in runs),
                         "secs_min": min(r["secs"] for r in runs)})
        p.send(m.encode(m.GetStats()))
        p_stats = _recv(p).counters
    return {"block_bytes": lay_bytes, "rows": rows, "warm_spins": p_stats.get("warm_spins", 0)}


def intercept_text(us: float) -> str:
    """A line's intercept as a fixed cost: below 0 it is none, the times not growing with the bytes over these sizes
    (the one-block row is the cost then)."""
    return f"{us:.0f} us" if us >= 0 else f"not resolved (the line meets 0 bytes at {us:.0f} us)"


def fixed_costs(rows: list[dict]) -> dict:
    """The fixed cost of a transfer: the one-block row, and the intercepts of time against bytes."""
    a, b = fit_line([r["nbytes"] for r in rows], [r["secs"] for r in rows])
    a2, _ = fit_line([r["nbytes"] for r in rows], [r["e2e"] for r in rows])
    one = rows[0]
    return {"fixed_one_block_us": one["secs"] * 1e6, "one_block_post_us": one["post"] * 1e6,
            "fixed_intercept_us": a * 1e6, "fixed_e2e_intercept_us": a2 * 1e6,
            "slope_gbps": 1 / b / 1e9 if b > 0 else float("nan")}


def _copy_gbps(nbytes: int, device: str, decode_device: Optional[str]) -> float:
    from tools.copy_speed import plain_copy_gbps

    return plain_copy_gbps(nbytes, device=device, dst_device=decode_device or device)


def report(model: str, block_size: int, sizes_mib: list[float], reps: int, device: str = "cpu",
           decode_device: Optional[str] = None, warm: str = "auto", gap_ms: float = 0.0, busy: bool = False) -> dict:
    with devices_busy([device, decode_device or device] if busy else []):
        res = measure(model, block_size, sizes_mib, reps, device, decode_device, warm, gap_ms)
    rows = res["rows"]
    print(f"\nwriters only ({model}, block {block_size} tokens = {res['block_bytes'] / 2**10:.0f} KiB, "
          f"{device}{' -> ' + decode_device if decode_device else ''}, medians of {reps}; warm {warm}, "
          f"gap {gap_ms:g} ms, "
          f"devices {'busy' if busy else 'idle'})")
    print(f"{'blocks':>7} {'MiB':>8} {'descs':>6} {'post us':>8} {'post->done us':>14} {'(min)':>7} {'GB/s':>7} "
          f"{'copy GB/s':>10} {'ratio':>6} {'send->recv us':>14}")
    for r in rows:
        gbps = r["nbytes"] / r["secs"] / 1e9 if r["secs"] else float("nan")
        r["gbps"] = gbps
        r["copy_gbps"] = _copy_gbps(r["nbytes"], device, decode_device)
        print(f"{r['blocks']:>7} {r['nbytes'] / 2**20:>8.2f} {r['descs']:>6} {r['post'] * 1e6:>8.0f} "
              f"{r['secs'] * 1e6:>14.0f} {r['secs_min'] * 1e6:>7.0f} "
              f"{gbps:>7.2f} {r['copy_gbps']:>10.2f} {gbps / r['copy_gbps']:>6.2f} {r['e2e'] * 1e6:>14.0f}")
    res.update(fixed_costs(rows))
    one = rows[0]
    print(f"fixed cost: one-block post (map + descriptors + post, on P's writer) {one['post'] * 1e6:.0f} us; "
          f"one-block post->done {one['secs'] * 1e6:.0f} us (send->received {one['e2e'] * 1e6:.0f} us); "
          f"intercept of post->done vs bytes {intercept_text(res['fixed_intercept_us'])} "
          f"(send->received {intercept_text(res['fixed_e2e_intercept_us'])}); slope {res['slope_gbps']:.2f} GB/s; "
          f"P's warm spins {res['warm_spins']}")
    print(f"one-block post's parts: indices + NIXL post {one['posted'] * 1e6:.0f} us, then the wake hint to D "
          f"{one['wake'] * 1e6:.0f} us")
    return res


# ---------------------------------------------------------------------------------------
# Busy GPUs (as in serving) and the warm matrix
# ---------------------------------------------------------------------------------------
BUSY_MATMUL_N = 4096


def _matmul_loop(device: str, ready, stop) -> None:
    """Keep ``device`` computing (bf16 matmuls, a few queued at a time) until ``stop`` is set."""
    import torch

    torch.cuda.set_device(device)
    a = torch.randn(BUSY_MATMUL_N, BUSY_MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = a @ b
    torch.cuda.synchronize()
    ready.set()
    while not stop.is_set():
        for _ in range(8):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()


@contextmanager
def devices_busy(devices: list[str]):
    """A background process per distinct device running a bf16 matmul loop for the whole
    block, so the transfer sees GPUs at work as in serving. CUDA only: refuses the CPU."""
    devices = sorted(set(devices))
    if not devices:
        yield
        return
    if any(not d.startswith("cuda") for d in devices):
        raise ValueError(f"--busy keeps GPUs computing: it needs CUDA devices, got {', '.join(devices)}")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = []
    try:
        readies = []
        for dev in devices:  # started together (each imports torch and makes a CUDA context), then awaited
            ready = ctx.Event()
            pr = ctx.Process(target=_matmul_loop, args=(dev if ":" in dev else "cuda:0", ready, stop), daemon=True)
            pr.start()
            procs.append(pr)
            readies.append((dev, ready))
        end = time.monotonic() + READY_TIMEOUT_S
        for (dev, ready), pr in zip(readies, procs):
            while not ready.wait(0.2):  # a child that dies (no such GPU) fails the run at once
                if not pr.is_alive():
                    raise RuntimeError(f"the matmul loop on {dev} exited (code {pr.exitcode}) before starting")
                if time.monotonic() > end:
                    raise TimeoutError(f"the matmul loop on {dev} did not start")
        yield
    finally:
        stop.set()
        for pr in procs:
            pr.join(20)
            if pr.is_alive():
                pr.kill()
                pr.join()


def warm_matrix(model: str, block_size: int, sizes_mib: list[float], reps: int, device: str = "cpu",
                decode_device: Optional[str] = None, gaps_ms: tuple[float, ...] = (0.0, 20.0),
                busy: tuple[bool, ...] = (False, True)) -> list[dict]:
    """The fixed cost with warm off and on, for each gap between D's registration reaching P
    and SendKV, with the devices idle and busy (busy on CUDA only): one writer pair per
    configuration, one compact line each (64 MiB's GB/s against a plain copy's, when measured)."""
    if device == "cpu" and any(busy):
        print("(devices busy: skipped, CPU devices; --busy needs CUDA)")
        busy = tuple(b for b in busy if not b)
    ref = min(sizes_mib, key=lambda s: abs(s - 64))
    out = []
    print(f"\nwarm matrix ({model}, {device}{' -> ' + decode_device if decode_device else ''}, sizes {sizes_mib} MiB, "
          f"medians of {reps}; {ref:g} MiB GB/s / plain copy's)")
    for b in busy:
        with devices_busy([device, decode_device or device] if b else []):  # once for its four configurations
            out += _matrix_block(model, block_size, sizes_mib, reps, device, decode_device, gaps_ms, b, ref)
    return out


def _matrix_block(model, block_size, sizes_mib, reps, device, decode_device, gaps_ms, b: bool,
                  ref: float) -> list[dict]:
    """The gaps x warm off/on part of the matrix, devices busy or not (``b``); the plain copy
    of ``ref`` MiB is measured once per block, under the same load."""
    out, copy = [], None
    for gap in gaps_ms:
        for warm in ("off", "on"):
            res = measure(model, block_size, sizes_mib, reps, device, decode_device, warm, gap)
            res.update(fixed_costs(res["rows"]))
            row = min(res["rows"], key=lambda r: abs(r["nbytes"] - ref * 2**20))
            if copy is None:
                copy = _copy_gbps(row["nbytes"], device, decode_device)
            gbps = row["nbytes"] / row["secs"] / 1e9
            res.update(warm=warm, gap_ms=gap, busy=b, ref_gbps=gbps, ref_ratio=gbps / copy)
            out.append(res)
            print(f"warm {warm:>3} gap {gap:>3g} ms devices {'busy' if b else 'idle'}: "
                  f"1-block post {res['one_block_post_us']:5.0f} us, post->done {res['fixed_one_block_us']:5.0f} us; "
                  f"intercept {res['fixed_intercept_us']:5.0f} us, send->recv intercept "
                  f"{res['fixed_e2e_intercept_us']:5.0f} us; {ref:g} MiB {gbps:6.2f} GB/s = "
                  f"{gbps / copy:4.2f} x copy; P warm spins {res['warm_spins']}", flush=True)
    return out


# ---------------------------------------------------------------------------------------
# The post path alone: what one transfer costs P's writer to start, ad-hoc against prepared
# ---------------------------------------------------------------------------------------
def _target(conn, nbytes: int, device: str) -> None:
    """D's side: a registered pool, driving progress (politely) until told to stop."""
    import torch

    from pushkv.transport.nixl_agent import NixlAgent

    if device != "cpu":
        torch.cuda.set_device(device)
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    agent = NixlAgent("post-cost-d", device=device)
    agent.register(buf.data_ptr(), nbytes)
    conn.send((agent.metadata(), buf.data_ptr(), agent.dev_id))
    while not conn.poll(0):
        agent.poll_notifs()
        os.sched_yield()
    conn.recv()
    agent.deregister()


def post_cost(model: str, block_size: int, block_counts: list[int], reps: int = 21, device: str = "cpu",
              decode_device: Optional[str] = None) -> list[dict]:
    """Per transfer, median over ``reps`` (the two ways interleaved, so load hits both alike):
    CPU time of this thread from mapping to posted (``cpu``: robust to a crowded host), the
    wall time of the same (``post``), and to completion (``done``), for WRITEs of a run of
    blocks with a WriteDone-sized notification, by ad-hoc descriptors and by prepared index."""
    import multiprocessing as mp

    import torch

    from pushkv.protocol.mapping import map_transfer
    from pushkv.transport.grid import grid_of, indices
    from pushkv.transport.nixl_agent import NixlAgent

    blocks = 2 * max(block_counts) + 8
    cfg = DeploymentConfig(mode="push", model=preset(model),
                           prefill=InstanceConfig(role="prefill", block_size=block_size, num_blocks=blocks),
                           decode=InstanceConfig(role="decode", block_size=block_size, num_blocks=blocks))
    lay = L.instance_layout(cfg, cfg.prefill, 0)
    nbytes = L.pool_bytes(lay)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_target, args=(there, nbytes, decode_device or device), daemon=True)
    child.start()
    rows = []
    try:
        if not here.poll(READY_TIMEOUT_S):
            raise TimeoutError("target process not ready")
        meta, d_base, d_dev = here.recv()
        if device != "cpu":
            torch.cuda.set_device(device)
        buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
        agent = NixlAgent("post-cost-p", device=device)
        agent.register(buf.data_ptr(), nbytes)
        grid = grid_of(lay)
        agent.prepare_local(grid.strided(buf.data_ptr(), agent.dev_id))
        remote = agent.add_remote(meta)
        agent.prepare_remote(remote, grid.strided(d_base, d_dev))
        notif = b"x" * 64
        half = lay.num_blocks // 2

        def one(n: int, prepped: bool) -> tuple[float, float, float]:
            c0, t0 = time.thread_time(), time.perf_counter()
            regions = map_transfer(lay, list(range(n)), lay, list(range(half, half + n)), n * block_size)
            if prepped:
                si, di = indices(grid, grid, regions)
                h = agent.post_prepped("WRITE", si, remote, di, notif)
            else:
                h = agent.post("WRITE", regions, buf.data_ptr(), remote, d_base, notif, d_dev)
            c1, t1 = time.thread_time(), time.perf_counter()
            end = t1 + REPLY_TIMEOUT_S
            while (st := agent.state(h)) == "PROC" and time.perf_counter() < end:
                agent.poll_notifs()
            t2 = time.perf_counter()
            agent.release(h)
            if st != "DONE":
                raise RuntimeError(f"WRITE of {n} blocks ended {st}")
            return c1 - c0, t1 - t0, t2 - t0

        for n in block_counts:
            one(n, False), one(n, True)  # warm both paths
            got = {False: [], True: []}
            for _ in range(reps):
                for prepped in (False, True):
                    got[prepped].append(one(n, prepped))
            for prepped in (False, True):
                runs = got[prepped]
                rows.append({"blocks": n, "nbytes": n * L.block_bytes(lay), "way": "prepared" if prepped else "ad-hoc",
                             "cpu": statistics.median(r[0] for r in runs),
                             "post": statistics.median(r[1] for r in runs),
                             "done": statistics.median(r[2] for r in runs)})
        agent.deregister()
    finally:
        here.send(1)
        child.join(20)
        if child.is_alive():
            child.kill()
    print(f"\npost path alone ({model}, block {block_size} tokens = {L.block_bytes(lay) / 2**10:.0f} KiB, "
          f"{device}{' -> ' + decode_device if decode_device else ''}, medians of {reps}, interleaved)")
    print(f"{'blocks':>7} {'MiB':>8} {'way':>9} {'CPU us':>8} {'post us':>8} {'done us':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['nbytes'] / 2**20:>8.2f} {r['way']:>9} {r['cpu'] * 1e6:>8.0f} "
              f"{r['post'] * 1e6:>8.0f} {r['done'] * 1e6:>8.0f} {r['nbytes'] / r['done'] / 1e9:>7.2f}")
    return rows


# ---------------------------------------------------------------------------------------
# A hung transfer: what P's writer burns while it waits
# ---------------------------------------------------------------------------------------
def stuck_cpu(model: str = "medium", blocks: int = 256, window_s: float = 5.0) -> dict:
    """P's writer CPU (share of one core) while its WRITE hangs: D's writer is SIGSTOPped after
    registering, so the WRITE's completion (which needs D's progress) never comes; measured
    from 1 s after the post for ``window_s``. Then D is resumed and the transfer must finish."""
    with writer_pair(model, 16, 2 * blocks + 8) as (cfg, p, d, procs):
        src = m.PrefillSource(cfg.prefill.engine_id, cfg.prefill.tp, cfg.prefill.handshake_endpoints)
        d_blocks = tuple(range(blocks + 8, 2 * blocks + 8))
        d.send(m.encode(m.ExpectKV("stuck#0", 0, d_blocks, blocks * 16, src, 120.0)))
        _wait_registered(p, "stuck#0")
        p_pid, d_pid = procs[0].pid, procs[1].pid
        c0, t0 = read_cpu_seconds(p_pid), time.monotonic()
        time.sleep(window_s)
        pending = (read_cpu_seconds(p_pid) - c0) / (time.monotonic() - t0)
        os.kill(d_pid, signal.SIGSTOP)
        try:
            p.send(m.encode(m.SendKV("stuck#0", 0, tuple(range(blocks)), blocks * 16, first_token=1)))
            time.sleep(1.0)
            c0, t0 = read_cpu_seconds(p_pid), time.monotonic()
            time.sleep(window_s)
            hung = (read_cpu_seconds(p_pid) - c0) / (time.monotonic() - t0)
        finally:
            os.kill(d_pid, signal.SIGCONT)
        got_d, got_p = _recv(d), _recv(p)
    res = {"hung_core_share": hung, "pending_core_share": pending,
           "finished": isinstance(got_d, m.KVReceived) and isinstance(got_p, m.KVSent)}
    print(f"P writer CPU while its {blocks}-block WRITE hangs (D stopped; {window_s:.0f} s from 1 s after the "
          f"post): {hung * 100:.1f}% of a core; before it, with D's registration pending: {pending * 100:.1f}%; "
          f"after D resumed, the transfer {'finished' if res['finished'] else 'FAILED'}")
    return res


if __name__ == "__main__":  # python -m tools.transfer_writers [--stuck-cpu | model [sizes MiB...]]
    argv = sys.argv[1:]
    if argv[:1] == ["--stuck-cpu"]:
        stuck_cpu(*argv[1:2])
    else:
        report(argv[0] if argv else "medium", 16, [float(s) for s in argv[1:]] or [4, 16, 64], 5)
    sys.exit(0)
