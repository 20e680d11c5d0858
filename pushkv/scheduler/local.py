"""The local scheduler: one instance prefills and decodes (no KV moves)."""
from __future__ import annotations

from typing import Optional

from pushkv import messages as m
from pushkv.scheduler.core import SchedulerCore, WriterAnswer
from pushkv.scheduler.requests import Request, State


class LocalScheduler(SchedulerCore):
    role = "local"

    def _admitted(self, r: Request) -> None:
        r.state = State.PREFILL

    def _prefilled(self, r: Request, tok: int, lp: Optional[m.TokenLogprob] = None) -> None:
        self._emit(r, tok, lp)

    def _kv_done(self, r: Request, answers: dict[int, WriterAnswer]) -> None:
        raise AssertionError(f"local instance got a KV transfer answer transfer_id={r.transfer_id}")
