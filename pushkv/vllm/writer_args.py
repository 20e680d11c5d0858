"""The vLLM writer's command line, one copy: the worker connector builds it
(:meth:`WriterArgs.argv`), the writer process parses it (:func:`parse`)."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, fields

from pushkv import envs


@dataclass(frozen=True)
class WriterArgs:
    role: str  # "prefill" | "decode"
    engine_id: str
    fd: int  # inherited shared-memory fd of the KV cache (-1: a GPU's, by ``cuda_ipc`` or ``alloc_bytes``)
    memory: str  # msgpack KVMemory, hex ("" with ``alloc_bytes``: the worker describes it later)
    cmd_endpoint: str
    event_endpoint: str
    handshake_endpoint: str
    parent_pid: int
    rank: int = 0
    tp: int = 1
    model_id: str = ""  # what the KV means (peers must name the same)
    registration_wait_s: float = 30.0
    transfer_s: float = 30.0
    secret_file: str = ""  # CURVE secret for the tcp handshake sockets
    cuda_ipc: str = ""  # the GPU KV storage's CUDA IPC handle, hex (cuda_kv.export); "": host memory (fd)
    stream_groups: int = 0  # layer streaming: layer groups WRITTEN apart as the worker marks them; 0: off
    alloc_bytes: int = 0  # cuda_memory writer: allocate the worker's KV cache (this many bytes) first
    alloc_device: int = -1  # ... on this CUDA device

    def argv(self) -> list[str]:
        """The command that starts the writer process with these arguments."""
        out = [sys.executable, "-m", "pushkv.vllm.writer"]
        for f in fields(self):
            out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="pushkv writer for one vLLM worker (started by the connector)")
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fd", type=int, required=True, help="inherited shared-memory fd of the KV cache")
    ap.add_argument("--memory", required=True, help="msgpack KVMemory, hex ('' with --alloc-bytes)")
    ap.add_argument("--model-id", default="", help="what the KV means (peers must name the same)")
    ap.add_argument("--cmd-endpoint", required=True)
    ap.add_argument("--event-endpoint", required=True)
    ap.add_argument("--handshake-endpoint", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--registration-wait-s", type=float, default=30.0)
    ap.add_argument("--transfer-s", type=float, default=30.0)
    ap.add_argument("--secret-file", default="", help="CURVE secret for the tcp handshake sockets")
    ap.add_argument("--cuda-ipc", default="", help="the GPU KV storage's CUDA IPC handle, hex")
    ap.add_argument("--stream-groups", type=int, default=0, help="layer groups streamed apart; 0: off")
    ap.add_argument("--alloc-bytes", type=int, default=0,
                    help="allocate the worker's KV cache (this many bytes) on --alloc-device first; 0: the worker's")
    ap.add_argument("--alloc-device", type=int, default=-1, help="the CUDA device of --alloc-bytes")
    return ap


def parse(argv=None) -> WriterArgs:
    return WriterArgs(**vars(parser().parse_args(argv)))


def set_up_process(args: WriterArgs) -> None:
    """The writer process's logging (PUSHKV_LOG) and its title (``ps`` shows what it serves)."""
    logging.basicConfig(level=envs.get("PUSHKV_LOG"),
                        format=f"%(asctime)s pushkv-writer[{args.role}-{args.rank}] %(levelname)s %(message)s")
    try:
        import setproctitle

        setproctitle.setproctitle(f"pushkv-vllm-writer {args.role} {args.engine_id} rank {args.rank}")
    except ImportError:
        pass
