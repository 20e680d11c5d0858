"""The warm path: a writer keeps its loop hot while a transfer with it is expected.

The decision is pure (``pushkv/writer/poll.py``): table tests. Then two real writer processes
over real NIXL: with warm on, P's writer spins while D's registration waits for the prefill
(``warm_spins`` grows, ``warm_expected`` is 1) and goes back to sleeping once the WRITE is done;
with warm off it never spins for it. A warm D says so in its registration, and P then skips
the wake hint (a ZMQ send on its post path).
"""
import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.writer import poll as P
from tests.support.procs import children, dealer, leftover_shm, planned, recv

NOW = 100.0
IDLE, PENDING, STUCK = P.WRITER_IDLE_POLL_MS, P.PENDING_POLL_MS, P.STUCK_POLL_MAX_MS

# (expected_until, inflight_until, warm_until, pending, last_activity) -> (ms, why)
POLL_CASES = [
    ((None, None, None, False, 0.0), (IDLE, "idle")),
    ((None, None, None, True, 0.0), (PENDING, "pending")),
    ((None, None, None, False, NOW - 0.01), (PENDING, "pending")),  # just active
    ((NOW + 1, None, None, False, 0.0), (0, "expected")),
    ((NOW - 1, None, None, False, 0.0), (IDLE, "idle")),  # announced long ago: no spin
    ((None, NOW + 1, None, False, 0.0), (0, "inflight")),
    ((None, NOW - 0.001, None, False, 0.0), (1, "stuck")),
    ((None, NOW - 0.015, None, False, 0.0), (1, "stuck")),  # a tenth of the overrun (int ms)
    ((None, NOW - 0.105, None, False, 0.0), (STUCK, "stuck")),  # capped: a slow transfer is still driven
    ((None, NOW - 60, None, True, 0.0), (STUCK, "stuck")),
    ((None, None, NOW + 1, False, 0.0), (0, "warm")),  # a registration waits: spin
    ((None, None, NOW + 1, True, 0.0), (0, "warm")),  # ... even with deadlines pending
    ((None, None, NOW - 1, True, 0.0), (PENDING, "pending")),  # past its cap: the pending rate
    ((None, None, NOW - 1, False, 0.0), (IDLE, "idle")),
    ((None, NOW - 60, NOW + 1, False, 0.0), (0, "warm")),  # a stuck one does not slow the expected one
    ((None, NOW + 1, NOW + 1, False, 0.0), (0, "inflight")),  # a young transfer is counted as such
    ((NOW + 1, None, NOW + 1, False, 0.0), (0, "expected")),
]


@pytest.mark.parametrize("args,want", POLL_CASES)
def test_poll_ms(args, want):
    e, i, w, pending, last = args
    assert P.poll_ms(NOW, expected_until=e, inflight_until=i, warm_until=w, pending=pending,
                     last_activity=last) == want


@pytest.mark.parametrize("setting,device,want", [
    ("auto", "cuda:0", True),
    ("auto", "cuda", True),
    ("auto", "cpu", False),
    ("on", "cpu", True),
    ("off", "cuda:1", False),
    (" ON ", "cpu", True),
])
def test_warm_enabled(setting, device, want):
    assert P.warm_enabled(setting, device) is want


@pytest.mark.parametrize("setting", ["sometimes", "yes"])
def test_warm_enabled_refuses_unknown(setting):
    with pytest.raises(ValueError, match="auto, on, off"):
        P.warm_enabled(setting, "cpu")


def test_plan_refuses_unknown_warm(tmp_path):
    with pytest.raises(ValueError, match="writer_warm"):
        planned(DeploymentConfig(mode="push", model=preset("tiny"), writer_warm="maybe"), tmp_path)


@pytest.mark.parametrize("flags,want", [([], "auto"), (["--writer-warm", "on"], "on"),
                                         (["--writer-warm", "off"], "off")])
def test_up_flag_reaches_the_config(flags, want):
    from processes import cli

    assert cli.config_from_args(cli.build_parser().parse_args(["up", *flags])).writer_warm == want


# -- real writers --------------------------------------------------------------------------
WINDOW_S = 0.1  # an observation window, to show a counter does NOT grow (what we wait on otherwise is events)


def stats(sock) -> dict:
    sock.send(m.encode(m.GetStats()))
    return recv(sock, m.DEC_WRITER_TO_SCHED).counters


def growth_over_window(sock, name: str = "warm_spins") -> int:
    """How much counter ``name`` grows within WINDOW_S (asking all along: no sleep)."""
    import time

    before, end = stats(sock).get(name, 0), time.monotonic() + WINDOW_S
    while time.monotonic() < end:
        stats(sock)
    return stats(sock).get(name, 0) - before


def wait_for(sock, name: str, at_least: int, timeout_s: float = 20.0) -> dict:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        st = stats(sock)
        if st.get(name, 0) >= at_least:
            return st
    raise TimeoutError(f"counter {name} never reached {at_least}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", ["on", "off"])
