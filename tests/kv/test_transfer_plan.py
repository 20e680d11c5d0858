"""The transfer plan (stream kind, unit, layer groups, the fallback's why, WRITE or READ) is decided
once, by the planner, and carried in the planned config: the rule as a table, the plan in what the
children read, and every process's part reading that plan rather than deciding again."""
from __future__ import annotations

import msgspec
import pytest

from pushkv import limits
from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, TransferPlan, decode_config, encode_config, preset
from pushkv.kv import layout as L
from pushkv.scheduler import scheduler_for
from pushkv.supervisor.plan import plan_deployment
from pushkv.worker.engine import Worker
from tests.scheduler.test_scheduler_roles import ROUTER, Wire, deliver

WINDOW = "sliding-window layers; one WRITE at prefill end"
UNCHUNKED = "--prefill-chunk is 0 (prompts are not chunked); one WRITE at prefill end"


def deployment(mode="push", push_stream="layer", model="small", p_bs=16, d_bs=16, chunk=32, pull_read="background",
               groups=4) -> DeploymentConfig:
    return DeploymentConfig(mode=mode, pull_read=pull_read, push_stream=push_stream, push_stream_groups=groups,
                            model=preset(model),
                            prefill=InstanceConfig(role="prefill", block_size=p_bs, prefill_chunk=chunk),
                            decode=InstanceConfig(role="decode", block_size=d_bs))


# flags -> (stream, unit, split, groups, fallback, direction)
PLANS = [
    (dict(push_stream="off"), ("off", 0, 0, 1, "", "write")),
    (dict(mode="pull", push_stream="chunk"), ("off", 0, 0, 1, "", "read")),
    (dict(mode="pull", pull_read="inline"), ("off", 0, 0, 1, "", "read")),
    (dict(mode="pull", pull_read="write"), ("off", 0, 0, 1, "", "write")),  # pull's protocol, push's direction
    (dict(mode="local"), ("off", 0, 0, 1, "", "write")),
    (dict(), ("layer", 16, 4, 4, "", "write")),
    (dict(groups=3), ("layer", 16, 3, 3, "", "write")),
    (dict(groups=9), ("layer", 16, 9, 4, "", "write")),  # no more groups than layers
    (dict(groups=1), ("layer", 16, 0, 1, "", "write")),
    (dict(d_bs=32, chunk=0), ("layer", 32, 4, 4, "", "write")),  # needs no chunking: marks come within a step
    (dict(model="hybrid", chunk=0), ("off", 0, 0, 2, WINDOW, "write")),  # full and window groups, no split
    (dict(model="mla", p_bs=32), ("layer", 32, 4, 4, "", "write")),
    (dict(push_stream="chunk", model="hybrid"), ("off", 0, 0, 2, WINDOW, "write")),
    (dict(push_stream="chunk", chunk=0), ("off", 0, 0, 1, UNCHUNKED, "write")),
    (dict(push_stream="chunk"), ("chunk", 16, 0, 1, "", "write")),
    (dict(push_stream="chunk", d_bs=32), ("chunk", 32, 0, 1, "", "write")),  # whole blocks on both sides: lcm
    (dict(push_stream="chunk", p_bs=32), ("chunk", 32, 0, 1, "", "write")),
    (dict(push_stream="chunk", p_bs=32, d_bs=48), ("chunk", 96, 0, 1, "", "write")),
    (dict(push_stream="chunk", model="mla", d_bs=32), ("chunk", 32, 0, 1, "", "write")),
]


@pytest.mark.parametrize("flags, want", PLANS, ids=[str(f) for f, _ in PLANS])
def test_the_plan_follows_from_the_flags(flags, want):
    cfg = deployment(**flags)
    plan = L.plan_transfer(cfg)
    assert (plan.stream, plan.unit, plan.split, plan.groups, plan.fallback, plan.direction) == want
    # the groups it counts are the ones both sides' pools are cut into
    for inst in (cfg.prefill, cfg.decode):
        assert len(L.layer_groups(L.instance_layout(cfg, inst, 0))) == plan.groups
    assert plan.sent == ("fallback" if plan.fallback else "" if plan.stream == "off" else plan.stream)
    assert plan.describe(plan.sent) == (f"fallback: {plan.fallback}" if plan.fallback else plan.sent)


def test_planning_puts_the_plan_in_what_the_children_read(tmp_path):
    user = deployment(model="hybrid")
    assert user.transfer is None
    planned = plan_deployment(user, run_root=str(tmp_path))
    assert planned.transfer == L.plan_transfer(user) and planned.transfer.fallback == WINDOW
    assert decode_config(encode_config(planned)).transfer == planned.transfer  # config.json, as a child reads it
    # a plan a config file carried from other flags is decided again, never kept
    stale = msgspec.structs.replace(user, transfer=TransferPlan(stream="chunk", unit=16, direction="read"))
    assert plan_deployment(stale, run_root=str(tmp_path)).transfer == planned.transfer


