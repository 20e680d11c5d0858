"""The random numbers a request's sampling draws, as pure functions of (seed, index).

Pure Python integers (no torch), so the router can derive per-choice seeds without
importing the model, and every process draws the same numbers for the same request.
"""
from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """The uniform in (0, 1) that draws output token ``index`` of a request seeded ``seed``.

    24 bits, so it is exact in float32 on every device.
    """
    h = _mix64(_mix64(seed & _MASK64) ^ (index * 0x9E3779B97F4A7C15))
    return ((h >> 40) + 0.5) / float(1 << 24)


def derive_seed(seed: int, n: int) -> int:
    """Choice ``n`` of a request with ``n`` > 1 samples from its own stream."""
    return seed if n == 0 else _mix64(seed ^ _mix64(n))
