"""The default pin fraction: what it is, that it is the one the router uses, that pins never pass
it, and that a value outside [0, 1] is refused before anything starts.

Its run under load is tests/e2e/test_overload_defaults.py (the peak of pinned blocks D shows on
/health stays within the default fraction).
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pushkv.config import DeploymentConfig
from pushkv.discovery.records import InstanceRecord
from pushkv.router import policy as P
from pushkv.router.balance import Balancer

DEFAULT = DeploymentConfig().push_pin_fraction


def test_the_default_is_half_of_d():
    assert DEFAULT == 0.5


@pytest.mark.parametrize("value", [0.0, 0.25, 0.5, 1.0])
def test_a_fraction_in_range_is_taken(value):
    assert DeploymentConfig(push_pin_fraction=value).push_pin_fraction == value


@pytest.mark.parametrize("value", [-0.01, 1.01, 2.0, math.nan, math.inf, -math.inf])
def test_a_fraction_out_of_range_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError) as e:
        DeploymentConfig(push_pin_fraction=value)
    assert "--push-pin-fraction" in str(e.value) and "[0, 1]" in str(e.value)


def test_up_refuses_a_fraction_out_of_range_before_starting_anything():
    r = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--mode", "push", "--model", "small",
                        "--push-pin-fraction", "1.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert "--push-pin-fraction" in r.stderr and "1.5" in r.stderr, r.stderr


def _rec(eid, role, num_blocks):
    return InstanceRecord(engine_id=eid, role=role, sched_endpoint=f"ipc:///x/{eid}", handshake_endpoints=("hs",),
                          num_blocks=num_blocks, block_size=16)


class _Run:
    def __init__(self, tid, tokens):
        self.transfer_id, self.prompt, self.max_tokens = tid, (1,) * (tokens - 16), 16
        self.got: list = []
        self.reuses_prefix = True

    @property
    def decode_tokens(self):
        return len(self.prompt) + self.max_tokens

    def deliver(self, role, msg):
        self.got.append(msg)


@pytest.mark.parametrize("need_blocks", [1, 3, 7, 10])
def test_the_default_bounds_what_is_pinned(need_blocks):
    """Under the default, a burst pins at most half of D; the rest falls back to late allocation,
    and D's other half is there for late legs (of any size up to half a pool)."""
    b = Balancer("push", DEFAULT, queue_bound=1000)
    b.add(_rec("p0", "prefill", 10_000), lambda r: object())
    b.add(_rec("d0", "decode", 100), lambda r: object())
    kinds = [b.request(_Run(f"t{i}", need_blocks * 16)) for i in range(200)]
    d = b.loads["d0"]
    pushed = sum(1 for v in kinds if v is not None and v.kind == P.PUSH)
    assert d.pinned == pushed * need_blocks <= DEFAULT * d.num_blocks
    assert d.pinned + need_blocks > DEFAULT * d.num_blocks  # filled up to the bound, not short of it
    assert sum(1 for v in kinds if v is not None and v.kind == P.LATE) == 200 - pushed
