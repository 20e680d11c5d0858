"""Writers under bad input, over real NIXL: a P writer and a D writer as child
processes, this test acting as both schedulers and as a fake third writer
(its own NIXL agent, handshaken like a peer) that sends notifications nobody
expects.

Stale generations are refused and counted, never paired; duplicates and
unknown transfers are counted; a command the protocol refuses is answered
(KVFailed) instead of leaving the scheduler's request hanging.
"""
from __future__ import annotations

import time

import pytest
import zmq

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, Timeouts, model_fingerprint, preset
from pushkv.kv import layout as L
from pushkv.transport.nixl_agent import NixlAgent
from tests.support.procs import children, dealer, leftover_shm, planned

pytestmark = pytest.mark.timeout(120)

REG_WAIT_S = 1.0  # P holds an unmatched half this long


class Inbox:
    """One scheduler-side socket; keeps what arrived until someone asks for it."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.got: list = []

    def _pull(self, timeout_s: float) -> bool:
        if not self.sock.poll(int(timeout_s * 1000)):
            return False
        self.got.append(m.DEC_WRITER_TO_SCHED.decode(self.sock.recv_multipart()[-1]))
        return True

    def take(self, pred, timeout_s: float = 15.0):
        end = time.monotonic() + timeout_s
        while True:
            for i, msg in enumerate(self.got):
                if pred(msg):
                    return self.got.pop(i)
            left = end - time.monotonic()
            if left <= 0 or not self._pull(left):
                raise TimeoutError(f"nothing matched within {timeout_s}s; have {self.got}")

    def answer(self, typ, tid: str, gen: int, timeout_s: float = 15.0):
        """The writer's terminal answer for (tid, gen), of any type; checked by the caller."""
        msg = self.take(lambda x: getattr(x, "transfer_id", None) == tid and x.generation == gen, timeout_s)
        assert isinstance(msg, typ), msg
        return msg

    def quiet(self, tid: str, wait_s: float = 0.3) -> None:
        """Nothing (more) about ``tid`` arrives."""
        end = time.monotonic() + wait_s
        while self._pull(max(0.0, end - time.monotonic())):
            pass
        assert not [x for x in self.got if getattr(x, "transfer_id", None) == tid], self.got

    def counters(self) -> dict[str, int]:
        self.sock.send(m.encode(m.GetStats()))
        return dict(self.take(lambda x: isinstance(x, m.WriterStats)).counters)

    def wait_counter(self, name: str, at_least: int, timeout_s: float = 15.0) -> dict[str, int]:
        end = time.monotonic() + timeout_s
        while True:
            c = self.counters()
            if c.get(name, 0) >= at_least:
                return c
            assert time.monotonic() < end, f"counter {name} never reached {at_least}: {c}"
            time.sleep(0.01)  # polling a remote counter


