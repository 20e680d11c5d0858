"""A pool handle handed to a worker through its environment.

The supervisor learns the handle from the writer's ``Ready`` and passes it to
the worker it spawns next as ``PUSHKV_POOL``: the msgpack-encoded
``PoolHandle``, base64 so it is printable. No torch here: the supervisor
imports this.
"""
from __future__ import annotations

import base64
import binascii

import msgspec

from pushkv.messages import PoolHandle

POOL_ENV = "PUSHKV_POOL"


def handle_to_env(handle: PoolHandle) -> str:
    return base64.b64encode(msgspec.msgpack.encode(handle)).decode("ascii")


def handle_from_env(value: str) -> PoolHandle:
    try:
        return msgspec.msgpack.decode(base64.b64decode(value, validate=True), type=PoolHandle)
    except (binascii.Error, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{POOL_ENV} does not hold a pool handle ({e}): {value[:40]!r}") from e
