"""Instance choice: the pure policy (tables), the balancer's accounting over it
(plain calls, no sockets), and the single-host discovery tracker."""
from __future__ import annotations

import msgspec
import pytest

from pushkv import messages as m
from pushkv.config import PRESETS, DeploymentConfig, InstanceConfig, RopeScaling
from pushkv.discovery.local import InstanceTracker
from pushkv.discovery.records import InstanceDown, InstanceHealth, InstanceRecord, InstanceUp
from pushkv.router import policy as P
from pushkv.router.balance import Balancer, Refused, prefix_caching
from pushkv.router.request import DecodePlaced, Placed
from pushkv.supervisor.plan import plan_deployment, process_specs


def pf(eid, queued=0, legs=0, up=True, order=0):
    return P.Load(eid, "prefill", num_blocks=100, queued_tokens=queued, legs=legs, up=up, order=order)


def dc(eid, num=100, committed=0, pinned=0, legs=0, up=True, order=0, bs=16):
    return P.Load(eid, "decode", num_blocks=num, block_size=bs, committed=committed, pinned=pinned, legs=legs,
                  up=up, order=order)


# (loads, expected P) -- fewest queued prefill tokens, then fewest legs, then index; dead ones never
PREFILL = [
    ([pf("p0", 500), pf("p1", 100, order=1)], "p1"),
    ([pf("p0", 100, legs=3), pf("p1", 100, legs=1, order=1)], "p1"),
    ([pf("p0"), pf("p1", order=1)], "p0"),
    ([pf("p0", 0, up=False), pf("p1", 900, order=1)], "p1"),
    ([pf("p0", up=False)], None),
    ([dc("d0")], None),
]


@pytest.mark.parametrize("loads,want", PREFILL)
def test_pick_prefill(loads, want):
    got = P.pick_prefill(loads)
    assert (got.engine_id if got else None) == want


# (loads, tokens, expected D) -- must hold ceil(tokens / block) blocks; then most left free; fewest legs
DECODE = [
    ([dc("d0", committed=50), dc("d1", committed=10, order=1)], 160, "d1"),
    ([dc("d0", committed=95), dc("d1", committed=90, order=1)], 160, "d1"),  # d0 has 5 free, needs 10
    ([dc("d0", committed=95), dc("d1", committed=91, order=1)], 160, None),  # neither can hold 10
    ([dc("d0", committed=90)], 160, "d0"),  # exactly enough
    ([dc("d0", legs=4), dc("d1", legs=1, order=1)], 16, "d1"),  # same room: fewer running
    ([dc("d0", up=False), dc("d1", committed=99, order=1)], 16, "d1"),
    ([dc("d0", bs=32, committed=95), dc("d1", committed=91, order=1)], 160, "d0"),  # 5 blocks of 32 = 160
]


@pytest.mark.parametrize("loads,tokens,want", DECODE)
def test_pick_decode(loads, tokens, want):
    got = P.pick_decode(loads, tokens)
    assert (got.engine_id if got else None) == want


# (loads, tokens, mode, waiting, bound, pin_fraction) -> (kind, P, D, status)
PLACE = [
    # room on D and nothing pinned: push, both legs now
    ([pf("p0"), dc("d0")], 160, "push", 0, 4, 0.5, (P.PUSH, "p0", "d0", 0)),
    # pull mode: always late (D after P)
    ([pf("p0"), dc("d0")], 160, "pull", 0, 4, 0.5, (P.LATE, "p0", None, 0)),
    # D short of blocks: 45 of 100 already wait for KV, +10 > 50 -> late allocation
    ([pf("p0"), dc("d0", committed=45, pinned=45)], 160, "push", 0, 4, 0.5, (P.LATE, "p0", None, 0)),
    # the same with a laxer cap: push
    ([pf("p0"), dc("d0", committed=45, pinned=45)], 160, "push", 0, 4, 1.0, (P.PUSH, "p0", "d0", 0)),
    # no D can hold it now: wait at the router
    ([pf("p0"), dc("d0", committed=95)], 160, "push", 0, 4, 0.5, (P.WAIT, None, None, 0)),
    # others already wait: FIFO, even when a D has room
    ([pf("p0"), dc("d0")], 160, "push", 1, 4, 0.5, (P.WAIT, None, None, 0)),
    # queue full: 429
    ([pf("p0"), dc("d0", committed=95)], 160, "push", 4, 4, 0.5, (P.REFUSE, None, None, 429)),
    # bound 0: never wait
    ([pf("p0"), dc("d0", committed=95)], 160, "push", 0, 0, 0.5, (P.REFUSE, None, None, 429)),
    # no live instance of a role: 503
    ([pf("p0", up=False), dc("d0")], 160, "push", 0, 4, 0.5, (P.REFUSE, None, None, 503)),
    ([pf("p0"), dc("d0", up=False)], 160, "push", 0, 4, 0.5, (P.REFUSE, None, None, 503)),
    ([pf("p0")], 160, "pull", 0, 4, 0.5, (P.REFUSE, None, None, 503)),
    # larger than any D's whole pool: 413, never queued
    ([pf("p0"), dc("d0", num=5)], 160, "push", 0, 4, 0.5, (P.REFUSE, None, None, 413)),
    # two of each: least-loaded P, emptiest D
    ([pf("p0", 300), pf("p1", 20, order=1), dc("d0", committed=60), dc("d1", committed=20, order=1)], 160, "push",
     0, 4, 0.5, (P.PUSH, "p1", "d1", 0)),
]


