"""The KV damage of the fault tests of ``--kv-verify``, injected into a writer at its start.

A writer started without faults (``faults.from_env`` gave None) has none of this: its WRITE and
receive paths hold no fault check. Started with faults, ``inject`` wires a ``KVDamage`` in once:

- P: a filter on its side's effects (like ``scheduler/fault_filter.py``): a last WRITE's ``Post``
  may flip a byte it carries (``kv_flip_source``), move a block fewer (``kv_truncate``) or swap
  two destination blocks (``kv_swap_dest``);
- D: around the handlers that report the KV received, push or pull (``kv_flip_dest``), and the one
  that picks what a READ moves (``kv_swap_dest``, ``kv_truncate``).

Each point fires once (``Faults.fire``); the damage itself is ``pushkv/kv/damage.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from pushkv.kv import damage
from pushkv.writer import sides


class Firing(Protocol):
    def fire(self, name: str) -> bool: ...


class KVDamage:
    """Damage to the KV moved by ``writer`` (its ``pool`` and ``layout``, read when it acts)."""

    def __init__(self, faults: Firing, writer: Any):
        self.faults = faults
        self.writer = writer

    # -- P: a filter on the side's effects --------------------------------------------------
    def effects(self, effects: list) -> list:
        return [self._post(e) if isinstance(e, sides.Post) and e.write.last else e for e in effects]

    def _post(self, e: sides.Post) -> sides.Post:
        w, a = self.writer, e.write
        spans = list(a.spans or ((-1, a.token_start, a.token_start + a.num_tokens),))
        if self.faults.fire("kv_flip_source"):  # bytes this WRITE carries, whatever parts took before
            layer, end = damage.carried_last_token(w.layout, spans)
            damage.flip_last_token(w.pool, w.layout, a.block_ids, end, layer)
        if self.faults.fire("kv_truncate"):  # the last span a block short
            g, t, end = spans[-1]
            spans[-1] = (g, t, damage.truncated(end, t, w.layout.block_size))
            a = dataclasses.replace(a, spans=tuple(spans))
        return sides.Post(a, swap_dest=self.faults.fire("kv_swap_dest"))

    # -- D: around its handlers -------------------------------------------------------------
    def received(self, handler: Callable[..., None]) -> Callable[..., None]:
        """Push: ``handler(a, reg, staged)`` reports the KV in ``reg``'s blocks; flip a byte first."""

        def damaged(a: Any, reg: Any, staged: tuple = ()) -> None:
            if reg is not None and self.faults.fire("kv_flip_dest"):
                damage.flip_last_token(self.writer.pool, self.writer.layout, reg.block_ids, reg.num_tokens)
            handler(a, reg, staged)

        return damaged

    def read_done(self, handler: Callable[..., None]) -> Callable[..., None]:
        """Pull: ``handler(fl, msg, now)`` reports the KV a READ moved; flip a byte first."""

        def damaged(fl: Any, msg: Any, now: float) -> None:
            if self.faults.fire("kv_flip_dest"):
                damage.flip_last_token(self.writer.pool, self.writer.layout, msg.block_ids, msg.pull.num_tokens)
            handler(fl, msg, now)

        return damaged

    def read_dest(self, handler: Callable[..., tuple], block_size: int) -> Callable[..., tuple]:
        """Pull: ``handler(msg)`` gives the READ's destination blocks and end token; damage them
        (``block_size``: P's, a block fewer)."""

        def damaged(msg: Any) -> tuple:
            dst, num_tokens = handler(msg)
            if self.faults.fire("kv_swap_dest"):
                dst = damage.swap_first_two(dst)
            if self.faults.fire("kv_truncate"):
                num_tokens = damage.truncated(num_tokens, msg.cached_tokens, block_size)
            return dst, num_tokens

        return damaged
