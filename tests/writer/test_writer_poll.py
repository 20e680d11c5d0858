"""The writer's poll policy (pure, no sockets): spin while data should be moving, back
off for a transfer that overstays, never spin for one announced long ago."""
import time

import pytest

from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.writer import base as B
from pushkv.writer import poll as P
from pushkv.writer import warm as W


class _Writer(B.WriterBase):
    pending = False

    def has_pending(self) -> bool:
        return self.pending


@pytest.fixture
def writer(monkeypatch):
    monkeypatch.setattr(W.os, "sched_yield", lambda: None)  # a unit test: no need to give the core away
    cfg = DeploymentConfig(mode="push", model=preset("tiny"), prefill=InstanceConfig(role="prefill", num_blocks=8))
    return _Writer(cfg, cfg.prefill, 0)


def _inflight(w, age_s: float, nbytes: int = 0) -> None:
    inflight = w.posting.inflight
    inflight[("t", len(inflight))] = B.InFlight("t", 0, posted=time.monotonic() - age_s, nbytes=nbytes)


@pytest.mark.parametrize("age_s,nbytes,lo,hi", [
    (0.0, 0, 0, 0),  # just posted: spin
    (P.SPIN_MIN_S + 0.5, int(1e9), 0, 0),  # 1 GB is still young at 0.5 GB/s for 2 s
    (P.SPIN_MIN_S + 0.001, 0, 1, 1),  # just past its time: 1 ms
    (P.SPIN_MIN_S + 0.015, 0, 1, P.STUCK_POLL_MAX_MS),  # a tenth of the overrun, within the cap
    (60.0, 0, P.STUCK_POLL_MAX_MS, P.STUCK_POLL_MAX_MS),  # stuck: capped
])
def test_inflight_spins_then_backs_off(writer, age_s, nbytes, lo, hi):
    _inflight(writer, age_s, nbytes)
    assert lo <= writer.poll_timeout_ms() <= hi


def test_youngest_transfer_decides(writer):
    _inflight(writer, 60.0)
    _inflight(writer, 0.0)
    assert writer.poll_timeout_ms() == 0


def test_announced_transfer_spins_until_its_time(writer):
    writer.last_activity = 0.0
    assert writer.poll_timeout_ms() == P.WRITER_IDLE_POLL_MS
    writer.warmup.expected[("t", 0)] = time.monotonic() + 1.0
    assert writer.poll_timeout_ms() == 0
    writer.warmup.transfer_arrived("t", 0)
    assert writer.poll_timeout_ms() == P.WRITER_IDLE_POLL_MS
    writer.warmup.expected[("t", 1)] = time.monotonic() - 0.001  # overstayed: dropped, no spin
    writer.pending = True
    assert writer.poll_timeout_ms() == P.PENDING_POLL_MS
    assert not writer.warmup.expected


class _States:
    """NixlAgent.reap over scripted handle states (a string, or an exception to raise)."""

    def __init__(self, states):
        from pushkv.transport.nixl_agent import NixlAgent

        self.agent = NixlAgent.__new__(NixlAgent)
        self.released = []
        self.agent.state = lambda h: states[h] if isinstance(states[h], str) else (_ for _ in ()).throw(states[h])
        self.agent.release = self.released.append


@pytest.mark.parametrize("states,stuck,pending,failure,released", [
    ({"a": "DONE", "b": "PROC"}, "", ["b"], "", ["a"]),
    ({"a": "ERR", "b": "DONE"}, "", [], "failed in flight", ["a", "b"]),
    ({"a": RuntimeError("gone"), "b": "ERR"}, "", [], "gone", ["a", "b"]),  # the first failure wins
    ({"a": "PROC", "b": "DONE"}, "stuck", [], "stuck", ["a", "b"]),  # stuck: in-flight ones abandoned
    ({"a": "DONE"}, "stuck", [], "", ["a"]),
])
def test_reap_releases_what_ended(states, stuck, pending, failure, released):
    s = _States(states)
    assert s.agent.reap(list(states), "failed in flight", stuck) == (pending, failure)
    assert s.released == released
