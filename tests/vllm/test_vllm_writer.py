"""The vLLM connector's writer processes over real NIXL (UCX between processes), with this
test as vLLM's scheduler and worker halves: a P instance of one TP size pushes into a D
instance of another (each P rank WRITEs the heads it shares with each D rank, checked byte
for byte), and D's handshakes run on its loop (a P writer that never answers delays no
other request)."""
import mmap
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import msgspec
import numpy as np
import pytest
import zmq

from pushkv import messages as m
from pushkv.vllm import wire as w
from pushkv.vllm.regions import KVMemory, LayerRegion
from pushkv.writer.peers import HANDSHAKE_TIMEOUT_S
from tests.support.other_uid import knock, nobody_runs_python, probe

pytestmark = pytest.mark.timeout(180)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE, TOTAL_HEADS = 2, 8, 4, 8, 2
HEAD_BYTES = BLOCK_SIZE * 2 * HEAD_SIZE * 4  # one head of a CPU page [heads, block_size, 2 * head_size], fp32
READY_S = 60.0


def kv_memory(tp: int) -> KVMemory:
    """A rank's KV cache as vLLM's CPU backend lays it out: layer-major, a page per block."""
    page = TOTAL_HEADS // tp * HEAD_BYTES
    layers = tuple(LayerRegion(l * BLOCKS * page, page, page, HEAD_BYTES) for l in range(LAYERS))
    return KVMemory(LAYERS * BLOCKS * page, BLOCKS, layers, TOTAL_HEADS, BLOCK_SIZE)


