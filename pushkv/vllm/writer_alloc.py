"""The writer's first phase when it owns a GPU KV cache (``cuda_memory: writer``).

The worker starts its writer from inside vLLM's KV allocation, before there is anything to
describe: the writer allocates the bytes on the worker's device (``cuda_kv.allocate_owned``),
answers ``KVAllocated`` on the worker's event socket with the CUDA IPC handle, and waits on its
command socket for ``DescribeKV`` (vLLM's views of it, once vLLM has made them). Then the writer
proper starts (``writer.py``) over that allocation: NIXL registers the writer's own memory.

The allocation lives as long as this process: a writer that dies takes the worker's KV cache
with it (``worker_side.py`` then stops the worker rather than start another writer).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import torch
import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.vllm import wire as w
from pushkv.vllm.params import remove_socket_files
from pushkv.vllm.writer_args import WriterArgs

log = logging.getLogger(__name__)

DESCRIBE_WAIT_S = 600.0  # vLLM may profile or compile between allocating and registering its KV cache
POLL_MS = 200


class DescribeTimeout(RuntimeError):
    pass


def allocate_and_wait(args: WriterArgs, ctx: Optional[zmq.Context] = None,
                      wait_s: float = DESCRIBE_WAIT_S) -> tuple[torch.Tensor, WriterArgs]:
    """(the allocation, which the caller keeps alive; ``args`` with the description filled in).
    A refusal is told to the worker (``KVAllocated.reason``) and raised."""
    from pushkv.vllm import cuda_kv

    ctx = ctx or zmq.Context.instance()
    cmd = ctx.socket(zmq.PULL)
    events = ctx.socket(zmq.PUSH)
    for sock in (cmd, events):
        sock.setsockopt(zmq.LINGER, 1000)  # the answer must leave before a refusal's exit
        sock.setsockopt(zmq.MAXMSGSIZE, limits.CONTROL_MSG_BYTES)
    try:
        cmd.bind(args.cmd_endpoint)  # before the answer: the description cannot come too early
        events.connect(args.event_endpoint)
        try:
            owned, ipc = cuda_kv.allocate_owned(args.alloc_bytes, args.alloc_device)
        except Exception as e:
            events.send(m.encode(w.KVAllocated(os.getpid(), args.alloc_device, args.alloc_bytes, reason=str(e))))
            raise
        events.send(m.encode(w.KVAllocated(os.getpid(), args.alloc_device, args.alloc_bytes, ipc)))
        log.info("vllm writer: %.1f MiB of KV cache allocated on cuda:%d for the worker (pid %d)",
                 args.alloc_bytes / 2**20, args.alloc_device, args.parent_pid)
        desc = wait_description(cmd, args.parent_pid, wait_s)
    except BaseException:  # this process ends here: its command socket's file with it
        remove_socket_files(args.cmd_endpoint)
        raise
    finally:
        cmd.close(0)
        events.close()
    return owned, dataclasses.replace(args, memory=desc.memory.hex())


def wait_description(cmd: zmq.Socket, parent_pid: int, wait_s: float) -> w.DescribeKV:
    """The worker's ``DescribeKV``; gives up when the worker is gone or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        if cmd.poll(POLL_MS):
            return w.DEC_DESCRIBE.decode(cmd.recv())
        if os.getppid() != parent_pid:
            raise RuntimeError(f"the vLLM worker (pid {parent_pid}) is gone before describing its KV cache")
        if time.monotonic() > deadline:
            raise DescribeTimeout(f"the vLLM worker did not describe its KV cache within {wait_s:.0f}s")
