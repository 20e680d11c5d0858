"""The scheduler shell over real ZMQ sockets (ipc loopback, in this process): what the core
addresses to a peer leaves on that peer's socket, and what arrives on a socket goes into the
core as that peer. The test turns the shell's loop itself (``poll_once``) and stands in for the
router clients, the worker ranks and the writer ranks with plain sockets."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.scheduler import scheduler_for
from pushkv.scheduler.shell import SchedulerShell

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # for a message that must come


class Rig:
    def __init__(self, tmp_path, compile=None):
        def ep(name: str) -> str:
            return f"ipc://{tmp_path}/{name}"

        inst = InstanceConfig(role="prefill", engine_id="p", tp=2, num_blocks=8, sched_endpoint=ep("sched"),
                              worker_endpoints=(ep("w0"), ep("w1")), writer_endpoints=(ep("x0"), ep("x1")))
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.workers = [self._sock(zmq.DEALER, bind=ep(f"w{r}")) for r in range(2)]
        self.writers = [self._sock(zmq.DEALER, bind=ep(f"x{r}")) for r in range(2)]
        self.shell = SchedulerShell(scheduler_for(DeploymentConfig(mode="push", prefill=inst), inst), compile=compile)
        self.shell.setup()
        self.clients = {who: self._sock(zmq.DEALER, connect=ep("sched"), identity=who) for who in (b"a", b"b")}

    def _sock(self, kind: int, bind: str = "", connect: str = "", identity: bytes = b"") -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if identity:
            s.setsockopt(zmq.IDENTITY, identity)
        s.bind(bind) if bind else s.connect(connect)
        self.socks.append(s)
        return s

    def recv(self, sock: zmq.Socket, dec) -> m.Msg:
        """The next message on ``sock``, the shell's loop turning until it comes."""
        end = time.monotonic() + WAIT_S
        while not sock.poll(0):
            assert time.monotonic() < end, "the message never came"
            self.shell.poll_once(10)
        return dec.decode(sock.recv())

    def quiet(self, *socks: zmq.Socket) -> bool:
        """Nothing waiting on any of ``socks`` (after the shell handled what had arrived)."""
        self.shell.poll_once(0)
        return not any(s.poll(0) for s in socks)

    def close(self) -> None:
        self.shell.compiles.close()
        self.shell.close_sockets()
        for s in self.socks:
            s.close(0)


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def test_refusals_and_replies_reach_the_client_that_sent_them(rig):
    a, b = rig.clients[b"a"], rig.clients[b"b"]
    b.send(m.encode(m.Generate("bad", 0, "prefill", (), 1)))
    failed = rig.recv(b, m.DEC_SCHED_TO_ROUTER)
    assert isinstance(failed, m.RequestFailed) and (failed.transfer_id, failed.status) == ("bad", 400)
    b.send(msgspec.msgpack.encode(["Generate", "junk", 2, "not a prompt"]))  # does not decode
    failed = rig.recv(b, m.DEC_SCHED_TO_ROUTER)
    assert (failed.transfer_id, failed.generation, failed.status) == ("junk", 2, 400)
    assert "undecodable message" in failed.reason
    assert rig.quiet(a, *rig.workers, *rig.writers)


def test_a_request_steps_every_worker_and_its_kv_goes_to_every_writer(rig):
    a, b = rig.clients[b"a"], rig.clients[b"b"]
    a.send(m.encode(m.Generate("t1", 0, "prefill", (1, 2, 3), 1)))
    steps = [rig.recv(w, m.DEC_SCHED_TO_WORKER) for w in rig.workers]
    assert all(isinstance(x, m.ExecuteStep) for x in steps) and steps[0] == steps[1]
    assert rig.quiet(*rig.writers, a, b)
    for w in reversed(rig.workers):  # the ranks answer in any order
        w.send(m.encode(m.StepDone(steps[0].step_id, (42,))))
    sends = [rig.recv(x, m.DEC_SCHED_TO_WRITER) for x in rig.writers]
    assert [type(x) for x in sends] == [m.SendKV, m.SendKV] and sends[0].first_token == 42
    rig.writers[1].send(m.encode(m.KVFailed("t1", 0, "peer died")))
    cancel = rig.recv(rig.writers[0], m.DEC_SCHED_TO_WRITER)  # the other rank, not the one that failed
    assert cancel == m.CancelKV("t1", 0, "peer died") and rig.quiet(rig.writers[1])
    rig.writers[0].send(m.encode(m.KVFailed("t1", 0, "cancelled")))
    failed = rig.recv(a, m.DEC_SCHED_TO_ROUTER)
    assert isinstance(failed, m.RequestFailed) and (failed.transfer_id, failed.status) == ("t1", 502)
    assert rig.quiet(b)
    assert rig.shell.core.alloc.num_free == 8


def test_teardown_refuses_what_is_still_here_to_its_client(rig):
    a = rig.clients[b"a"]
    a.send(m.encode(m.Generate("t1", 0, "prefill", (1, 2, 3), 1)))
    rig.recv(rig.workers[0], m.DEC_SCHED_TO_WORKER)
    rig.shell.stop_reason = "upgrade"
    rig.shell.teardown()
    failed = rig.recv(a, m.DEC_SCHED_TO_ROUTER)
    assert (failed.transfer_id, failed.status, failed.reason) == ("t1", 503, "scheduler shutting down (upgrade)")


def test_the_shells_counters_are_the_cores(rig):
    """A frame only the shell sees (undecodable) is counted where the core's Stats read."""
    rig.clients[b"a"].send(b"\xc1")
    rig.recv(rig.clients[b"a"], m.DEC_SCHED_TO_ROUTER)
    assert rig.shell.core.counters["bad_frame"] == 1