class FakePeer:
    """A NIXL agent that handshakes with a writer like a peer writer would."""

    def __init__(self, name: str, cfg: DeploymentConfig, role: str):
        inst = cfg.instance(role)
        self.name = name
        self.agent = NixlAgent(name)
        self.layout = L.layout_for(cfg.model, inst.tp, 0, inst.num_blocks, inst.block_size)
        self.model_id = model_fingerprint(cfg.model)
        self.remote = ""

    def handshake(self, endpoint: str) -> m.Hello:
        """Hello on a DEALER kept open afterwards, as a peer writer keeps its link: control
        (Register, CancelTransfer, WriteFailed) travels on it."""
        self.link = s = dealer(endpoint)
        s.send(m.encode(m.Hello(self.name, 0, 1, self.name, self.agent.metadata(), 0, self.layout,
                                wire_version=m.WIRE_VERSION, model_id=self.model_id)))
        assert s.poll(10_000), "no handshake answer"
        reply = m.DEC_HANDSHAKE.decode(s.recv())
        self.remote = self.agent.add_remote(reply.agent_metadata)
        return reply

    def notify(self, payload: bytes) -> None:
        self.agent.send_notif(self.remote, payload)

    def control(self, msg) -> None:
        self.link.send(m.encode(msg))

    def _received(self) -> list:
        out = [m.DEC_PEER.decode(p) for payloads in self.agent.poll_notifs().values() for p in payloads]
        while self.link.poll(0):
            out.append(m.DEC_HANDSHAKE.decode(self.link.recv()))
        return out

    def pump(self, wait_s: float) -> None:
        """Drive this agent's progress (no progress thread) so queued notifications leave."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            assert not self._received(), "unexpected answer"
            time.sleep(0.005)

    def notifs(self, wait_s: float) -> list:
        """What the writer told us, by NIXL notification or on the link."""
        end = time.monotonic() + wait_s
        out: list = []
        while not out and time.monotonic() < end:
            out += self._received()
            time.sleep(0.005)
        return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = DeploymentConfig(
        mode="push", push_stream="off", model=preset("tiny"), timeouts=Timeouts(registration_wait_s=REG_WAIT_S),
        prefill=InstanceConfig(role="prefill", num_blocks=64, block_size=16),
        decode=InstanceConfig(role="decode", num_blocks=64, block_size=16),
    )
    cfg = planned(cfg, tmp_path_factory.mktemp("wbi"))
    with children(cfg, [("writer", "prefill", 0), ("writer", "decode", 0)]):
        p, d = Inbox(dealer(cfg.prefill.writer_endpoints[0])), Inbox(dealer(cfg.decode.writer_endpoints[0]))
        yield cfg, p, d
        p.sock.close(0)
        d.sock.close(0)
    assert leftover_shm(cfg.deployment_id) == []


def src(cfg) -> m.PrefillSource:
    return m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)


def expect(cfg, tid, gen, blocks=(3,), ntok=5, deadline_s=30.0) -> bytes:
    return m.encode(m.ExpectKV(tid, gen, tuple(blocks), ntok, src(cfg), deadline_s))


def send_kv(tid, gen, blocks=(7,), ntok=5) -> bytes:
    return m.encode(m.SendKV(tid, gen, tuple(blocks), ntok, first_token=42))


# ---------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_undecodable_and_unexpected_frames(pair, side):
    cfg, p, d = pair
    box = p if side == "prefill" else d
    before = box.counters()
    frames = [b"\x00garbage", b"", m.encode(m.Generate("t", 0, "prefill", (1,), 1)),  # not this channel
              m.encode(m.KVSent("t", 0)),  # an answer, sent the wrong way
              m.encode(m.ExpectKV("t", 0, (1,), 1, src(cfg), 1.0))[:-2]]  # truncated
    for f in frames:
        box.sock.send(f)
    after = box.wait_counter("bad_frame", before.get("bad_frame", 0) + len(frames))
    assert after.get("handler_error", 0) == before.get("handler_error", 0)


def test_stale_prefill_is_refused_never_paired(pair):
    """P: D registered generation 1; P's generation-0 prefill arrives late."""
    cfg, p, d = pair
    before = p.counters()
    d.sock.send(expect(cfg, "stale-p", 1))
    p.wait_counter("registrations_received", before.get("registrations_received", 0) + 1)
    p.sock.send(send_kv("stale-p", 0))
    failed = p.answer(m.KVFailed, "stale-p", 0)
    assert "stale generation" in failed.reason
    d.quiet("stale-p")  # D's generation 1 is untouched: still waiting
    p.sock.send(send_kv("stale-p", 1))
    assert p.answer(m.KVSent, "stale-p", 1).rendezvous == "registration_first"
    assert d.answer(m.KVReceived, "stale-p", 1).first_token == 42
    assert p.counters().get("stale_prefill", 0) == before.get("stale_prefill", 0) + 1


def test_stale_registration_is_refused_never_paired(pair):
    """P holds generation 2's blocks; D registers generation 1: refused, D told."""
    cfg, p, d = pair
    before = p.counters()
    p.sock.send(send_kv("stale-r", 2))
    p.wait_counter("prefill_done_received", before.get("prefill_done_received", 0) + 1)
    d.sock.send(expect(cfg, "stale-r", 1))
    failed = d.answer(m.KVFailed, "stale-r", 1)
    assert "stale generation" in failed.reason
    p.quiet("stale-r")
    d.sock.send(expect(cfg, "stale-r", 2))
    assert p.answer(m.KVSent, "stale-r", 2).rendezvous == "prefill_first"
    assert d.answer(m.KVReceived, "stale-r", 2).first_token == 42
    assert p.counters().get("stale_registration", 0) == before.get("stale_registration", 0) + 1