@pytest.mark.parametrize("loads,tokens,mode,waiting,bound,pin,want", PLACE)
def test_place(loads, tokens, mode, waiting, bound, pin, want):
    v = P.place(loads, tokens, mode=mode, pin_fraction=pin, waiting=waiting, queue_bound=bound)
    assert (v.kind, v.prefill, v.decode, v.status) == want
    if v.kind == P.REFUSE:
        assert v.reason  # every refusal says why


# (P's queued prefill tokens, pin_wait_ms) -> kind: with the priors (1 ms a prefill token), a prompt
# of 10 tokens behind Q queued ones finishes in 5 + Q + 10 ms; past pin_wait_ms D is not pinned for it
PIN_WAIT = [
    (0, float("inf"), P.PUSH),
    (10_000, float("inf"), P.PUSH),  # no bound given: as before
    (0, 100.0, P.PUSH),
    (84, 100.0, P.PUSH),  # 99 ms: within
    (86, 100.0, P.LATE),  # 101 ms: past
    (10_000, 15_000.0, P.PUSH),
    (20_000, 15_000.0, P.LATE),
]


@pytest.mark.parametrize("queued,pin_wait_ms,want", PIN_WAIT)
def test_place_pins_d_only_for_a_prefill_that_will_finish_soon(queued, pin_wait_ms, want):
    """A push request behind a long P queue would pin D's blocks past the registration deadline
    (and waste a prefill on a 502): it takes late allocation, D's leg once P is done."""
    ask = P.Ask(prompt_tokens=10)
    v = P.place([pf("p0", queued), dc("d0")], 26, mode="push", pin_fraction=0.5, waiting=0, queue_bound=4,
                ask=ask, pin_wait_ms=pin_wait_ms)
    assert (v.kind, v.prefill) == (want, "p0")
    assert v.decode == ("d0" if want == P.PUSH else None)
    if want == P.LATE:
        assert "prefill queue" in v.reason and f"{pin_wait_ms:.0f} ms" in v.reason


def test_refusal_reasons_name_the_cause():
    v = P.place([pf("p0"), dc("d0", committed=95)], 160, mode="push", pin_fraction=1, waiting=3, queue_bound=3)
    assert "queue full" in v.reason
    v = P.place([pf("p0")], 16, mode="push", pin_fraction=1, waiting=0, queue_bound=3)
    assert v.reason == "no live decode instance"
    v = P.place([pf("p0"), dc("d0", num=5)], 160, mode="push", pin_fraction=1, waiting=0, queue_bound=3)
    assert v.reason == "request needs 10 KV blocks; the decode pool has 5"


# ---------------------------------------------------------------------------
# the balancer's accounting, with stand-in runs and links
# ---------------------------------------------------------------------------
class Run:
    # 160 tokens, all of them the prompt's and the first token's slot: D takes every block of it at admission
    def __init__(self, tid, prompt=159, max_tokens=1):
        self.transfer_id = tid
        self.prompt = (1,) * prompt
        self.max_tokens = max_tokens
        self.got: list = []
        self.reuses_prefix = True

    @property
    def decode_tokens(self):
        return len(self.prompt) + self.max_tokens

    def deliver(self, role, msg):
        self.got.append(msg)


def rec(eid, role, num_blocks=100):
    return InstanceRecord(engine_id=eid, role=role, sched_endpoint=f"ipc:///x/{eid}", handshake_endpoints=("hs",),
                          num_blocks=num_blocks, block_size=16)


def balancer(mode="push", pin=1.0, bound=2, d_blocks=(20, 20)):
    b = Balancer(mode, pin, bound)
    for i in range(2):
        b.add(rec(f"p{i}", "prefill"), lambda r: object())
    for i, n in enumerate(d_blocks):
        b.add(rec(f"d{i}", "decode", n), lambda r: object())
    return b


def test_balancer_spreads_and_accounts():
    b = balancer()
    runs = [Run(f"t{i}") for i in range(2)]  # 160 tokens: 10 blocks each
    vs = [b.request(r) for r in runs]
    assert {v.prefill for v in vs} == {"p0", "p1"} and {v.decode for v in vs} == {"d0", "d1"}
    assert b.loads["p0"].queued_tokens == 159 and b.loads["d0"].committed == 10 and b.loads["d0"].pinned == 10
    b.prefill_done(runs[0])
    b.kv_arrived(runs[0])
    assert sum(l.queued_tokens for l in b.loads.values()) == 159
    assert sum(l.pinned for l in b.loads.values()) == 10
    for r in runs:
        b.release(r)
    assert all(l.queued_tokens == l.committed == l.pinned == l.legs == 0 for l in b.loads.values())


