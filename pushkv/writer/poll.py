"""How long the writer's loop may sleep, as pure functions (no clock read, no socket).

The loop drives UCX itself (no progress thread), and NIXL notifications have no fd to
wait on, so the poll timeout decides how soon a transfer's completion or a peer's
notification is seen. ZMQ messages wake the loop at once whatever the timeout.

In order:

- ``expected``: a transfer a peer announced (``TransferStarting``) is young: spin;
- ``inflight``: a transfer of ours is young (``spin_s`` of its bytes): spin;
- ``warm``: a transfer with us is coming (P: a registration or a prefill waits for its
  other half; D: blocks registered, the KV not here yet) and warm is on: spin, so the
  post and the completion find NIXL/UCX (and the core) hot instead of waking from a
  sleep (a post after 10 ms idle costs ~10x one right after another, nixl_probe);
- ``stuck``: a transfer of ours overstays: back off from 1 ms to ``STUCK_POLL_MAX_MS``;
- ``pending``: a deadline or a wait: every ``PENDING_POLL_MS``;
- ``idle``: every ``WRITER_IDLE_POLL_MS``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

# something is waiting on a notification (or a peer's one-sided READ may need our progress)
PENDING_POLL_MS = 1
# a transfer is "young" (spin on progress) for SPIN_MIN_S plus its bytes at SPIN_FLOOR_BPS
SPIN_MIN_S = 0.02
SPIN_FLOOR_BPS = 0.5e9
# a transfer past its expected time is slow more often than stuck (TCP's emulated WRITE moves
# only while both sides poll): keep driving it every few ms; a hung one is abandoned at its deadline
STUCK_POLL_MAX_MS = 2
# idle: look every 10 ms (a few µs of CPU each: ~0.1 % of a core) rather than spin; a
# SendKV/HoldKV from the scheduler wakes us at once anyway
WRITER_IDLE_POLL_MS = 10
RECENT_ACTIVITY_S = 0.05  # just after a transfer or notification: the pending rate a while longer

WARM_SETTINGS = ("auto", "on", "off")


class Poll(NamedTuple):
    ms: int  # the poller's timeout; 0 = spin
    why: str  # which rule decided (see the module docstring)


def spin_s(nbytes: int) -> float:
    """How long a transfer of ``nbytes`` may take before we stop spinning on its progress."""
    return SPIN_MIN_S + nbytes / SPIN_FLOOR_BPS


def warm_enabled(setting: str, device: str) -> bool:
    """Whether a writer on ``device`` keeps its loop hot while a transfer is expected, by the
    config's ``setting``: ``auto`` is on for a CUDA device (a core per waiting writer buys tens
    of µs per transfer) and off on the CPU (a crowded host: the spinning would take the core
    the peer needs)."""
    value = setting.strip().lower()
    if value not in WARM_SETTINGS:
        raise ValueError(f"writer warm must be one of {', '.join(WARM_SETTINGS)}, got {value!r}")
    if value == "auto":
        return device.startswith("cuda")
    return value == "on"


def poll_ms(now: float, *, expected_until: Optional[float], inflight_until: Optional[float],
            warm_until: Optional[float], pending: bool, last_activity: float) -> Poll:
    """The loop's next poll timeout. ``expected_until``: the latest end of a peer's announced
    transfer; ``inflight_until``: the latest ``posted + spin_s`` of ours (None: none in
    flight); ``warm_until``: the latest cap of a warm expectation (None: none, or warm off)."""
    if expected_until is not None and now < expected_until:
        return Poll(0, "expected")
    if inflight_until is not None and now < inflight_until:
        return Poll(0, "inflight")  # data is moving and we drive UCX: keep polling
    if warm_until is not None and now < warm_until:
        return Poll(0, "warm")
    if inflight_until is not None:
        # stuck or slow: back off (a tenth of the overrun, up to a cap): a hung transfer
        # costs little CPU until the stuck deadline abandons it
        return Poll(int(min(STUCK_POLL_MAX_MS, max(1.0, (now - inflight_until) * 100))), "stuck")
    if pending or now - last_activity < RECENT_ACTIVITY_S:
        return Poll(PENDING_POLL_MS, "pending")
    return Poll(WRITER_IDLE_POLL_MS, "idle")
