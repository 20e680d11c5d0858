"""Wire types of the vLLM connector, beside pushkv's own (``pushkv/messages.py``).

Writer <-> writer traffic reuses pushkv's messages unchanged (``Register``,
``WriteDone``, ``WriteFailed``, ``CancelTransfer`` as NIXL notifications).
What is vLLM-specific lives here: the handshake carries vLLM's KV memory
description instead of a pushkv pool layout (a refusal is pushkv's
``HelloRefused``), and the connector's commands and the writer's events carry
vLLM's request id beside the transfer id.
"""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from pushkv.messages import HelloRefused, Msg, PrefillSource
from pushkv.vllm.regions import KVMemory


class VllmHello(Msg, frozen=True):
    """Writer handshake (ZMQ, once per peer pair): NIXL metadata and KV memory, our
    wire version and model (a peer that differs is answered with pushkv's ``HelloRefused``)."""

    engine_id: str
    rank: int
    tp: int
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    memory: KVMemory
    wire_version: int = 0
    model_id: str = ""


# -- connector (vLLM scheduler process) -> writer ------------------------------------
class SendBlocks(Msg, frozen=True):
    """P: this finished request's blocks hold its prompt KV; WRITE them once D registers."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


class ExpectBlocks(Msg, frozen=True):
    """D: these blocks are reserved for the request's prompt KV; register them with P. They hold
    the prompt's tokens from ``cached_tokens`` on: D's prefix cache has the first ones (whole
    blocks), which P then does not WRITE (``Register.cached_tokens``)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    source: PrefillSource
    deadline_s: float
    cached_tokens: int = 0


class CancelBlocks(Msg, frozen=True):
    """The request's transfer ends: its ``leg`` side ("prefill": WRITE nothing, "decode": expect
    nothing) lets go of it. "": the writer's role's side; a ``kv_both`` instance's writer has both."""

    req_id: str
    transfer_id: str
    reason: str = "cancelled"
    leg: Literal["", "prefill", "decode"] = ""


class LayersStored(Msg, frozen=True):
    """P's worker -> its writer (layer streaming): layer group ``group`` of this step has stored
    the request's first ``num_tokens`` tokens in ``block_ids`` once ``event`` (a CUDA IPC event
    handle) completes; empty ``event``: stored already (the CPU)."""

    req_id: str
    transfer_id: str
    group: int
    block_ids: tuple[int, ...]
    num_tokens: int
    event: bytes = b""


class StreamPreempted(Msg, frozen=True):
    """P's worker -> its writer (layer streaming): vLLM preempted the streamed request, freed its
    blocks and will compute its prompt again into new ones; the step that may overwrite the old
    blocks waits for ``StreamReleased``. Ordered after the marks the worker sent before it."""

    req_id: str
    transfer_id: str


class ForgetTransfer(Msg, frozen=True):
    """D: the request ended before D allocated its blocks (aborted while queued): it never
    registers, so P's writers may free the prompt's blocks now rather than at their registration
    deadline. Told to the P ranks of ``source`` this writer is connected to; answered by none."""

    req_id: str
    transfer_id: str
    source: PrefillSource
    reason: str


ConnectorToWriter = Union[SendBlocks, ExpectBlocks, CancelBlocks, LayersStored, StreamPreempted, ForgetTransfer]


class DescribeKV(Msg, frozen=True):
    """Worker -> a writer that allocated the KV cache (``cuda_memory: writer``): what vLLM laid
    out in it (msgpack ``KVMemory``); the writer then registers it with NIXL and says
    ``WriterReady``. Sent once, before any other command (its own decoder, ``DEC_DESCRIBE``)."""

    memory: bytes


# -- writer -> connector (vLLM worker process) ----------------------------------------
class WriterReady(Msg, frozen=True):
    pid: int
    agent_name: str


class KVAllocated(Msg, frozen=True):
    """Writer -> worker (``cuda_memory: writer``): the writer allocated the worker's KV cache on
    ``dev_id``; ``ipc`` is torch's CUDA IPC handle fields of it, msgpack-encoded. A non-empty
    ``reason``: it could not, and why."""

    pid: int
    dev_id: int
    nbytes: int
    ipc: bytes = b""
    reason: str = ""


class BlocksSent(Msg, frozen=True):
    """P: the blocks may be freed (the WRITE completed, or the transfer ended without one)."""

    req_id: str
    transfer_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    num_descs: int = 0
    write_s: float = 0.0


class BlocksReceived(Msg, frozen=True):
    """D: every producer's WRITE landed in the registered blocks."""

    req_id: str
    transfer_id: str
    nbytes: int = 0
    num_descs: int = 0


class BlocksFailed(Msg, frozen=True):
    """D: the KV will not arrive; no late WRITE can land in the blocks any more."""

    req_id: str
    transfer_id: str
    reason: str


class StreamReleased(Msg, frozen=True):
    """P: no WRITE of the preempted stream reads its old blocks any more (answers
    ``StreamPreempted``); the transfer goes on from the blocks vLLM computes it into again."""

    req_id: str
    transfer_id: str


WriterToConnector = Union[WriterReady, KVAllocated, BlocksSent, BlocksReceived, BlocksFailed, StreamReleased]
VllmHandshake = Union[VllmHello, HelloRefused]

DEC_TO_WRITER = msgspec.msgpack.Decoder(ConnectorToWriter)
DEC_DESCRIBE = msgspec.msgpack.Decoder(DescribeKV)
DEC_TO_CONNECTOR = msgspec.msgpack.Decoder(WriterToConnector)
DEC_VHANDSHAKE = msgspec.msgpack.Decoder(VllmHandshake)
