"""A TP instance's torch.distributed store listens on the planned address only (loopback on one host): torch's own
TCPStore bound every interface, so any host could read and write the group's keys. Two real ranks (gloo) meet
through it and all-reduce; while they do, the kernel's table of listening sockets shows the store's port bound to
127.0.0.1 alone. Then rank 1 dies, and rank 0's next all-reduce fails as a peer's death (``peer_rank_gone``)."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from pushkv.supervisor.plan import free_tcp_port
from pushkv.worker import tp_group

pytestmark = pytest.mark.timeout(120)


def _rank(dist_init: str, rank: int, out) -> None:
    import torch
    import torch.distributed as dist

    tp_group.init_group("gloo", dist_init, rank, 2)
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    if rank == 0:
        out.put(("listening", _listening(int(dist_init.rsplit(":", 1)[1]))))
    dist.barrier()
    out.put((rank, float(x)))
    if rank == 1:  # dies as a SIGKILLed rank does: no goodbye (its answer flushed first)
        out.close()
        out.join_thread()
        os._exit(0)
    try:  # rank 0's next collective meets a dead peer
        dist.all_reduce(x)
        out.put(("peer_gone", None))
    except Exception as e:
        from pushkv.worker.engine import peer_rank_gone

        out.put(("peer_gone", peer_rank_gone(e)))


def _listening(port: int) -> list[str]:
    """The local addresses that listen on ``port`` (/proc/net/tcp and tcp6: state 0A)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    found.append(addr)
    return found


def test_the_tp_store_listens_on_loopback_only_and_the_ranks_meet_through_it():
    dist_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(dist_init, r, out)) for r in (1, 0)]  # the client first: it waits
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in range(4))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert got[0] == got[1] == 3.0
    assert got["listening"] == ["0100007F"], got["listening"]  # 127.0.0.1, and no other address
    # a step's collective that meets a dead rank is told apart (one log line, no traceback: worker/engine.py)
    assert got["peer_gone"] is True


def test_a_malformed_init_address_is_refused_by_name():
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        tp_group.store_address("tcp://127.0.0.1")
