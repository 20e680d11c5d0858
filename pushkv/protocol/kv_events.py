"""KV cache events as vLLM publishes them (``--kv-events-config``), so the routers built on vLLM's events (llm-d's
precise prefix-cache scorer, Dynamo's KV router) place requests on pushkv's instances as they place them on vLLM's.

Pure: the wire types, the setting, and what an instance's prefix cache (``protocol/prefix_cache.py``) did, as
events. The scheduler's shell publishes them (``scheduler/kv_events_pub.py``).

**The wire** is vLLM's (``vllm/distributed/kv_events.py``): each batch is one ZeroMQ multipart message on a PUB
socket, ``(topic, sequence number as 8 big-endian bytes, msgpack payload)``, the payload a ``KVEventBatch``
(an array: the wall time, the events, the data-parallel rank), each event a map tagged by its ``type``:

- ``BlockStored``: a run of consecutive full blocks of one request, now cached: their hashes, the hash of the block
  before the first (None for a prompt's first block), their token ids, the block size, ``medium``, and per block
  the extra keys of its hash (vLLM's: every block of a LoRA adapter's request carries the adapter's name, and a
  prompt's first block under a ``cache_salt`` the salt after it);
- ``BlockRemoved``: blocks evicted, by hash;
- ``AllBlocksCleared``: every cached block forgotten (``/reset_prefix_cache``).

A block's hash is pushkv's (``block_hashes``: sha256 over the block's token ids and its parent's hash), its low 64
bits (``prefix_cache.event_hash``: msgpack's integers, as vLLM cuts its own); a consumer that keys blocks by their
token ids (as llm-d's does) takes them from ``token_ids``. With a ``replay_endpoint`` a consumer that missed batches
asks for them from a sequence number (8 big-endian bytes on a REQ/DEALER socket) and gets each kept batch as
``(sequence, payload)``, then ``(-1, b"")``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec

from pushkv.protocol.prefix_cache import event_hash

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the end of a replay


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: Optional[int] = None


_ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(ts: float, events: list[Event]) -> bytes:
    """One batch as vLLM's publisher sends it: its data-parallel rank filled in, 0 for an engine of one rank (each
    pushkv instance is its own engine, on its own endpoint)."""
    return _ENCODER.encode(KVEventBatch(ts, events, 0))


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's ``KVEventsConfig``, its fields and defaults: ``--kv-events-config '{"enable_kv_cache_events": true}'``
    publishes on ``tcp://*:5557``. Each instance of a deployment publishes on its own port: the first planned (P's
    first) on the endpoint's, each next one on the port after (P's instances, then D's; ``endpoint_for``)."""

    enable_kv_cache_events: bool = False
    publisher: Optional[Literal["null", "zmq"]] = None  # None: "zmq" where enabled, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark: past it a slow consumer loses batches
    max_queue_size: int = 100_000  # vLLM's publisher thread's queue; pushkv publishes on its loop, so unused
    topic: str = ""

    @property
    def on(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON, refused by name where it is no JSON object of vLLM's fields, or an endpoint is
    none pushkv can bind or connect (tcp, ipc, inproc)."""
    try:
        cfg = msgspec.json.decode(text.encode(), type=KVEventsConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"--kv-events-config {text!r}: {e} (vLLM's KVEventsConfig fields: "
                         f"{', '.join(KVEventsConfig.__struct_fields__)})") from None
    return checked(cfg)


def checked(cfg: KVEventsConfig, where: str = "--kv-events-config") -> KVEventsConfig:
    """``cfg``, refused by name (``where``: the flag, or the config file's field that gave it) where an endpoint is
    none pushkv can bind or connect (tcp, ipc, inproc), or a bound is below 1."""
    for name, ep in (("endpoint", cfg.endpoint), ("replay_endpoint", cfg.replay_endpoint)):
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{where} {name} {ep!r}: a ZeroMQ endpoint (tcp://*:5557, ipc://PATH)")
        if ep is not None and ep.startswith("tcp://") and not ep.rsplit(":", 1)[-1].isdigit():
            raise ValueError(f"{where} {name} {ep!r}: a tcp endpoint names its port (tcp://*:5557)")
    for name in ("buffer_steps", "hwm"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{where} {name} {getattr(cfg, name)} must be >= 1")
    return cfg


def endpoint_for(endpoint: Optional[str], ordinal: int) -> Optional[str]:
    """Instance ``ordinal``'s endpoint (0: the one given): a tcp port plus the ordinal, an ipc or inproc name with
    ``_<ordinal>`` after it (vLLM offsets by its data-parallel rank alike); tcp port 0 stays 0, as vLLM leaves it:
    each instance binds a port the system picks (its log line names it)."""
    if not endpoint or ordinal == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + ordinal}" if int(port) else endpoint
    return f"{endpoint}_{ordinal}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, an IPv6 any, ipc or inproc is bound; any other endpoint is connected to (a
    consumer that binds and takes several publishers)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# what a prefix cache did (PrefixCache.journal): ("stored", hash, parent hash (None for a prompt's first block), the
# block's tokens, the request's cache_salt on a first block, else "", the request's LoRA adapter as (slot, name), or
# None) when a block is indexed, ("removed", hash) when
# one is evicted, ("cleared",) when all are forgotten
Entry = tuple


def block_extra_keys(lora_name: Optional[str], salt: str) -> Optional[tuple[Any, ...]]:
    """One block's ``extra_keys`` as vLLM publishes them (``to_event_extra_keys``): its LoRA adapter's name on every
    block of an adapter's request, then the ``cache_salt`` on a prompt's first block; None where there is neither."""
    keys = ((lora_name,) if lora_name else ()) + ((salt,) if salt else ())
    return keys or None


def events_of(journal: list[Entry], block_size: int, medium: str) -> list[Event]:
    """The journal as vLLM's events, in order: consecutive stored blocks that chain (each the parent of the next)
    in one ``BlockStored``, consecutive removals in one ``BlockRemoved``."""
    out: list[Event] = []
    for e in journal:
        last = out[-1] if out else None
        if e[0] == "stored":
            _, h, parent, tokens, salt, lora = e
            h, parent = event_hash(h), (None if parent is None else event_hash(parent))
            lora_id, lora_name = lora if lora else (None, None)
            extra = block_extra_keys(lora_name, salt)
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent and not salt \
                    and last.lora_id == lora_id and last.lora_name == lora_name:
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
                if last.extra_keys is not None:
                    last.extra_keys.append(extra)
                continue
            out.append(BlockStored([h], parent, list(tokens), block_size, lora_id, medium, lora_name,
                                   [extra] if extra else None, 0))
        elif e[0] == "removed":
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(event_hash(e[1]))
            else:
                out.append(BlockRemoved([event_hash(e[1])], medium, 0))
        elif e[0] == "cleared":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"events_of: unknown journal entry {e!r}")
    return out
