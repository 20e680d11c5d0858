"""A P or D host's drain at stop (--shutdown-timeout, several hosts): when it ends (the pure rule), and the registry
marks it puts (over a stand-in announcer). The drain end to end: tests/hosts/test_hosts.py."""
from __future__ import annotations

import msgspec
import pytest

from pushkv import messages as m
from pushkv.discovery.records import InstanceRecord
from pushkv.supervisor import host_drain as H
from pushkv.supervisor.host_registry import HostRegistry

pytestmark = pytest.mark.unit

S = {"decode-scheduler", "decode1-scheduler"}


def drain(timeout_s=30.0):
    return H.HostDrain.start(100.0, timeout_s, settle_s=1.0)


def answered(d, at, said, schedulers=S):
    """Each scheduler answers, saying ``said``, a ping the supervisor sent at ``at`` (when its answer arrives does
    not matter)."""
    seq = len(d.sent) + 1
    d.pinged(seq, at)
    for s in schedulers:
        d.answer(s, said, seq)
    return seq


def test_the_drain_ends_once_every_scheduler_holds_nothing_after_the_routers_saw_the_mark():
    d = drain()
    answered(d, 100.5, 0)  # asked before the routers had time to see the mark: proves nothing
    assert d.verdict(100.6, S, False) == ""
    seq = answered(d, 101.2, 0, {"decode1-scheduler"})
    d.answer("decode-scheduler", 2, seq)
    assert d.verdict(101.3, S, False) == "" and d.held(S) == 2
    answered(d, 104.0, 0, {"decode-scheduler"})
    assert d.verdict(104.0, S, False) == H.DONE
    assert d.verdict(104.0, S | {"decode2-scheduler"}, False) == ""  # one not heard from yet


def test_an_idle_answer_to_a_ping_sent_before_the_settle_counts_for_nothing_whenever_it_arrives():
    """A scheduler counts what it holds as the ping reaches it: an idle answer to a ping sent before the settle
    point, received after it (a slow scheduler, a busy supervisor), says nothing of what the routers placed
    meanwhile. Answers are dated by their ping (Pong.ping_seq), never by their arrival; one to no ping of the drain
    (0: unnumbered, or a ping sent before the drain) never counts, and an older answer arriving late changes
    nothing."""
    d = drain()
    early = len(d.sent) + 1
    d.pinged(early, 100.9)  # before the settle point (101.0)
    late = answered(d, 101.0, 3)  # asked at the settle point: 3 held
    for s in S:  # the early ping's idle answers arrive only now, after the late ping's
        d.answer(s, 0, early)
    assert d.verdict(101.5, S, False) == "" and d.held(S) == 6
    for s in S:
        d.answer(s, 0, 0)  # an answer that names no ping
        d.answer(s, 0, 999)  # nor one this drain sent
    assert d.verdict(101.5, S, False) == ""
    for s in S:
        d.answer(s, 0, late)  # the settle-point ping, answered idle now (the requests ended): counts
    assert d.verdict(101.5, S, False) == H.DONE


def test_the_settle_counts_from_when_the_mark_reached_the_registry():
    """etcd out of reach as the host stops: the mark lands late (its put retried), and until then no router has
    seen it, so an idle host does not leave while the routers still choose it (it drains on, at most N s)."""
    d = drain()
    d.seen_from(102.0)  # not landed yet at 102.0
    answered(d, 101.5, 0)
    assert d.verdict(102.5, S, False) == ""
    d.seen_from(101.0)  # an earlier time moves nothing back
    answered(d, 102.9, 0)
    assert d.verdict(102.9, S, False) == ""
    answered(d, 103.0, 0)
    assert d.verdict(103.0, S, False) == H.DONE
    d.seen_from(200.0)  # never landed: the drain still ends at its timeout
    assert d.verdict(130.0, S, False) == H.TIMEOUT


def test_a_process_that_holds_no_request_is_not_waited_for():
    d = drain()
    answered(d, 101.5, -1, {"decode-writer-0"})
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
    answered(d, 102.0, held)
    assert d.verdict(now, S, again) == want


def test_no_instance_left_whole_leaves_nothing_to_wait_for():
    assert drain().verdict(100.1, set(), False) == H.DONE


def test_the_pong_says_what_a_scheduler_holds_and_which_ping_it_answers_and_older_ones_read_as_none():
    pong = m.Pong(name="decode-scheduler", pid=1, uptime_s=2.0, in_flight=3, ping_seq=7)
    got = m.DEC_SUPERVISOR_IN.decode(m.encode(pong))
    assert (got.in_flight, got.ping_seq) == (3, 7)
    older = m.Pong(name="decode-writer-0", pid=1, uptime_s=2.0)
    assert (older.in_flight, older.ping_seq) == (-1, 0)
    # the fields are appended: an older process's Ping (no seq) still decodes, as seq 0 (unnumbered), and what an
    # older decoder knows of the new messages stays where it was
    assert m.DEC_CONTROL.decode(msgspec.msgpack.encode(("Ping",))).seq == 0
    assert msgspec.msgpack.decode(m.encode(m.Ping(seq=5))) == ["Ping", 5]
    assert msgspec.msgpack.decode(m.encode(pong))[:-1] == ["Pong", "decode-scheduler", 1, 2.0, 0, 3]


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
