"""Kept for ``pushkv/vllm/writer.py`` alone, until it imports ``pushkv.trace.stamp``: the stamps
are ``pushkv.trace``'s now, and the log reader is ``tools/vllm_timing.py``."""
from __future__ import annotations

from pushkv.trace import stamp as mark

__all__ = ["mark"]