class Writers:
    """Writer processes of one test, each with its KV cache in a memfd this test maps too."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="pkvw-")
        self.ctx = zmq.Context.instance()
        self.procs, self.socks, self.maps, self.fds = [], [], [], []
        self.bound: list[str] = []  # the socket files the writers bind (each removes its own at its end)

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.dir}/{name}"

    def start(self, role: str, engine: str, rank: int, tp: int, handshake: str = "", secret_file: str = "",
              extra: tuple = (), stamps: "Optional[queue.Queue]" = None):
        """(command socket, event socket, this rank's KV bytes) of a started, ready writer, its
        handshake on ``handshake`` (default: an ipc file in this test's directory); ``extra``: more
        arguments; ``stamps``: a queue that gets its pushkv-timing stamps, (event, transfer id)."""
        kv = kv_memory(tp)
        fd = os.memfd_create(f"{engine}-{rank}")
        os.ftruncate(fd, kv.nbytes)
        self.fds.append(fd)
        mm = mmap.mmap(fd, kv.nbytes)
        self.maps.append(mm)
        events = self._sock(zmq.PULL)
        ev = self.endpoint(f"{engine}-{rank}-ev")
        hs = handshake or self.handshake(engine, rank)
        events.bind(ev)
        cmd = [sys.executable, "-m", "pushkv.vllm.writer", "--role", role, "--engine-id", engine,
               "--rank", str(rank), "--tp", str(tp), "--fd", str(fd),
               "--memory", msgspec.msgpack.encode(kv).hex(), "--model-id", "tiny",
               "--cmd-endpoint", self.endpoint(f"{engine}-{rank}-cmd"), "--event-endpoint", ev,
               "--handshake-endpoint", hs, "--parent-pid", str(os.getpid()),
               "--registration-wait-s", "20", "--transfer-s", "20", "--secret-file", secret_file, *extra]
        self.bound += [e[len("ipc://"):] for e in (self.endpoint(f"{engine}-{rank}-cmd"), hs) if e.startswith("ipc://")]
        env = dict(os.environ, PUSHKV_VLLM_TIMING="1") if stamps is not None else None
        proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env,
                                stderr=subprocess.PIPE if stamps is not None else None, text=True)
        self.procs.append(proc)
        if stamps is not None:  # read on a thread (the pipe never fills), echoed for the test's log
            threading.Thread(target=_read_stamps, args=(proc.stderr, stamps), daemon=True).start()
        assert events.poll(READY_S * 1000), f"{engine} rank {rank}: no WriterReady"
        assert isinstance(w.DEC_TO_CONNECTOR.decode(events.recv()), w.WriterReady)
        push = self._sock(zmq.PUSH)
        push.connect(self.endpoint(f"{engine}-{rank}-cmd"))
        return push, events, np.frombuffer(mm, dtype=np.uint8)

    def handshake(self, engine: str, rank: int) -> str:
        return self.endpoint(f"{engine}-{rank}-hs")

    def _sock(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        self.socks.append(s)
        return s

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in self.socks:
            s.close(0)
        for mm in self.maps:
            mm.close()
        for fd in self.fds:
            os.close(fd)
        left = [b for b in self.bound if os.path.exists(b)]
        shutil.rmtree(self.dir, ignore_errors=True)  # (zmq may be removing those meanwhile)
        assert not left, f"the writers left socket files behind: {left}"


@pytest.fixture
def writers():
    ws = Writers()
    yield ws
    ws.close()


def _read_stamps(pipe, out: "queue.Queue") -> None:
    for ln in pipe:
        sys.stderr.write(ln)
        if ln.startswith("pushkv-timing "):
            _, ev, tid, _ = ln.split()
            out.put((ev, tid))


def wait_stamp(stamps: "queue.Queue", want: tuple[str, str], seen: list, timeout_s: float = 30.0) -> None:
    """Wait for the writer's stamp ``want`` (event, transfer id); every stamp read goes to ``seen``."""
    end = time.monotonic() + timeout_s
    while want not in seen:
        seen.append(stamps.get(timeout=max(0.01, end - time.monotonic())))


def event(sock: zmq.Socket, timeout_s: float = 30.0):
    assert sock.poll(timeout_s * 1000), "no event from the writer"
    return w.DEC_TO_CONNECTOR.decode(sock.recv())


def head_page(kv: np.ndarray, tp: int, layer: int, block: int, head: int) -> np.ndarray:
    """The bytes of one of this rank's heads (its own head index) in a block's page."""
    page = TOTAL_HEADS // tp * HEAD_BYTES
    start = layer * BLOCKS * page + block * page + head * HEAD_BYTES
    return kv[start:start + HEAD_BYTES]


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_prefill_ranks_write_their_heads_into_decode_ranks_of_another_tp(writers, p_tp, d_tp):
    ps = [writers.start("prefill", "P", r, p_tp) for r in range(p_tp)]
    ds = [writers.start("decode", "D", r, d_tp) for r in range(d_tp)]
    rng = np.random.default_rng(7)
    for _, _, kv in ps:
        kv[:] = rng.integers(0, 256, kv.size, dtype=np.uint8)
    src = m.PrefillSource("P", p_tp, tuple(writers.handshake("P", r) for r in range(p_tp)))
    p_blocks, d_blocks, tokens = (1, 2, 3), (7, 5, 6), 3 * BLOCK_SIZE
    for cmd, _, _ in ds:
        cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", d_blocks, tokens, src, 20.0)))
    for cmd, _, _ in ps:
        cmd.send(m.encode(w.SendBlocks("p-1", "T1", p_blocks, tokens)))
    for _, ev, _ in ds:
        got = event(ev)
        assert isinstance(got, w.BlocksReceived) and got.transfer_id == "T1", got
        assert got.nbytes == LAYERS * len(d_blocks) * (TOTAL_HEADS // d_tp) * HEAD_BYTES, got
    for _, ev, _ in ps:
        got = event(ev)
        assert isinstance(got, w.BlocksSent) and got.ok, got
    for head in range(TOTAL_HEADS):  # every global head landed where D keeps it, from the P rank holding it
        p_rank, p_head = divmod(head, TOTAL_HEADS // p_tp)
        d_rank, d_head = divmod(head, TOTAL_HEADS // d_tp)
        for layer in range(LAYERS):
            for pb, db in zip(p_blocks, d_blocks):
                want = head_page(ps[p_rank][2], p_tp, layer, pb, p_head)
                assert np.array_equal(head_page(ds[d_rank][2], d_tp, layer, db, d_head), want), (head, layer, db)
    untouched = set(range(BLOCKS)) - set(d_blocks)
    for _, _, kv in ds:
        for layer in range(LAYERS):
            for b in untouched:
                assert not head_page(kv, d_tp, layer, b, 0).any()


def test_two_streamed_parts_in_flight_then_the_last_write(writers):
    """Layer streaming (two groups, one layer each): D registered, P's worker marks both groups
    stored back to back, so the rendezvous asks both parts at once (PARTS_AHEAD) and they fly
    together; the last WRITE follows once both ended, and every byte lands where D keeps it. (Two
    parts booked under one key lost the first: its end never reached the rendezvous, whose last
    WRITE then waited for it until D failed the transfer.)"""
    stamps: queue.Queue = queue.Queue()
    p_cmd, p_ev, p_kv = writers.start("prefill", "P", 0, 1, extra=("--stream-groups", "2"), stamps=stamps)
    d_cmd, d_ev, d_kv = writers.start("decode", "D", 0, 1)
    p_kv[:] = np.random.default_rng(3).integers(0, 256, p_kv.size, dtype=np.uint8)
    src = m.PrefillSource("P", 1, (writers.handshake("P", 0),))
    p_blocks, d_blocks, tokens = (1, 2, 3), (6, 4, 5), 3 * BLOCK_SIZE
    d_cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", d_blocks, tokens, src, 20.0)))
    seen: list = []
    wait_stamp(stamps, ("p_registration_recvd", "T1"), seen)  # parts go only once D registered
    for group in (0, 1):
        p_cmd.send(m.encode(w.LayersStored("p-1", "T1", group, p_blocks, tokens)))
    while seen.count(("p_part_posted", "T1")) < 2:  # (the prefill half travels apart from the marks:
        seen.append(stamps.get(timeout=30.0))  # one that overtook them would leave nothing to stream)
    p_cmd.send(m.encode(w.SendBlocks("p-1", "T1", p_blocks, tokens)))
    got = event(d_ev)
    assert isinstance(got, w.BlocksReceived) and got.transfer_id == "T1", got
    sent = event(p_ev)
    assert isinstance(sent, w.BlocksSent) and sent.ok, sent
    assert sent.nbytes == LAYERS * len(p_blocks) * TOTAL_HEADS * HEAD_BYTES, sent  # each byte once
    wait_stamp(stamps, ("p_write_posted", "T1"), seen)
    posts = [ev for ev, tid in seen if tid == "T1" and ev in ("p_part_posted", "p_write_posted")]
    assert posts == ["p_part_posted", "p_part_posted", "p_write_posted"], seen
    for head in range(TOTAL_HEADS):
        for layer in range(LAYERS):
            for pb, db in zip(p_blocks, d_blocks):
                want = head_page(p_kv, 1, layer, pb, head)
                assert np.array_equal(head_page(d_kv, 1, layer, db, head), want), (head, layer, db)


def test_a_silent_prefill_writer_delays_no_other_request(writers):
    """D's handshake with a P writer that never answers is pending on D's loop while a second
    request, from another P, registers and receives its KV; the first fails at its deadline."""
    silent = writers._sock(zmq.ROUTER)
    silent.bind(writers.handshake("S", 0))  # takes the Hello, answers nothing
    p_cmd, p_ev, p_kv = writers.start("prefill", "P", 0, 1)
    d_cmd, d_ev, d_kv = writers.start("decode", "D", 0, 1)
    p_kv[:] = 7
    t0 = time.monotonic()
    silent_src = m.PrefillSource("S", 1, (writers.handshake("S", 0),))
    d_cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", (1,), BLOCK_SIZE, silent_src, 20.0)))
    assert silent.poll(10_000), "D never sent the silent P its Hello"
    ident, hello = silent.recv_multipart()
    assert isinstance(w.DEC_VHANDSHAKE.decode(hello), w.VllmHello)
    d_cmd.send(m.encode(w.ExpectBlocks("d-2", "T2", (2,), BLOCK_SIZE,
                                       m.PrefillSource("P", 1, (writers.handshake("P", 0),)), 20.0)))
    p_cmd.send(m.encode(w.SendBlocks("p-2", "T2", (3,), BLOCK_SIZE)))
    got = event(d_ev)
    took = time.monotonic() - t0
    assert isinstance(got, w.BlocksReceived) and got.transfer_id == "T2", got  # before T1's handshake ended
    assert took < HANDSHAKE_TIMEOUT_S, f"T2 waited {took:.1f}s behind T1's handshake"
    assert isinstance(event(p_ev), w.BlocksSent)
    page = TOTAL_HEADS * HEAD_BYTES
    assert (d_kv[2 * page:3 * page] == 7).all()
    got = event(d_ev, HANDSHAKE_TIMEOUT_S + 10)
    assert isinstance(got, w.BlocksFailed) and got.transfer_id == "T1" and "timed out" in got.reason, got
    assert time.monotonic() - t0 >= HANDSHAKE_TIMEOUT_S * 0.9


@pytest.mark.parametrize("d_role", ["decode", "prefill"])  # prefill: a kv_both instance's writer
def test_a_cancelled_receive_is_held_until_its_prefill_writer_answers(writers, d_role):
    """D cancels a registered transfer: it tells P to stop and holds the blocks (quarantine) until
    P's answer says no WRITE can land, then fails them, well before the transfer deadline (20 s).
    A kv_both instance's writer (role prefill) does so too (it took D's cancel for a P transfer,
    and D's blocks stayed held until P's registration deadline)."""
    p_cmd, p_ev, _ = writers.start("prefill", "P", 0, 1)
    d_cmd, d_ev, _ = writers.start(d_role, "D", 0, 1)
    src = m.PrefillSource("P", 1, (writers.handshake("P", 0),))
    d_cmd.send(m.encode(w.ExpectBlocks("d-0", "T0", (1,), BLOCK_SIZE, src, 20.0)))  # the handshake, done once
    p_cmd.send(m.encode(w.SendBlocks("p-0", "T0", (2,), BLOCK_SIZE)))
    assert isinstance(event(d_ev), w.BlocksReceived) and isinstance(event(p_ev), w.BlocksSent)
    t0 = time.monotonic()
    d_cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", (3,), BLOCK_SIZE, src, 20.0)))  # registers at once
    d_cmd.send(m.encode(w.CancelBlocks("d-1", "T1", "client went away", "decode")))
    got = event(d_ev, 15.0)
    assert got == w.BlocksFailed("d-1", "T1", "client went away"), got
    assert time.monotonic() - t0 < 10.0, "released at the deadline, not by P's answer"
    assert not d_ev.poll(500) and not p_ev.poll(0)  # one answer; P never had the blocks


def test_a_second_request_with_a_transfer_id_in_flight_is_refused_alone(writers):
    """D is told to expect a transfer id it already expects for another request: that second
    request fails at once, and the first keeps its transfer, its answer under its own request id
    (before, the second took the id's request over: the first's answer came with no request id,
    so vLLM never freed its blocks)."""
    p_cmd, p_ev, p_kv = writers.start("prefill", "P", 0, 1)
    d_cmd, d_ev, d_kv = writers.start("decode", "D", 0, 1)
    src = m.PrefillSource("P", 1, (writers.handshake("P", 0),))
    d_cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", (1,), BLOCK_SIZE, src, 20.0)))
    d_cmd.send(m.encode(w.ExpectBlocks("d-2", "T1", (2,), BLOCK_SIZE, src, 20.0)))
    got = event(d_ev)
    assert isinstance(got, w.BlocksFailed) and got.req_id == "d-2" and "in flight for request d-1" in got.reason, got
    p_kv[:] = 5
    p_cmd.send(m.encode(w.SendBlocks("p-1", "T1", (3,), BLOCK_SIZE)))
    got = event(d_ev)
    assert got == w.BlocksReceived("d-1", "T1", got.nbytes, got.num_descs), got
    assert isinstance(event(p_ev), w.BlocksSent)
    page = TOTAL_HEADS * HEAD_BYTES
    assert (d_kv[page:2 * page] == 5).all() and not (d_kv[2 * page:3 * page] == 5).any()
    # P likewise: a second request's SendBlocks of a transfer id in flight fails alone
    p_cmd.send(m.encode(w.SendBlocks("p-2", "T2", (4,), BLOCK_SIZE)))
    p_cmd.send(m.encode(w.SendBlocks("p-3", "T2", (5,), BLOCK_SIZE)))
    got = event(p_ev)
    assert got.req_id == "p-3" and not got.ok and "in flight for request p-2" in got.reason, got
    d_cmd.send(m.encode(w.ExpectBlocks("d-2", "T2", (6,), BLOCK_SIZE, src, 20.0)))
    assert isinstance(event(d_ev), w.BlocksReceived)
    got = event(p_ev)
    assert got.req_id == "p-2" and got.ok, got


def test_a_decode_request_that_ends_before_registering_frees_ps_blocks_now(writers):
    """vLLM's D request ends while queued (its client went away): it never registers, and D's
    writer tells P so; P frees the prompt's blocks now, not at its registration deadline (20 s)."""
    p_cmd, p_ev, _ = writers.start("prefill", "P", 0, 1)
    d_cmd, d_ev, _ = writers.start("decode", "D", 0, 1)
    src = m.PrefillSource("P", 1, (writers.handshake("P", 0),))
    d_cmd.send(m.encode(w.ExpectBlocks("d-0", "T0", (1,), BLOCK_SIZE, src, 20.0)))  # the handshake, done once
    p_cmd.send(m.encode(w.SendBlocks("p-0", "T0", (2,), BLOCK_SIZE)))
    assert isinstance(event(d_ev), w.BlocksReceived) and isinstance(event(p_ev), w.BlocksSent)
    t0 = time.monotonic()
    p_cmd.send(m.encode(w.SendBlocks("p-1", "T1", (3,), BLOCK_SIZE)))
    d_cmd.send(m.encode(w.ForgetTransfer("d-1", "T1", src, "decode request ended before D allocated it")))
    got = event(p_ev, 15.0)
    assert isinstance(got, w.BlocksSent) and got.req_id == "p-1" and not got.ok, got
    assert time.monotonic() - t0 < 10.0, "freed at the registration deadline, not by D's word"
    # D's word first, P's prefill done after it: P remembers, and answers its SendBlocks at once
    t0 = time.monotonic()
    d_cmd.send(m.encode(w.ForgetTransfer("d-2", "T2", src, "decode request ended before D allocated it")))
    d_cmd.send(m.encode(w.ExpectBlocks("d-3", "T3", (4,), BLOCK_SIZE, src, 20.0)))  # behind it on D's link
    p_cmd.send(m.encode(w.SendBlocks("p-3", "T3", (5,), BLOCK_SIZE)))
    assert isinstance(event(d_ev), w.BlocksReceived) and isinstance(event(p_ev), w.BlocksSent)  # P had the word
    p_cmd.send(m.encode(w.SendBlocks("p-2", "T2", (6,), BLOCK_SIZE)))
    got = event(p_ev, 15.0)
    assert isinstance(got, w.BlocksSent) and got.req_id == "p-2" and not got.ok, got
    assert time.monotonic() - t0 < 10.0, "freed at the registration deadline, not by D's word"
    assert not d_ev.poll(500)  # D answers vLLM nothing of the requests it had nothing of


def _hello(engine: str, agent) -> bytes:
    """A Hello a D writer of this test's shape would send (real NIXL metadata)."""
    return m.encode(w.VllmHello(engine, 0, 1, agent.name, agent.metadata(), 0, kv_memory(1), m.WIRE_VERSION, "tiny"))


@pytest.mark.skipif(not nobody_runs_python(), reason="needs root, setpriv, and this python usable by uid 65534")
def test_default_handshake_is_closed_to_another_uid(writers):
    """The connector's default (no handshake host): P's writer handshakes on an ipc file in the
    connector's 0700 socket directory, so another local uid cannot connect and never gets the
    Hello (NIXL metadata, KV base); the same Hello from our uid is answered with P's Hello."""
    from pushkv.transport.nixl_agent import NixlAgent
    from pushkv.vllm import params as P

    ep = P.settings(f"P-uid-{os.getpid()}", 1, {}, env={}).handshake_endpoint(0)
    assert ep.startswith("ipc:///")
    writers.start("prefill", "P", 0, 1, handshake=ep)
    agent = NixlAgent(f"uid-probe-{os.getpid()}")
    ask = {ep: _hello("D-probe", agent).hex()}
    theirs = probe(ask, as_other_uid=True)[ep]
    assert theirs["connect"] != "connected" and not theirs["answer"], theirs
    assert theirs.get("unix") == "PermissionError", theirs
    ours = probe(ask, as_other_uid=False)[ep]
    got = w.DEC_VHANDSHAKE.decode(bytes.fromhex(ours["answer"]))
    assert isinstance(got, w.VllmHello) and got.agent_metadata, got
    writers.procs[-1].terminate()
    writers.procs[-1].wait(30)
    assert not os.path.exists(ep[len("ipc://"):]), "the writer left its handshake socket file behind"


def test_tcp_handshake_refuses_a_stranger_and_serves_the_secret_holder(writers, tmp_path):
    """Across hosts the handshake is tcp under CURVE: a plain peer and one with another secret
    are thrown out before their Hello is read, and get no answer; a D writer with the secret
    handshakes and receives its KV."""
    from pushkv.security import Security, derive_keys, load_secret
    from pushkv.supervisor.plan import free_tcp_port

    secret = tmp_path / "curve.secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    secret.chmod(0o600)
    hs = f"tcp://127.0.0.1:{free_tcp_port()}"
    p_cmd, p_ev, p_kv = writers.start("prefill", "P", 0, 1, handshake=hs, secret_file=str(secret))
    from pushkv.transport.nixl_agent import NixlAgent

    hello = _hello("D-stranger", NixlAgent(f"stranger-{os.getpid()}"))
    knock(hs, None, hello)  # plain ZMQ
    knock(hs, Security(derive_keys(b"another secret, 32 bytes long..")), hello)
    assert derive_keys(load_secret(str(secret))) != derive_keys(b"another secret, 32 bytes long..")
    d_cmd, d_ev, d_kv = writers.start("decode", "D", 0, 1, secret_file=str(secret))
    p_kv[:] = 9
    src = m.PrefillSource("P", 1, (hs,))
    d_cmd.send(m.encode(w.ExpectBlocks("d-1", "T1", (4,), BLOCK_SIZE, src, 20.0)))
    p_cmd.send(m.encode(w.SendBlocks("p-1", "T1", (2,), BLOCK_SIZE)))
    got = event(d_ev)
    assert isinstance(got, w.BlocksReceived) and got.transfer_id == "T1", got
    page = TOTAL_HEADS * HEAD_BYTES
    assert (d_kv[4 * page:5 * page] == 9).all()