def test_a_bad_direction_is_refused():
    with pytest.raises(ValueError, match="TransferPlan.direction"):
        TransferPlan(direction="pull")  # type: ignore[arg-type]


def parts(cfg: DeploymentConfig) -> dict:
    """What each process's part makes of ``cfg``'s transfers (objects only: no socket, no pool, no model)."""
    from pushkv.writer.prefill import PrefillWriter

    p_sched, d_sched = scheduler_for(cfg, cfg.prefill), scheduler_for(cfg, cfg.decode)
    writer = PrefillWriter(cfg, cfg.prefill, 0)
    return {
        "P scheduler streams": p_sched.transfer.stream,
        "P writer says": writer.stream,
        "P writer's unit": writer.side.rdv.stream_unit,
        "P writer's groups": writer.side.rdv.stream_groups,
        "P writer takes marks": writer.takes_marks(),
        "P worker marks": Worker(cfg, cfg.prefill, 0).takes_marks(),
        "pools' groups": {len(L.layer_groups(L.instance_layout(cfg, i, 0))) for i in (cfg.prefill, cfg.decode)},
        "D checksum rows": d_sched.kv_groups,
        "D reads (and renews P's lease)": d_sched.reads,
        "message cap's groups": limits._checksum_groups(cfg),
    }


def test_every_process_reads_the_hybrid_fallback(tmp_path):
    """A hybrid model asked to stream layers: every part falls back to one WRITE at the end."""
    cfg = plan_deployment(deployment(model="hybrid"), run_root=str(tmp_path))
    assert parts(cfg) == {
        "P scheduler streams": "off", "P writer says": "fallback", "P writer's unit": 0, "P writer's groups": 2,
        "P writer takes marks": False, "P worker marks": False, "pools' groups": {2}, "D checksum rows": 2,
        "D reads (and renews P's lease)": False, "message cap's groups": 2,
    }


def test_every_process_reads_the_plan_not_the_flags(tmp_path):
    """A planned config whose plan says other than its flags would: each part follows the plan, so
    none decides again from the flags."""
    planned = plan_deployment(deployment(push_stream="off"), run_root=str(tmp_path))
    assert planned.transfer.stream == "off"
    cfg = msgspec.structs.replace(planned, transfer=TransferPlan(stream="layer", unit=32, split=2, groups=2,
                                                                  direction="read"))
    assert parts(cfg) == {
        "P scheduler streams": "layer", "P writer says": "layer", "P writer's unit": 32, "P writer's groups": 2,
        "P writer takes marks": True, "P worker marks": True, "pools' groups": {2}, "D checksum rows": 2,
        "D reads (and renews P's lease)": True, "message cap's groups": 2,
    }


@pytest.mark.parametrize("mode, pull_read, write", [("pull", "background", False), ("pull", "write", True),
                                                    ("push", "background", True)])
def test_write_or_read_travels_in_the_messages(mode, pull_read, write):
    """P's HoldKV and D's ReadKV say WRITE or READ (the writers read only that), as the plan decided."""
    cfg = deployment(mode=mode, pull_read=pull_read, push_stream="off", chunk=0)
    p_inst = msgspec.structs.replace(cfg.prefill, engine_id="p", tp=1, worker_endpoints=("w0",),
                                     writer_endpoints=("x0",), handshake_endpoints=("ipc://p0",))
    d_inst = msgspec.structs.replace(cfg.decode, engine_id="d", tp=1, worker_endpoints=("w0",),
                                     writer_endpoints=("x0",))
    cfg = msgspec.structs.replace(cfg, prefill=p_inst, decode=d_inst)
    p = scheduler_for(cfg, p_inst)
    p_wire = Wire(p)
    deliver(p, ROUTER, m.Generate("t1", 0, "prefill", (1, 2, 3), 1, late=mode == "push"), 1.0)
    (step,) = p_wire.take("worker")
    deliver(p, p.workers[0], m.StepDone(step.step_id, (7,)), 1.0)
    (hold,) = p_wire.take("writer")
    assert isinstance(hold, m.HoldKV) and hold.write == write
    d = scheduler_for(cfg, d_inst)
    d_wire = Wire(d)
    pull = m.PullParams(p_inst.source(), (0,), 3, 7, 0.0)
    deliver(d, ROUTER, m.Generate("t1", 0, "decode", (1, 2, 3), 2, source=None, pull=pull), 1.0)
    (read,) = d_wire.take("writer")
    assert isinstance(read, m.ReadKV) and read.write == write
