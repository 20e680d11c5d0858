"""A P or D host's drain at stop (--shutdown-timeout, several hosts): when it ends (the pure rule), and the registry
marks it puts (over a stand-in announcer). The drain end to end: tests/hosts/test_hosts.py."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.discovery.records import InstanceRecord
from pushkv.supervisor import host_drain as H
from pushkv.supervisor.host_registry import HostRegistry

pytestmark = pytest.mark.unit

S = {"decode-scheduler", "decode1-scheduler"}


def drain(timeout_s=30.0):
    return H.HostDrain.start(100.0, timeout_s, settle_s=1.0)


def test_the_drain_ends_once_every_scheduler_holds_nothing_after_the_routers_saw_the_mark():
    d = drain()
    d.answer("decode-scheduler", 0, 100.5)  # before the routers had time to see the mark: proves nothing
    d.answer("decode1-scheduler", 0, 100.5)
    assert d.verdict(100.6, S, False) == ""
    d.answer("decode-scheduler", 2, 101.2)
    d.answer("decode1-scheduler", 0, 101.2)
    assert d.verdict(101.3, S, False) == "" and d.held(S) == 2
    d.answer("decode-scheduler", 0, 104.0)
    assert d.verdict(104.0, S, False) == H.DONE
    assert d.verdict(104.0, S | {"decode2-scheduler"}, False) == ""  # one not heard from yet


def test_the_settle_counts_from_when_the_mark_reached_the_registry():
    """etcd out of reach as the host stops: the mark lands late (its put retried), and until then no router has
    seen it, so an idle host does not leave while the routers still choose it (it drains on, at most N s)."""
    d = drain()
    d.seen_from(102.0)  # not landed yet at 102.0
    for s in S:
        d.answer(s, 0, 101.5)
    assert d.verdict(102.5, S, False) == ""
    d.seen_from(101.0)  # an earlier time moves nothing back
    for s in S:
        d.answer(s, 0, 102.9)
    assert d.verdict(102.9, S, False) == ""
    for s in S:
        d.answer(s, 0, 103.0)
    assert d.verdict(103.0, S, False) == H.DONE
    d.seen_from(200.0)  # never landed: the drain still ends at its timeout
    assert d.verdict(130.0, S, False) == H.TIMEOUT


def test_a_process_that_holds_no_request_is_not_waited_for():
    d = drain()
    d.answer("decode-writer-0", -1, 101.5)
    assert "decode-writer-0" not in d.said


@pytest.mark.parametrize("now, again, held, want", [
    (129.9, False, 1, ""),
    (130.0, False, 1, H.TIMEOUT),  # --shutdown-timeout passed with requests still in flight
    (105.0, True, 1, H.SIGNAL),  # a second signal stops now
    (105.0, True, 0, H.SIGNAL),
    (131.0, False, 0, H.DONE),
])
def test_the_drain_ends_at_its_timeout_or_a_second_signal(now, again, held, want):
    d = drain()
    for s in S:
        d.answer(s, held, 102.0)
    assert d.verdict(now, S, again) == want


def test_no_instance_left_whole_leaves_nothing_to_wait_for():
    assert drain().verdict(100.1, set(), False) == H.DONE


def test_the_pong_says_what_a_scheduler_holds_and_an_older_pong_reads_as_none():
    pong = m.Pong(name="decode-scheduler", pid=1, uptime_s=2.0, in_flight=3)
    assert m.DEC_SUPERVISOR_IN.decode(m.encode(pong)).in_flight == 3
    assert m.Pong(name="decode-writer-0", pid=1, uptime_s=2.0).in_flight == -1


class Announcer:
    def __init__(self):
        self.records: dict[tuple[str, str], InstanceRecord] = {}
        self.leases_lost, self.lease_id, self.puts = 0, 7, []
        self.unput: set[tuple[str, str]] = set()  # announced, not in etcd yet
        self.reachable = True

    def announce(self, rec):
        self.records[(rec.role, rec.engine_id)] = rec
        self.puts.append(rec)
        if not self.reachable:
            self.unput.add((rec.role, rec.engine_id))


def rec(eid):
    return InstanceRecord(engine_id=eid, role="decode", sched_endpoint="tcp://h:1", handshake_endpoints=(),
                          num_blocks=64, started_unix=5.0)


def test_mark_draining_puts_each_record_again_marked_and_nothing_else():
    ann = Announcer()
    reg = HostRegistry(cfg=None, announcer=ann)
    for e in ("d-0", "d-1"):
        ann.announce(rec(e))
    ann.puts.clear()
    assert reg.mark_draining() == ["d-0", "d-1"]
    assert [(r.engine_id, r.draining, r.num_blocks, r.started_unix) for r in ann.puts] == [
        ("d-0", True, 64, 5.0), ("d-1", True, 64, 5.0)]
    assert reg.mark_draining() == []  # marked once


def test_the_marks_landed_once_etcd_took_every_put():
    ann = Announcer()
    reg = HostRegistry(cfg=None, announcer=ann)
    ann.announce(rec("d-0"))
    ann.reachable = False
    reg.mark_draining()
    assert not reg.marks_landed  # the supervisor's drain waits for it before an idle host counts
    ann.unput.clear()  # a later contact put it
    assert reg.marks_landed