def test_ps_leg_ends_when_d_has_the_kv_so_a_request_decoding_on_d_does_not_count_as_ps():
    """P's legs in flight (pushkv status, pushkv_router_instance_legs, the tie-break between P equally loaded) end
    when D has the KV: a P whose requests all decode on D is as free as one that served none."""
    b = balancer()
    first, second = Run("t0"), Run("t1")
    p = b.request(first).prefill
    b.prefill_done(first)
    b.kv_arrived(first)  # first decodes on D: P's part is over
    assert b.loads[p].legs == 0 and b.loads[b.held["t0"].decode].legs == 1
    b.release(first)
    assert all(l.legs == 0 for l in b.loads.values())
    b.request(second)  # a leg whose KV never came (failed, aborted) ends at the release
    b.release(second)
    assert all(l.legs == 0 for l in b.loads.values())


def test_a_d_leg_commits_the_blocks_d_takes_at_admission_and_is_refused_only_past_the_whole_pool():
    """D takes a leg's prompt and the first token's slot at admission and the output's blocks as it decodes
    (preempting when short): a chat without max_tokens (the room left to max_model_len) no longer holds a whole D."""
    b = balancer(d_blocks=(20,))
    chats = [Run(f"c{i}", prompt=40, max_tokens=280) for i in range(6)]  # 320 tokens: 20 blocks each, 3 at admission
    assert all(b.request(r).kind == P.PUSH for r in chats)
    assert b.loads["d0"].committed == b.loads["d0"].pinned == 18 and b.waiting == 0
    with pytest.raises(Refused) as e:
        b.request(Run("huge", prompt=40, max_tokens=281))  # 321 tokens: 21 blocks, more than the whole pool
    assert e.value.status == 413
    for r in chats:
        b.release(r)
    assert b.loads["d0"].committed == 0


def test_balancer_queues_until_room_then_refuses_past_the_bound():
    b = balancer(bound=2)
    big = [Run(f"b{i}", prompt=319, max_tokens=1) for i in range(2)]  # 20 blocks: a whole D each
    assert all(b.request(r).kind == P.PUSH for r in big)
    w1, w2, w3 = Run("w1"), Run("w2"), Run("w3")
    assert b.request(w1) is None and b.request(w2) is None
    with pytest.raises(Refused) as e:
        b.request(w3)
    assert e.value.status == 429 and "queue full" in e.value.reason
    b.release(big[0])  # 20 blocks free on one D: both waiting requests (10 each) go, in order
    assert [type(x) for x in w1.got] == [Placed] and [type(x) for x in w2.got] == [Placed]
    assert w1.got[0].verdict.decode == w2.got[0].verdict.decode == b.held["w1"].decode
    assert b.waiting == 0


def test_balancer_late_allocation_does_not_reserve_d_until_prefill_is_done():
    b = balancer(pin=0.5, d_blocks=(20,))
    first, second = Run("a"), Run("b")
    assert b.request(first).kind == P.PUSH  # 10 of 20 pinned: at the cap
    v = b.request(second)
    assert v.kind == P.LATE and b.loads["d0"].committed == 10  # nothing reserved on D for the late one
    assert b.request_decode(second) == "d0" and b.loads["d0"].committed == 20 and b.loads["d0"].pinned == 10
    third = Run("c")
    assert b.request(third) is None  # D full: waits
    b.release(first)
    assert isinstance(third.got[0], Placed)


def test_balancer_counts_a_request_that_waits_twice_once():
    """pushkv_router_queued counts requests: one queued at arrival (no D could hold it) and placed late (pull) whose
    D leg then waits again is one request that waited, counted once (both waits counted it twice)."""
    from pushkv.router.metrics import RouterMetrics

    b = balancer(mode="pull", d_blocks=(10,))
    b.metrics = RouterMetrics()
    a, c, e = Run("a"), Run("c"), Run("e")
    assert b.request(a).kind == P.LATE and b.request_decode(a) == "d0"  # D full
    assert b.request(c) is None  # waits at arrival
    b.release(a)
    assert isinstance(c.got[0], Placed) and c.got[0].verdict.kind == P.LATE
    assert b.request(e).kind == P.LATE and b.request_decode(e) == "d0"  # e's prefill ends first: D full again
    assert b.request_decode(c) is None and b.waiting == 1  # c waits a second time
    assert b.metrics.queued._value.get() == 1
    b.release(e)
    assert c.got[-1] == DecodePlaced("d0")
    b.release(c)
    assert not b.waited  # nothing kept of a request gone
    f = Run("f")
    assert b.request(f).kind == P.LATE and b.request_decode(f) == "d0"


def test_balancer_late_decode_waits_for_room():
    """A late request's D leg that no D can hold waits at the router, and pushkv_router_queued counts it as it counts
    a queued arrival (a late request's wait went uncounted: the counter said 0 while the queue held six)."""
    from pushkv.router.metrics import RouterMetrics

    b = balancer(mode="pull", d_blocks=(10,))
    b.metrics = RouterMetrics()
    a, c = Run("a"), Run("c")
    assert b.request(a).kind == P.LATE and b.request(c).kind == P.LATE
    assert b.request_decode(a) == "d0"
    assert b.request_decode(c) is None and b.waiting == 1
    assert b.metrics.queued._value.get() == 1
    b.release(a)
    assert c.got == [DecodePlaced("d0")]