def test_reissue_supersedes_on_both_writers(pair):
    """Generation 0 registered at P; D moves to generation 1: 0 is cancelled on
    both writers (D answers once P confirms nothing will be written), 1 pairs."""
    cfg, p, d = pair
    before = p.counters()
    d.sock.send(expect(cfg, "reissue", 0))
    p.wait_counter("registrations_received", before.get("registrations_received", 0) + 1)
    t0 = time.monotonic()
    d.sock.send(expect(cfg, "reissue", 1, blocks=(4,)))
    failed = d.answer(m.KVFailed, "reissue", 0)
    detect_s = time.monotonic() - t0
    assert "superseded by generation 1" in failed.reason or "P rank 0" in failed.reason, failed
    p.sock.send(send_kv("reissue", 1))
    assert p.answer(m.KVSent, "reissue", 1)
    assert d.answer(m.KVReceived, "reissue", 1)
    p.quiet("reissue")
    print(f"reissue at the writers: generation 0 released on D after {detect_s * 1e3:.1f} ms")


def test_command_for_a_finished_transfer_is_answered(pair):
    """A scheduler that forgot a finished (transfer id, generation) and sends it
    again gets KVFailed at once, on both sides, instead of silence."""
    cfg, p, d = pair
    d.sock.send(expect(cfg, "again", 0))
    p.sock.send(send_kv("again", 0))
    assert p.answer(m.KVSent, "again", 0)
    assert d.answer(m.KVReceived, "again", 0)
    before_p, before_d = p.counters(), d.counters()
    p.sock.send(send_kv("again", 0))
    assert "already" in p.answer(m.KVFailed, "again", 0, timeout_s=5).reason
    d.sock.send(expect(cfg, "again", 0))
    assert "already" in d.answer(m.KVFailed, "again", 0, timeout_s=5).reason
    assert p.counters().get("handler_error", 0) == before_p.get("handler_error", 0)
    assert d.counters().get("handler_error", 0) == before_d.get("handler_error", 0)


def test_cancel_for_unknown_transfer(pair):
    cfg, p, d = pair
    d.sock.send(m.encode(m.CancelKV("nobody", 0, "test")))
    assert d.answer(m.KVFailed, "nobody", 0)  # nothing registered: freed at once
    before = p.counters()
    p.sock.send(m.encode(m.CancelKV("nobody", 0, "test")))
    p.wait_counter("cancelled", before.get("cancelled", 0) + 1)
    # answered although no block of P's reached this writer: under layer streaming the scheduler
    # hands the blocks over through the worker's marks, which may trail its cancel
    assert "test" in p.answer(m.KVFailed, "nobody", 0, timeout_s=5).reason
    p.quiet("nobody")
    # a prefill half that arrives after its cancel is released at once, not held
    p.sock.send(send_kv("nobody", 0))
    assert p.answer(m.KVFailed, "nobody", 0, timeout_s=5)


