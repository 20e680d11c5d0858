"""Writer of a local (non-disaggregated) instance: owns the pool, moves nothing."""
from __future__ import annotations

from pushkv.writer.base import WriterBase


class LocalWriter(WriterBase):
    def transfer_finished(self, fl, now: float) -> None:  # never posts transfers
        raise AssertionError("local writer posted a transfer")