def test_balancer_skips_dead_instances_and_takes_them_back():
    b = balancer()
    b.down("p0")
    b.down("d0")
    v = b.request(Run("x"))
    assert (v.prefill, v.decode) == ("p1", "d1")
    b.down("p1")
    with pytest.raises(Refused) as e:
        b.request(Run("y"))
    assert e.value.status == 503 and "prefill" in e.value.reason
    b.add(rec("p0", "prefill"), lambda r: pytest.fail("same endpoint: the link is kept"))
    assert b.request(Run("z")).prefill == "p0"


# ---------------------------------------------------------------------------
# planning several instances, and the local watcher's tracker
# ---------------------------------------------------------------------------
def planned(tmp_path, **kw):
    ports = iter(range(20000, 20100))
    cfg = DeploymentConfig(mode="push", deployment_id="dep", run_dir=str(tmp_path / "r"), **kw)
    return plan_deployment(cfg, pick_port=lambda: next(ports))


def test_plan_several_instances(tmp_path):
    cfg = planned(tmp_path, prefill_instances=2, decode_instances=3)
    assert [i.name for i in cfg.prefills] == ["prefill", "prefill1"]
    assert [i.engine_id for i in cfg.decodes] == ["decode-dep", "decode1-dep", "decode2-dep"]
    assert cfg.prefill == cfg.prefills[0] and cfg.decode == cfg.decodes[0]
    eps = [i.sched_endpoint for i in cfg.instances()] + [e for i in cfg.instances() for e in i.handshake_endpoints]
    assert len(set(eps)) == len(eps) == 10
    names = [s.name for s in process_specs(cfg)]
    assert "prefill-writer-0" in names and "prefill1-scheduler" in names and "decode2-worker-0" in names
    spec = next(s for s in process_specs(cfg) if s.name == "decode2-writer-0")
    assert spec.instance == 2 and spec.argv[-2:] == ("--instance", "2")
    one = planned(tmp_path)  # one instance each: exactly as before
    assert one.prefills == () and one.decodes == () and one.prefill.engine_id == "prefill-dep"
    assert all("--instance" not in s.argv for s in process_specs(one))


def test_plan_gpus_follow_each_other(tmp_path):
    cfg = planned(tmp_path, prefill_instances=2, decode_instances=2,
                  prefill=InstanceConfig(role="prefill", tp=2, device="cuda:0"),
                  decode=InstanceConfig(role="decode", device="cuda:0"))
    assert [i.device for i in cfg.prefills] == ["cuda:0", "cuda:2"]
    assert [i.device for i in cfg.decodes] == ["cuda:4", "cuda:5"]
    cfg = planned(tmp_path, decode_instances=2, prefill=InstanceConfig(role="prefill", device="cuda:0"),
                  decode=InstanceConfig(role="decode", device="cuda:0"))
    assert (cfg.prefill.device, [i.device for i in cfg.decodes]) == ("cuda:0", ["cuda:1", "cuda:2"])
    cfg = planned(tmp_path, decode_instances=2, prefill=InstanceConfig(role="prefill", device="cuda:0"),
                  decode=InstanceConfig(role="decode", device="cuda:3"))  # D named its own GPUs
    assert [i.device for i in cfg.decodes] == ["cuda:3", "cuda:4"]
    one = planned(tmp_path, prefill=InstanceConfig(role="prefill", device="cuda:0"),
                  decode=InstanceConfig(role="decode", device="cuda:0"))
    assert (one.prefill.device, one.decode.device) == ("cuda:0", "cuda:0")  # as before


def ev(name, event, role, instance=0, kind="scheduler"):
    return m.LifecycleEvent(name=name, event=event, role=role, kind=kind, instance=instance, detail="SIGKILL")


def test_tracker_down_once_then_up(tmp_path):
    cfg = planned(tmp_path, prefill_instances=2, decode_instances=2)
    t = InstanceTracker(cfg)
    assert sorted(r.engine_id for r in t.records.values()) == ["decode-dep", "decode1-dep", "prefill-dep",
                                                              "prefill1-dep"]
    down = t.on_event(ev("decode1-worker-0", "exit", "decode", 1, "worker"))
    assert down == InstanceDown("decode1-dep", "decode", "decode1-worker-0 died (SIGKILL)")
    assert t.on_event(ev("decode1-scheduler", "exit", "decode", 1)) is None  # survivors stopped: no news
    assert t.on_event(ev("decode1-worker-0", "ready", "decode", 1, "worker")) is None
    up = t.on_event(ev("decode1.instance", "ready", "decode", 1, "instance"))
    assert isinstance(up, InstanceUp) and up.record.engine_id == "decode1-dep"
    assert t.on_event(ev("prefill-writer-0", "ready", "prefill")) is None  # a live one's ready: nothing
    assert t.on_event(ev("router", "exit", "")) is None
    # a single process restarted (pushkv restart): up again once it is ready
    assert isinstance(t.on_event(ev("prefill-worker-0", "exit", "prefill", 0, "worker")), InstanceDown)
    assert isinstance(t.on_event(ev("prefill-worker-0", "ready", "prefill", 0, "worker")), InstanceUp)