def test_prefill_writer_spins_while_a_registration_waits(warm, tmp_path):
    cfg = DeploymentConfig(
        mode="push", push_stream="off", model=preset("tiny"), writer_warm=warm,
        prefill=InstanceConfig(role="prefill", num_blocks=16, block_size=16),
        decode=InstanceConfig(role="decode", num_blocks=16, block_size=16),
    )
    cfg = planned(cfg, tmp_path)
    with children(cfg, [("writer", "prefill", 0), ("writer", "decode", 0)]):
        p, d = dealer(cfg.prefill.writer_endpoints[0]), dealer(cfg.decode.writer_endpoints[0])
        try:
            src = cfg.prefill.source()
            d.send(m.encode(m.ExpectKV("w#0", 0, (3, 4), 20, src, 60.0)))
            wait_for(p, "registrations_received", 1)  # D's registration waits at P for the prefill
            for w in (p, d):  # P waits for the prefill, D for the KV: warm spins (a core each), else sleeps
                if warm == "on":
                    wait_for(w, "warm_spins", stats(w).get("warm_spins", 0) + 100)
                else:
                    assert growth_over_window(w) == 0
                assert stats(w)["warm_expected"] == (1 if warm == "on" else 0)
            if warm == "on":  # and P keeps its WRITE path warm: beats into D's sink, never into its pool
                wait_for(p, "warm_beats", 3)
            else:
                assert stats(p).get("warm_beats", 0) == 0
            p.send(m.encode(m.SendKV("w#0", 0, (0, 1), 20, first_token=7)))
            got_d = recv(d, m.DEC_WRITER_TO_SCHED)
            got_p = recv(p, m.DEC_WRITER_TO_SCHED)
            assert isinstance(got_d, m.KVReceived) and isinstance(got_p, m.KVSent), (got_d, got_p)
            # done: nothing expected any more, and the loop no longer spins for it
            assert stats(p)["warm_expected"] == 0 and stats(d)["warm_expected"] == 0
            assert growth_over_window(p) == 0 and growth_over_window(d) == 0  # back to sleeping between polls
            assert growth_over_window(p, "warm_beats") == 0  # no more beats once the WRITE is posted
            assert stats(p).get("warm_beats_failed", 0) == 0
            # a warm D said so in its registration: P skipped the wake hint on its post path
            assert stats(p).get("wake_hints_skipped", 0) == (1 if warm == "on" else 0)
            assert stats(d).get("wake_hints", 0) == (0 if warm == "on" else 1)
            assert dict(got_p.timeline).keys() >= {"write_post_start", "write_post_returned", "write_woke",
                                                   "write_posted", "write_done"}
        finally:
            p.close(0)
            d.close(0)
    assert leftover_shm(cfg.deployment_id) == []


# -- P's warm bookkeeping follows the rendezvous (no sockets: the writer object, not its process) --
def _prefill_writer(warm: str):
    from pushkv.writer.prefill import PrefillWriter

    cfg = DeploymentConfig(mode="push", push_stream="off", model=preset("tiny"), writer_warm=warm,
                           prefill=InstanceConfig(role="prefill", num_blocks=8),
                           decode=InstanceConfig(role="decode", num_blocks=8))
    w = PrefillWriter(cfg, cfg.prefill, 0)
    w.sent, w.sched = [], None
    w.send = lambda ch, msg, identity=None: w.sent.append(msg)  # the scheduler channel, recorded
    return w


def _reg(tid: str) -> m.Register:
    return m.Register(tid, 0, "d", 0, 1, (1,), 16, 30.0)


@pytest.mark.parametrize("first", ["registration", "prefill"])
@pytest.mark.parametrize("end", ["cancel", "expire"])
def test_prefill_warm_follows_the_rendezvous(first, end):
    w = _prefill_writer("on")
    now = 10.0
    if first == "registration":  # D's registration waits for our prefill
        w.apply(w.rdv.on_registration(_reg("a"), now), now)
    else:  # our prefill waits for D's registration
        w.apply(w.rdv.on_prefill_done("a", 0, (2,), 16, 1, now), now)
    w._sync_warm(("a", 0), now)
    cap = now + w.cfg.timeouts.registration_wait_s
    assert w.warmup.warm == {("a", 0): cap}
    w._sync_warm(("a", 0), now + 5)  # still waiting: the first cap holds
    assert w.warmup.warm == {("a", 0): cap}
    if end == "cancel":
        w.apply(w.rdv.cancel("a", 0, "gone", now + 1), now + 1)
    else:
        w.apply(w.rdv.expire(cap + 1), cap + 1)
    assert w.rdv.state_of("a", 0) is None and w.warmup.warm == {}
    if first == "prefill":  # our blocks went back to the scheduler with the failure
        assert [type(x).__name__ for x in w.sent] == ["KVFailed"]


def test_prefill_warm_off_keeps_nothing():
    w = _prefill_writer("off")
    w.apply(w.rdv.on_registration(_reg("a"), 1.0), 1.0)
    w._sync_warm(("a", 0), 1.0)
    assert w.warmup.warm == {}


def test_prefill_writer_says_a_transfer_ended_by_a_dead_decode_instance():
    """Our prefill waits for a D that died: the blocks go back with KVFailed.lost naming the death
    (the scheduler then answers the request as the router would); any other failure has none."""
    w = _prefill_writer("off")
    w.apply(w.rdv.on_prefill_done("a", 0, (2,), 16, 1, 1.0), 1.0)
    w._record(("a", 0)).d_engine_id = "d"
    w.apply(w.rdv.on_prefill_done("b", 0, (3,), 16, 1, 1.0), 1.0)
    w.peer_instance_down("d", "decode-worker-0 died (killed by SIGKILL)", 2.0)
    w.apply(w.rdv.cancel("b", 0, "aborted", 2.0), 2.0)
    assert [(x.transfer_id, x.lost) for x in w.sent] == [
        ("a", "decode instance failed: decode-worker-0 died (killed by SIGKILL)"), ("b", "")]