def test_fake_peer_notifications(pair):
    """Notifications nobody expects, from a handshaken peer: counted, never paired."""
    cfg, p, d = pair
    fake = FakePeer("fake-producer", cfg, "prefill")
    fake.handshake(cfg.decode.handshake_endpoints[0])
    before = d.counters()
    d.sock.send(expect(cfg, "fake", 1))  # registers with the real P, which waits for its prefill
    fake.notify(b"\x00not msgpack")
    fake.notify(m.encode(m.Register("fake", 1, "x", 0, 1, (1,), 1)))  # D has no use for a Register
    fake.notify(m.encode(m.WriteDone("nobody", 0, 0, 42)))
    fake.notify(m.encode(m.WriteDone("fake", 0, 0, 42)))  # older generation than D expects
    fake.notify(m.encode(m.WriteDone("fake", 1, 5, 42)))  # a rank that is not a producer
    fake.notify(m.encode(m.WriteDone("fake", 1, 0, 42)))  # impersonates the real producer, rank 0
    fake.pump(0.3)
    c = d.wait_counter("stale_write_done", before.get("stale_write_done", 0) + 1)
    for name in ("bad_notif", "unexpected_notif", "unknown_write_done"):
        assert c.get(name, 0) == before.get(name, 0) + 1, (name, c)
    c = d.wait_counter("completion_from_wrong_peer", before.get("completion_from_wrong_peer", 0) + 2)
    d.quiet("fake")  # generation 1 still waits for its real producer
    p.sock.send(send_kv("fake", 1))
    assert p.answer(m.KVSent, "fake", 1)
    assert d.answer(m.KVReceived, "fake", 1)


def test_registration_for_unknown_transfer_expires_and_is_answered(pair):
    """A Register no prefill ever matches: P holds it until its deadline, then
    tells the registering D rank (WriteFailed); bad and duplicate ones are counted."""
    cfg, p, d = pair
    fake = FakePeer("fake-consumer", cfg, "decode")
    fake.handshake(cfg.prefill.handshake_endpoints[0])
    before = p.counters()
    t0 = time.monotonic()
    reg = m.Register("orphan", 0, "fake-consumer", 0, 1, (1, 2), 20, deadline=0.5)
    fake.control(reg)  # on the handshake link, as D's writer sends it
    fake.notify(m.encode(reg))  # duplicate, as a NIXL notification (still accepted)
    fake.control(m.Register("orphan-tp", 0, "fake-consumer", 0, 3, (1,), 1))  # impossible TP
    got = fake.notifs(wait_s=5)
    detect_s = time.monotonic() - t0
    assert [type(x) for x in got] == [m.WriteFailed] and got[0].transfer_id == "orphan", got
    c = p.counters()
    for name in ("expired_registration", "duplicate_registration", "bad_registration"):
        assert c.get(name, 0) == before.get(name, 0) + 1, (name, c)
    assert 0.4 < detect_s < 0.5 + 2, detect_s
    p.quiet("orphan")  # no P blocks were involved: nothing for P's scheduler
    print(f"orphan registration: WriteFailed to the registering peer after {detect_s * 1e3:.0f} ms")


def test_control_from_a_link_without_a_handshake_is_dropped(pair):
    """A Register on P's handshake ROUTER from a socket that never completed a Hello there: no
    peer stands behind it, so it is counted and dropped, and nothing answers it."""
    cfg, p, d = pair
    before = p.counters()
    s = dealer(cfg.prefill.handshake_endpoints[0])
    try:
        s.send(m.encode(m.Register("stranger", 0, "nobody", 0, 1, (1, 2), 20, deadline=0.5)))
        c = p.wait_counter("control_from_unknown_peer", before.get("control_from_unknown_peer", 0) + 1)
        assert c.get("registrations_received", 0) == before.get("registrations_received", 0), c
        assert not s.poll(300)
    finally:
        s.close(0)


def test_lease_renewal_for_no_lease_is_counted(pair):
    """A RenewLease for a transfer P neither leases nor waits to WRITE: counted, no answer."""
    cfg, p, d = pair
    fake = FakePeer("fake-renewer", cfg, "decode")
    fake.handshake(cfg.prefill.handshake_endpoints[0])
    before = p.counters()
    fake.notify(m.encode(m.RenewLease("no-lease", 0, 0)))
    fake.pump(0.1)
    c = p.wait_counter("renew_ignored", before.get("renew_ignored", 0) + 1)
    assert c.get("lease_renewed", 0) == before.get("lease_renewed", 0), c
    assert c.get("renewed", 0) == before.get("renewed", 0), c
    assert fake.notifs(wait_s=0.3) == []
    p.quiet("no-lease")