def test_tracker_tells_an_instance_with_a_hung_process_and_its_recovery(tmp_path):
    """A process that stops answering pings makes its instance unhealthy once; healthy again when every such process
    answers, or with a new incarnation."""
    cfg = planned(tmp_path, prefill_instances=2, decode_instances=2)
    t = InstanceTracker(cfg)
    sick = t.on_event(ev("decode1-worker-0", "unhealthy", "decode", 1, "worker"))
    assert isinstance(sick, InstanceHealth) and (sick.engine_id, sick.healthy) == ("decode1-dep", False)
    assert t.on_event(ev("decode1-scheduler", "unhealthy", "decode", 1)) is None  # already told
    assert t.on_event(ev("decode1-worker-0", "healthy", "decode", 1, "worker")) is None  # the scheduler still hangs
    well = t.on_event(ev("decode1-scheduler", "healthy", "decode", 1))
    assert isinstance(well, InstanceHealth) and well.healthy and well.engine_id == "decode1-dep"
    assert t.on_event(ev("decode1-worker-0", "healthy", "decode", 1, "worker")) is None  # nothing to tell
    assert t.on_event(ev("decode-worker-0", "unhealthy", "decode", 0, "worker")).healthy is False
    assert isinstance(t.on_event(ev("decode-worker-0", "exit", "decode", 0, "worker")), InstanceDown)
    assert isinstance(t.on_event(ev("decode.instance", "ready", "decode", 0, "instance")), InstanceUp)
    assert "decode-dep" not in t.sick


def test_a_hung_instance_is_chosen_only_where_no_other_is():
    loads = [dc("d0"), dc("d1", order=1)]
    loads[0].healthy = False
    assert [l.engine_id for l in P.live(loads, "decode")] == ["d1"]
    loads[1].healthy = False
    assert [l.engine_id for l in P.live(loads, "decode")] == ["d0", "d1"]  # better a slow answer than none
    b = balancer()
    assert b.health("d0", False) is not None and b.health("d0", False) is None  # told once
    seen = set()
    for i in range(4):
        r = Run(f"h{i}")
        seen.add(b.request(r).decode)
        b.release(r)
    assert seen == {"d1"}
    b.health("d0", True)
    assert b.loads["d0"].healthy


def test_ties_rotate_over_instances():
    """Idle instances take turns, so sequential requests spread too."""
    b = balancer()
    seen = []
    for i in range(4):
        r = Run(f"s{i}")
        v = b.request(r)
        seen.append((v.prefill, v.decode))
        b.release(r)
    assert seen == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


# ---------------------------------------------------------------------------
# KV-aware placement and conditional disaggregation (the cost model's prior prices)
# ---------------------------------------------------------------------------
def ask(prompt, hits=None, conditional=False, **costs):
    from pushkv.router.cost import Costs
    return P.Ask(prompt, hits or {}, Costs(**costs), conditional)


# (loads, prompt tokens, hits) -> P: what it would finish first (its queue, then what it lacks)
PREFILL_HITS = [
    ([pf("p0"), pf("p1", order=1)], 512, {"p1": 480}, "p1"),  # both idle: the one holding the prompt
    ([pf("p0"), pf("p1", 1000, order=1)], 512, {"p1": 480}, "p0"),  # ... unless its queue costs more
    ([pf("p0", 100), pf("p1", 500, order=1)], 512, {"p1": 480}, "p1"),  # 500 + 32 against 100 + 512
    ([pf("p0"), pf("p1", order=1)], 512, {}, "p0"),  # no hits: as before
]


@pytest.mark.parametrize("loads,prompt,hits,want", PREFILL_HITS)
def test_pick_prefill_by_overlap_and_queue(loads, prompt, hits, want):
    assert P.pick_prefill(loads, ask(prompt, hits)).engine_id == want


# (loads, tokens, hits) -> D: the one that holds the most of the prompt among those that can hold it
DECODE_HITS = [
    ([dc("d0"), dc("d1", committed=50, order=1)], 160, {"d1": 96}, "d1"),
    ([dc("d0"), dc("d1", committed=95, order=1)], 160, {"d1": 96}, "d0"),  # d1 cannot hold it
    ([dc("d0", committed=50), dc("d1", order=1)], 160, {"d0": 16, "d1": 16}, "d1"),  # equal hits: the emptier
]


@pytest.mark.parametrize("loads,tokens,hits,want", DECODE_HITS)
def test_pick_decode_by_overlap(loads, tokens, hits, want):
    assert P.pick_decode(loads, tokens, ask(tokens, hits)).engine_id == want


# (P queue, D legs, D queued prefill tokens, prompt, hits, costs) -> does D prefill it itself?
PATHS = [
    (0, 0, 0, 512, {}, {}, True),  # an idle D: its prefill costs what P's does, and nothing moves
    (0, 3, 0, 512, {}, {}, False),  # D decodes 3: its prefill would stall them 3 x 517 ms
    (0, 3, 0, 512, {"d0": 496}, {}, True),  # ... unless D holds all but 16 tokens (a chat's next turn)
    (0, 3, 0, 512, {"d0": 496, "p0": 496}, {}, False),  # P holds it too: P's 21 ms + handoff is cheaper
    (4000, 3, 0, 512, {}, {}, True),  # P's queue is 4 s long: stalling D's 3 (1.5 s) is cheaper
    (0, 0, 2000, 512, {}, {}, False),  # D already has 2000 tokens of its own prefills queued
    # a machine whose handoff is dear (a slow link): an idle-ish D keeps even a long prompt
    (0, 1, 0, 4096, {}, {"handoff_ms_per_block": 50.0}, True),
    # ... and whose handoff is free: the same request splits
    (0, 1, 0, 4096, {}, {"handoff_ms_per_block": 0.0, "handoff_ms_fixed": 0.0}, False),
]


