"""The router's background tasks stopped: each cancelled, then awaited, whatever it ended with."""
from __future__ import annotations

import asyncio
from typing import Iterable, Optional


async def cancel_and_wait(tasks: Iterable[Optional[asyncio.Task]]) -> None:
    """Cancel every task given (None: none there), then wait for each to end; a task's own error is its end,
    not the caller's (it stops regardless)."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        try:
            await t
        except (asyncio.CancelledError, Exception):
            pass