@pytest.mark.parametrize("cached, why", [
    (8, "not whole blocks"),  # half a block: the WRITE would start inside one of D's cached blocks
    (-16, "not whole blocks"),
    (32, "leaves nothing"),  # the whole 20-token prompt and more: no WRITE left for the notification
])
def test_register_with_a_bad_cached_offset_is_refused_at_once(pair, cached, why):
    """D's prefix-cache offset must be whole blocks of both sides and leave the last token to
    write: otherwise P answers the registering rank WriteFailed now (not at its deadline)."""
    cfg, p, d = pair
    fake = FakePeer(f"fake-cached{cached}", cfg, "decode")
    fake.handshake(cfg.prefill.handshake_endpoints[0])
    before = p.counters()
    fake.notify(m.encode(m.Register(f"cached{cached}", 0, fake.name, 0, 1, (1, 2), 20, 30.0, cached_tokens=cached)))
    got = fake.notifs(wait_s=5)
    assert [type(x) for x in got] == [m.WriteFailed] and why in got[0].reason, got
    c = p.counters()
    assert c.get("register_bad_cached_tokens", 0) == before.get("register_bad_cached_tokens", 0) + 1, c
    assert c.get("registrations_received", 0) == before.get("registrations_received", 0) + 1, c
    p.quiet(f"cached{cached}")  # nothing was paired: no half of P's waits for it


def test_cached_offset_writes_only_the_tail(pair):
    """D holds the first 32 tokens of a 40-token prompt: P WRITEs one block, not three."""
    cfg, p, d = pair
    sizes = {}
    for tid, cached in (("whole", 0), ("tail", 32)):
        d.sock.send(m.encode(m.ExpectKV(tid, 0, (10, 11, 12), 40, src(cfg), 30.0, cached_tokens=cached)))
        p.sock.send(send_kv(tid, 0, blocks=(20, 21, 22), ntok=40))
        sizes[tid] = p.answer(m.KVSent, tid, 0).nbytes
        assert d.answer(m.KVReceived, tid, 0).nbytes == sizes[tid]
    assert sizes["tail"] * 3 == sizes["whole"], sizes


# --- peers that cannot be displaced, numbers that are bounded ---------------------------------
def push_once(cfg, p, d, tid: str) -> None:
    """One real push P -> D, answered on both sides (D's link to P is up afterwards)."""
    d.sock.send(expect(cfg, tid, 0, blocks=(30,)))
    p.sock.send(send_kv(tid, 0, blocks=(31,)))
    d.answer(m.KVReceived, tid, 0)
    p.answer(m.KVSent, tid, 0)


def hello_as(peer: FakePeer, engine_id: str, sock) -> object:
    sock.send(m.encode(m.Hello(engine_id, 0, 1, peer.name, peer.agent.metadata(), 0, peer.layout,
                               wire_version=m.WIRE_VERSION, model_id=peer.model_id)))
    assert sock.poll(10_000), "no handshake answer"
    return m.DEC_HANDSHAKE.decode(sock.recv())


def test_a_hello_naming_a_live_peer_displaces_nothing(pair):
    """A Hello that names D's engine id (shown on /health) is refused while D's link lives, and
    pushes go on; before, P forgot the real D and every request after failed."""
    cfg, p, d = pair
    push_once(cfg, p, d, "before-forgery")
    forger = FakePeer("forger", cfg, "decode")
    s = dealer(cfg.prefill.handshake_endpoints[0])
    try:
        got = hello_as(forger, cfg.decode.engine_id, s)
    finally:
        s.close(0)
    assert isinstance(got, m.HelloRefused) and "already connected" in got.reason, got
    assert p.counters()["peer_displace_refused"] >= 1
    push_once(cfg, p, d, "after-forgery")