@pytest.mark.parametrize("p_queue,d_legs,d_queued,prompt,hits,costs,want", PATHS)
def test_choose_path(p_queue, d_legs, d_queued, prompt, hits, costs, want):
    p = pf("p0", p_queue)
    d = P.Load("d0", "decode", num_blocks=1000, legs=d_legs, queued_tokens=d_queued)
    a = ask(prompt, hits, conditional=True, **costs)
    assert P.choose_path(p, d, a) is want, P.path_costs(p, d, a, p.block_size)
    assert P.choose_path(p, d, replace_ask(a, conditional=False)) is False  # off: always split


def replace_ask(a, **kw):
    import dataclasses
    return dataclasses.replace(a, **kw)


def test_place_decode_local_names_d_only_and_says_why():
    v = P.place([pf("p0"), dc("d0")], 160, mode="push", pin_fraction=1, waiting=0, queue_bound=3,
                ask=ask(32, conditional=True))
    assert (v.kind, v.prefill, v.decode) == (P.DECODE_LOCAL, None, "d0") and "D prefills" in v.reason
    v = P.place([pf("p0"), dc("d0", legs=4)], 160, mode="pull", pin_fraction=1, waiting=0, queue_bound=3,
                ask=ask(512, conditional=True))
    assert v.kind == P.LATE  # D busy: split (pull)


class ChatRun(Run):
    def __init__(self, tid, prompt, max_tokens=16):
        super().__init__(tid, 0, max_tokens)
        self.prompt = tuple(prompt)
        self.output_ids, self.done, self.cached, self.timeline, self.hash_cache = [], False, {}, {}, {}
        self.cache_salt = ""
        self.lora = self.lora_root = ""


def test_balancer_indexes_where_it_sent_what_and_places_by_it():
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=False)
    for i in range(2):
        b.add(rec(f"p{i}", "prefill"), lambda r: object())
        b.add(rec(f"d{i}", "decode", 200), lambda r: object())
    turn1 = ChatRun("t1", range(100))
    v = b.request(turn1)
    b.prefill_done(turn1)
    b.kv_arrived(turn1)
    turn1.output_ids, turn1.done = list(range(1000, 1016)), True
    turn1.cached = {"prefill": 0, "decode": 0}
    b.release(turn1)
    # turn 2: the first turn's prompt and answer and a follow-up; P holds 96 of the prompt, D 112 (+ answer)
    turn2 = ChatRun("t2", list(range(100)) + list(range(1000, 1016)) + [7] * 20)
    hits = b.ask(turn2).hits
    assert hits == {v.prefill: 96, v.decode: 112}, hits
    v2 = b.request(turn2)
    assert (v2.prefill, v2.decode) == (v.prefill, v.decode)  # the same pair, though both are as empty as the others
    assert b.held["t2"].predicted == 96 and b.held["t2"].predicted_decode == 112
    b.down(v.decode)
    assert v.decode not in b.ask(turn2).hits  # back, it holds nothing


def test_a_burst_on_a_cached_prefix_stays_on_the_p_that_holds_it():
    """P's queue counts what P will compute: a P holding a long prefix, with requests queued that each compute only
    a short suffix of it, still finishes the next one first. Counting whole prompts sent the second request of a
    burst to the other P, which computed the whole prefix again."""
    b = Balancer("push", 1.0, 16, prefix_cache=True, conditional=False)
    for i in range(2):
        b.add(rec(f"p{i}", "prefill"), lambda r: object())
        b.add(rec(f"d{i}", "decode", 2000), lambda r: object())
    system = list(range(1500))
    first = ChatRun("warm", system + [1, 2, 3], max_tokens=4)
    holder = b.request(first).prefill
    b.prefill_done(first)
    burst = [ChatRun(f"b{i}", system + [3000 + i] * 30, max_tokens=4) for i in range(4)]
    assert [b.request(r).prefill for r in burst] == [holder] * 4
    assert b.loads[holder].queued_tokens == 4 * (1530 - 1488)  # the suffixes (93 whole blocks of 16 are cached)
    for r in burst:
        b.prefill_done(r)
    assert b.loads[holder].queued_tokens == 0


def primed(salt: str = "") -> Balancer:
    """A push balancer with one P and one D whose P has prefilled a 100-token prompt (with ``salt``)."""
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=False)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 200), lambda r: object())
    first = ChatRun("t1", range(100))
    first.cache_salt = salt
    b.request(first)
    b.prefill_done(first)
    return b


@pytest.mark.parametrize("salt, again, found", [("", "", True), ("a", "a", True), ("a", "b", False), ("a", "", False)])
def test_balancer_finds_a_cached_prefix_only_under_the_same_cache_salt(salt, again, found):
    """vLLM's cache_salt: the index names a salted prompt's blocks by the salt's chain, as its schedulers do, so
    placement credits a hit only to a request of the same salt."""
    b = primed(salt)
    second = ChatRun("t2", range(100))
    second.cache_salt = again
    assert (b.ask(second).hits.get("p0", 0) == 96) == found


