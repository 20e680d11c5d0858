"""What ``pushkv up --role`` plans on one host, what it refuses, and the small pieces of the
several-hosts wiring that are pure (the announcer's lapse, the balancer keeping an instance's
accounting across a fresh link)."""
from __future__ import annotations

import pytest

from processes import cli
from pushkv import messages as m
from pushkv.discovery.etcd import EtcdAnnouncer
from pushkv.discovery.records import InstanceRecord
from pushkv.router.balance import Balancer
from pushkv.supervisor import deployments
from pushkv.supervisor.plan import plan_deployment, process_specs

REG = "etcd://10.0.0.9:2379"


def planned(*flags: str):
    args = cli.build_parser().parse_args(["up", "--model", "tiny", *flags])
    ports = iter(range(20000, 21000))
    return plan_deployment(cli.config_from_args(args), pick_port=lambda: next(ports), run_root="/tmp/x")


@pytest.mark.parametrize("flags, names, processes", [
    (("--role", "prefill", "--advertise", "10.0.0.1"), ["prefill"],
     ["prefill-writer-0", "prefill-worker-0", "prefill-scheduler"]),
    (("--role", "decode", "--advertise", "10.0.0.3", "--decode-instances", "2"), ["decode", "decode1"],
     ["decode-writer-0", "decode-worker-0", "decode-scheduler",
      "decode1-writer-0", "decode1-worker-0", "decode1-scheduler"]),
    (("--role", "router", "--advertise", "10.0.0.9"), [], ["router"]),
    ((), ["prefill", "decode"], ["prefill-writer-0", "prefill-worker-0", "prefill-scheduler",
                                 "decode-writer-0", "decode-worker-0", "decode-scheduler", "router"]),
])
def test_role_plans_only_its_part(flags, names, processes):
    extra = ("--registry", REG) if flags else ()
    cfg = planned(*flags, *extra)
    assert [i.name for i in cfg.instances()] == names
    assert [s.name for s in process_specs(cfg)] == processes


def test_instances_are_reachable_on_the_advertised_address():
    cfg = planned("--role", "decode", "--advertise", "10.0.0.3", "--registry", REG, "--decode-instances", "2")
    for inst in cfg.instances():
        assert inst.sched_endpoint.startswith("tcp://10.0.0.3:")
        assert all(h.startswith("tcp://10.0.0.3:") for h in inst.handshake_endpoints)
        assert all(w.startswith("ipc://") for w in inst.worker_endpoints + inst.writer_endpoints)
        assert inst.engine_id == f"{inst.name}-10.0.0.3-{cfg.deployment_id}"
    assert cfg.host == "10.0.0.3" and cfg.registry_ttl_s == 5
    assert not cfg.prefill.sched_endpoint  # the other role is other hosts'
    router = planned("--role", "router", "--advertise", "10.0.0.9", "--registry", REG, "--host", "0.0.0.0")
    assert router.host == "0.0.0.0"


@pytest.mark.parametrize("flags, fragment", [
    (("--role", "prefill", "--advertise", "10.0.0.1"), "needs --registry"),
    (("--role", "prefill", "--registry", REG), "needs --advertise"),
    (("--role", "decode", "--advertise", "a", "--registry", REG, "--mode", "local"), "needs --registry"),
    (("--role", "decode", "--advertise", "a", "--registry", REG, "--registry-ttl", "0"), "TTL"),
    (("--push-stream", "layer", "--push-stream-groups", "0"), "push stream groups must be >= 1"),
    (("--prefill-chunk", "-1"), "prefill chunk must be >= 0"),
])
def test_role_refusals(flags, fragment):
    with pytest.raises(ValueError, match=fragment):
        planned(*flags)


def test_cli_refuses_before_starting_anything(capsys):
    args = cli.build_parser().parse_args(["up", "--model", "tiny", "--role", "prefill", "--advertise", "a"])
    assert cli.cmd_up(args) == 2
    assert "needs --registry" in capsys.readouterr().err


@pytest.mark.parametrize("lease, last_ok, now, want", [
    (0, 0.0, 100.0, False),  # no lease: nothing to lapse
    (7, 95.0, 99.0, False),  # refreshed 4 s ago, TTL 5
    (7, 95.0, 100.5, True),  # nothing answered for more than a TTL: gone in etcd
])
def test_announcer_lapsed(lease, last_ok, now, want):
    ann = EtcdAnnouncer(REG, ttl_s=5, rejoin=False)
    ann.lease_id, ann.last_ok = lease, last_ok
    assert ann.lapsed(now) is want


@pytest.mark.parametrize("rejoin, kept", [(True, 1), (False, 0)])
def test_announcer_lose(rejoin, kept):
    ann = EtcdAnnouncer(REG, rejoin=rejoin)
    rec = InstanceRecord(engine_id="p", role="prefill", sched_endpoint="tcp://a:1", handshake_endpoints=())
    ann.records[("prefill", "p")] = rec
    ann.lease_id = 7
    ann.lose()
    assert (ann.lease_id, ann.leases_lost, len(ann.records)) == (0, 1, kept)


class FakeLink:
    def __init__(self, rec):
        self.rec, self.retired = rec, False

    def retire(self):
        self.retired = True


def test_fresh_link_keeps_the_instances_accounting():
    b = Balancer("push", 0.5, 4)
    rec = InstanceRecord(engine_id="d", role="decode", sched_endpoint="tcp://a:1", handshake_endpoints=(),
                         num_blocks=64)
    b.add(rec, FakeLink)
    first = b.links["d"]
    b.loads["d"].committed, b.loads["d"].legs = 5, 1  # a run still holds it
    b.down("d")
    b.add(rec, FakeLink, fresh=True)
    assert first.retired and b.links["d"] is not first
    assert (b.loads["d"].up, b.loads["d"].committed, b.loads["d"].legs) == (True, 5, 1)


def test_peer_lost_is_on_both_channels():
    msg = m.PeerLost("p-1", "prefill", "lease expired")
    assert m.DEC_ROUTER_TO_SCHED.decode(m.encode(msg)) == msg
    assert m.DEC_SCHED_TO_WRITER.decode(m.encode(msg)) == msg


def test_status_rows_of_a_router_host_come_from_the_router():
    view = {"p-1": {"engine_id": "p-1", "role": "prefill", "up": True, "legs": 2},
            "d-1": {"engine_id": "d-1", "role": "decode", "up": False, "legs": 0},
            "d-2": {"engine_id": "d-2", "role": "decode", "up": True, "draining": True, "legs": 1}}
    rows = deployments.instance_rows("[]", [], view)
    assert [(r["engine_id"], r["role"], r["state"], r["legs"]) for r in rows] == [
        ("d-1", "decode", "down", 0), ("d-2", "decode", "draining", 1), ("p-1", "prefill", "up", 2)]