def test_a_restarted_peer_is_taken_once_its_old_link_is_gone(pair):
    """The restart case: the same engine id from a new connection replaces the old peer once the
    old connection is closed (here at once; a real restart also hears of the death first)."""
    cfg, p, d = pair
    first, second = FakePeer("phoenix", cfg, "decode"), FakePeer("phoenix-2", cfg, "decode")
    old = dealer(cfg.prefill.handshake_endpoints[0])
    assert isinstance(hello_as(first, "phoenix", old), m.Hello)
    new = dealer(cfg.prefill.handshake_endpoints[0])
    try:
        assert isinstance(hello_as(second, "phoenix", new), m.HelloRefused)  # the old one lives
    finally:
        new.close(0)
    old.close(0)
    end = time.monotonic() + 10.0
    while True:  # P's ROUTER drops the closed connection on its own I/O thread: retry as D would
        again = dealer(cfg.prefill.handshake_endpoints[0])
        try:
            got = hello_as(second, "phoenix", again)
        finally:
            again.close(0)
        if isinstance(got, m.Hello) or time.monotonic() > end:
            break
    assert isinstance(got, m.Hello) and got.agent_metadata, got


def test_d_handshakes_again_when_p_drops_it(pair):
    """P forgets D (the router lost sight of D: PeerLost) and tells it; D forgets P too, and the
    next push handshakes afresh instead of registering with a P that no longer knows it."""
    cfg, p, d = pair
    push_once(cfg, p, d, "before-drop")
    before = d.counters().get("handshakes_started", 0)
    p.sock.send(m.encode(m.PeerLost(cfg.decode.engine_id, "decode", "lease lapsed (test)")))
    d.wait_counter("peer_dropped_us", 1)
    push_once(cfg, p, d, "after-drop")
    assert d.counters()["handshakes_started"] == before + 1


@pytest.mark.parametrize("who", ["stranger", "peer"])
def test_a_wake_hint_is_bounded_and_only_a_peers(pair, who):
    """TransferStarting with nbytes = 2**62 held P's writer in a spin for good: now a hint counts
    only from a handshaken peer, and only for a size that fits in our memory."""
    cfg, p, d = pair
    sock = dealer(cfg.prefill.handshake_endpoints[0])
    try:
        if who == "peer":
            assert isinstance(hello_as(FakePeer("hinter", cfg, "decode"), "hinter", sock), m.Hello)
        sock.send(m.encode(m.TransferStarting("spin", 0, 0, 2**62)))
        counter = "wake_hint_not_a_peer" if who == "stranger" else "wake_hint_bad_nbytes"
        c = p.wait_counter(counter, 1)
        sock.send(m.encode(m.TransferStarting("fits", 0, 0, 4096)))
        if who == "peer":  # a real hint from the peer still counts
            p.wait_counter("wake_hints", c.get("wake_hints", 0) + 1)
    finally:
        sock.close(0)


@pytest.mark.parametrize("change,says", [
    ({"tp": 2**31}, "tp="), ({"tp": 0}, "tp="), ({"rank": 5}, "rank 5"), ({"rank": -1}, "rank -1"),
    ({"pool_base": 2**64}, "pool_base"), ({"sink_addr": -1}, "sink_addr"), ({"sink_bytes": 2**40}, "sink_bytes"),
    ({"device_id": 2**20}, "device_id"),
])
def test_hello_numbers_are_bounded(change, says):
    from pushkv.writer.peers import hello_problem

    h = m.Hello("x", 0, 1, "x", b"", 0, None, wire_version=m.WIRE_VERSION)
    assert hello_problem(h) == ""
    import msgspec

    assert says in hello_problem(msgspec.structs.replace(h, **change))


@pytest.mark.parametrize("parts,counter", [
    ([b"x" * 1024] * 64, "msg_dropped_frames"),  # 64 frames, each far under the cap
    ([b"x" * (3 << 20)] * 2, "msg_dropped_bytes"),  # 2 frames of 3 MiB: each under the 4 MiB cap, not together
])
def test_a_message_past_its_shape_is_dropped_whole(pair, parts, counter):
    """The size cap bounds a frame; a message is bounded as a whole too (64 x 4 MiB grew P's
    writer by 250 MB): dropped and counted, and the writer goes on serving."""
    cfg, p, d = pair
    before = p.counters().get(counter, 0)
    s = dealer(cfg.prefill.handshake_endpoints[0])
    try:
        s.send_multipart(parts)
        p.wait_counter(counter, before + 1)
    finally:
        s.close(0)
    push_once(cfg, p, d, f"after-{counter}")