def test_balancer_decode_local_accounts_on_d_only_and_learns():
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=True)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 200), lambda r: object())
    run = ChatRun("x", range(64))
    v = b.request(run)
    assert v.kind == P.DECODE_LOCAL
    assert b.loads["p0"].legs == 0 and b.loads["d0"].legs == 1 and b.loads["d0"].queued_tokens == 64
    b.kv_arrived(run)  # D's first token
    assert b.loads["d0"].queued_tokens == 0
    t = 100.0
    run.timeline = {"decode.prefill_start": t, "decode.prefill_end": t + 0.064, "decode.first_token": t + 0.064,
                    "decode.finished": t + 0.364}
    run.output_ids, run.done, run.cached = list(range(16)), True, {"decode": 0}
    b.release(run)
    assert all(l.legs == l.committed == l.queued_tokens == 0 for l in b.loads.values())
    c = b.cost.costs
    assert c.prefill_samples == 0 and c.step_samples == 1 and c.handoff_samples == 0  # D's prefill: P's price
    assert b.ask(ChatRun("y", range(64))).hits == {"d0": 48}  # D keeps prompt + answer: 63 of 64 are whole blocks


def test_a_d_that_keeps_no_prefix_is_credited_with_none():
    """A sliding-window model's D neither takes hits nor keeps what arrived (only the window's blocks move), no
    instance of a dynamic-RoPE model caches, and a role may run --no-prefix-cache: the router predicts hits only on
    roles that cache. Crediting such a D with the
    prompt and answer of turn 1 chose it to prefill turn 2 itself (--conditional-disagg) on a hit that never
    happens, and counted a guess error on every request."""
    hybrid = DeploymentConfig(mode="push", model=PRESETS["hybrid"])
    assert prefix_caching(hybrid) == {"prefill": True, "decode": False}
    assert prefix_caching(DeploymentConfig(mode="push")) == {"prefill": True, "decode": True}
    off = DeploymentConfig(mode="push", decode=InstanceConfig(role="decode", prefix_cache=False))
    assert prefix_caching(off) == {"prefill": True, "decode": False}
    ntk = DeploymentConfig(mode="push", model=msgspec.structs.replace(
        PRESETS["small"], rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0, original_max_position=64)))
    assert prefix_caching(ntk) == {"prefill": False, "decode": False}  # its schedulers cache nothing
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=True, decode_cache=False)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 400), lambda r: object())
    b.loads["d0"].legs += 8  # D decodes 8 others: a long prefill there delays each of them
    turn1 = ChatRun("t1", range(1000))
    assert b.request(turn1).kind == P.PUSH
    b.prefill_done(turn1)
    b.kv_arrived(turn1)
    turn1.output_ids, turn1.done, turn1.cached = list(range(5000, 5016)), True, {"prefill": 0, "decode": 0}
    b.release(turn1)
    turn2 = ChatRun("t2", list(range(1000)) + list(range(5000, 5016)) + [7] * 20)
    assert b.ask(turn2).hits == {"p0": 992}  # P's prompt; none on D
    b.down("p0")  # P restarted: its cache is empty, and D's (none) would be the only hit
    b.add(rec("p0", "prefill"), lambda r: object())
    assert b.ask(turn2).hits == {}
    v = b.request(turn2)  # D would compute all 1,036 tokens while its 8 others wait: P computes them
    assert v.kind == P.PUSH and b.held["t2"].predicted_decode == 0


def test_a_request_placed_before_a_prefix_cache_reset_is_not_predicted_after_it():
    """/reset_prefix_cache while a request runs: its instances forgot what it had indexed and index no more of it
    (a chain without its head), so the index, emptied, must not learn its blocks when it ends; one placed after the
    reset is learnt as before."""
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=False)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 200), lambda r: object())
    before = ChatRun("t1", range(100))
    b.request(before)
    b.reset_index()
    b.prefill_done(before)
    b.kv_arrived(before)
    before.output_ids, before.done, before.cached = list(range(1000, 1016)), True, {"prefill": 0, "decode": 0}
    b.release(before)
    assert b.ask(ChatRun("t2", range(100))).hits == {}
    after = ChatRun("t3", range(100))
    b.request(after)
    b.prefill_done(after)
    assert b.ask(ChatRun("t4", range(100))).hits == {"p0": 96}


def test_tracker_of_local_mode_follows_its_one_instance_only_where_asked(tmp_path):
    """Local mode's router tracks its instance only to give it back the LoRA changes after a restart."""
    ports = iter(range(20000, 21000))
    cfg = plan_deployment(DeploymentConfig(mode="local", deployment_id="dep", run_dir=str(tmp_path / "r")),
                          pick_port=lambda: next(ports))
    assert InstanceTracker(cfg).records == {}
    assert InstanceTracker(cfg).on_event(ev("local-worker-0", "exit", "local", 0, "worker")) is None
    t = InstanceTracker(cfg, local=True)
    assert list(t.records) == ["local-dep"]
    assert t.on_event(ev("local-worker-0", "exit", "local", 0, "worker")) == InstanceDown(
        "local-dep", "local", "local-worker-0 died (SIGKILL)")
    assert t.on_event(ev("prefill-worker-0", "exit", "prefill", 0, "worker")) is None  # no such role here
    up = t.on_event(ev("local.instance", "ready", "local", 0, "instance"))
    assert isinstance(up, InstanceUp) and up.record.engine_id == "local-dep"


