"""The torch.distributed group of one instance's TP ranks, on one host: rank 0 serves the group's rendezvous store
(torch's ``TCPStore``) on a socket it binds to the planned address itself (``dist_init``, loopback by default), and
the other ranks connect to it. torch's own store would bind every interface whatever host it is given, so any host
could read and write the group's keys; the gloo transport (CPU) is held to loopback likewise."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any
from urllib.parse import urlsplit

LOOPBACKS = ("127.0.0.1", "localhost", "::1")
STORE_TIMEOUT = datetime.timedelta(seconds=300)  # torch's own default: a rank waits this long for the others


def store_address(dist_init: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` init method."""
    url = urlsplit(dist_init)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"dist_init must be tcp://HOST:PORT, got {dist_init!r}")
    return url.hostname, url.port


def group_store(dist_init: str, rank: int, world_size: int) -> Any:
    """The group's store: rank 0 serves it on a socket bound to dist_init's host only; the others connect."""
    import torch.distributed as dist

    host, port = store_address(dist_init)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, STORE_TIMEOUT)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    # the store owns the socket from here (it closes it when it is destroyed): handed over, not shared
    return dist.TCPStore(host, port, world_size, True, STORE_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def init_group(backend: str, dist_init: str, rank: int, world_size: int) -> None:
    """torch.distributed's default group over ``group_store``; on a loopback address, gloo's transport too."""
    import torch.distributed as dist

    if not dist_init.startswith("tcp://"):  # a deployment's own init method (file://...), as torch takes it
        dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=world_size)
        return
    host, _ = store_address(dist_init)
    if backend == "gloo" and host in LOOPBACKS:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, store=group_store(dist_init, rank, world_size), rank=rank,
                            world_size=world_size)