def test_a_draining_instance_is_chosen_for_nothing_new_but_keeps_its_legs():
    """Its host stops with --shutdown-timeout (its record says draining): no new request and no late D leg goes to
    it, even where it is the only one (refused as where none is up), while what a request holds on it
    stays until that request ends; only leaving the registry is a loss (its reason says the drain ended)."""
    from pushkv.router.balance import drained_reason

    b = balancer(d_blocks=(40, 40))
    held = Run("held")
    v = b.request(held)
    d, p = v.decode, v.prefill
    draining = msgspec.structs.replace(b.records[d], draining=True)
    assert b.draining(draining) is b.loads[d]
    assert b.draining(draining) is None  # said once
    assert (b.loads[d].up, b.loads[d].legs, b.loads[d].committed) == (True, 1, 10)
    assert d in b.live("decode")  # still told of peers lost: its writers may be mid-transfer
    others = [Run(f"n{i}") for i in range(2)]
    assert all(b.request(r).decode != d for r in others)
    b.draining(msgspec.structs.replace(b.records[p], draining=True))
    late = Run("late")
    assert b.request(late).prefill != p
    b.release(held)  # its request ends: its accounting returns, it is still not chosen
    assert b.loads[d].committed == 0 and b.loads[d].draining
    for r in [*others, late]:
        b.release(r)
    b.draining(msgspec.structs.replace(b.records[[e for e in ("d0", "d1") if e != d][0]], draining=True))
    with pytest.raises(Refused) as e:  # every D draining: refused as where none is up
        b.request(Run("refused"))
    assert e.value.status == 503
    assert b.draining(rec("unknown", "decode")) is None  # a router that never chose it: nothing to drain
    b.add(rec(d, "decode", 20), lambda r: object())  # back (a new incarnation at the same place): chosen again
    assert not b.loads[d].draining and P.placeable(b.loads[d])
    assert drained_reason("withdrawn") == "its host stopped at the end of its drain (--shutdown-timeout)"
    assert drained_reason("lease expired") == "lease expired while its host drained"


@pytest.mark.parametrize("up, draining, want", [(True, False, True), (True, True, False), (False, False, False)])
def test_placeable_is_up_and_not_draining(up, draining, want):
    load = P.Load("d", "decode", num_blocks=10, up=up, draining=draining)
    assert P.placeable(load) is want
    assert (P.pick_decode([load], 16) is not None) is want


def test_an_instance_met_already_draining_is_linked_and_never_chosen():
    """A router started while a host drains meets its instances draining: linked (its scheduler hears the router's
    epoch and drops what the router before it left running), chosen for nothing, a request waiting for room
    included; its leaving is then a loss the router knows (so the other role hears of it)."""
    b = Balancer("push", 1.0, 2)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 10), lambda r: object())
    waiting = Run("waiting")
    big = Run("big")
    assert b.request(big).decode == "d0" and b.request(waiting) is None  # d0 full: it waits
    linked = []
    b.add(rec("d1", "decode", 100), lambda r: linked.append(r.engine_id) or object(), fresh=True, draining=True)
    assert linked == ["d1"] and b.loads["d1"].up and not P.placeable(b.loads["d1"])
    assert waiting.got == [] and b.waiting == 1  # room on d1, and still it waits
    assert b.draining(rec("d1", "decode", 100)) is None  # draining already
    b.release(big)
    assert [type(x).__name__ for x in waiting.got] == ["Placed"] and b.holder(waiting).decode == "d0"
    assert b.down("d1") is b.loads["d1"]


def test_the_router_metrics_show_each_instance_draining_and_the_instances_by_state():
    """An operator sees a drain in Prometheus: pushkv_router_instance_draining per instance, and
    pushkv_router_instances{role,state} counting serving, unhealthy, draining and down (each state there, 0 included,
    before the first drain); a draining instance counts as draining whether healthy or not."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pushkv.router.metrics import INSTANCE_STATES, BalanceCollector

    b = balancer()
    collector, registry = BalanceCollector(), CollectorRegistry()
    collector.balancer = b
    registry.register(collector)

    def scrape() -> tuple[dict, dict]:
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        states = {(s.labels["role"], s.labels["state"]): s.value for s in fams["pushkv_router_instances"].samples}
        draining = {s.labels["engine"]: s.value for s in fams["pushkv_router_instance_draining"].samples}
        return states, draining

    states, draining = scrape()
    assert states == {(role, s): 2 if s == "serving" else 0 for role in ("prefill", "decode") for s in INSTANCE_STATES}
    assert draining == {"p0": 0, "p1": 0, "d0": 0, "d1": 0}
    b.draining(msgspec.structs.replace(b.records["d0"], draining=True))
    b.health("d0", False)  # hung as well: still draining, the state an operator acts on
    b.health("p1", False)
    b.down("d1")
    states, draining = scrape()
    assert {k: v for k, v in states.items() if v} == {("prefill", "serving"): 1, ("prefill", "unhealthy"): 1,
                                                      ("decode", "draining"): 1, ("decode", "down"): 1}
    assert draining == {"p0": 0, "p1": 0, "d0": 1, "d1": 0}
