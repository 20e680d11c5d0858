"""Handshakes run on the writer's loop: a prefill peer that never answers delays no
other transfer (real P and D writer processes, real NIXL; this test plays both
schedulers and the silent peer)."""
import os
import time

import msgspec
import pytest
import torch
import zmq

from pushkv import messages as m
from pushkv.writer.base import HANDSHAKE_TIMEOUT_S
from tests.support.procs import recv
from tests.writer.test_writer_transfer import _pair, fill

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    for cfg, p_sched, d_sched, p_pool, d_pool, _ in _pair(tmp_path_factory, num_blocks=32):
        yield cfg, p_sched, d_sched, p_pool, d_pool


def test_silent_peer_delays_no_other_transfer(pair, tmp_path):
    cfg, p_sched, d_sched, p_pool, d_pool = pair
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the Hello, never answers
    silent.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{os.path.join(str(tmp_path), 'silent.sock')}"
    silent.bind(endpoint)
    try:
        ghost = m.PrefillSource("ghost-engine", 1, (endpoint,))
        t0 = time.monotonic()
        d_sched.send(m.encode(m.ExpectKV("ghost", 0, (7,), 16, ghost, 30.0)))
        d_sched.send(m.encode(m.ExpectKV("ghost-cancelled", 0, (8,), 16, ghost, 30.0)))
        assert silent.poll(5000), "D never sent its Hello to the silent peer"
        hello = m.DEC_HANDSHAKE.decode(silent.recv_multipart()[-1])
        assert isinstance(hello, m.Hello) and hello.engine_id == cfg.decode.engine_id

        # a real push while that handshake hangs: it completes, and first
        fill(p_pool, [3, 4], seed=1)
        d_pool.tensor[[20, 21]] = 0
        real = m.PrefillSource(cfg.prefill.engine_id, 1, cfg.prefill.handshake_endpoints)
        d_sched.send(m.encode(m.ExpectKV("real", 0, (20, 21), 32, real, 30.0)))
        p_sched.send(m.encode(m.SendKV("real", 0, (3, 4), 32, first_token=5)))
        got = recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=HANDSHAKE_TIMEOUT_S)
        took = time.monotonic() - t0
        assert isinstance(got, m.KVReceived) and got.transfer_id == "real", got
        assert took < HANDSHAKE_TIMEOUT_S / 2, f"real transfer took {took:.2f}s next to a silent handshake"
        assert isinstance(recv(p_sched, m.DEC_WRITER_TO_SCHED), m.KVSent)
        assert torch.equal(p_pool.tensor[[3, 4]], d_pool.tensor[[20, 21]])

        # a request waiting on the handshake can be cancelled: answered once, at once
        d_sched.send(m.encode(m.CancelKV("ghost-cancelled", 0, "client went away")))
        got = recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=2.0)
        assert isinstance(got, m.KVFailed) and got.transfer_id == "ghost-cancelled", got
        assert got.reason == "client went away"

        # the silent peer's request fails at the handshake deadline, with the reason
        got = recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=HANDSHAKE_TIMEOUT_S + 5)
        assert isinstance(got, m.KVFailed) and got.transfer_id == "ghost", got
        assert "timed out" in got.reason and "ghost-engine" in got.reason, got.reason
        assert time.monotonic() - t0 >= HANDSHAKE_TIMEOUT_S - 0.5
        assert not d_sched.poll(500), "a cancelled request was answered twice"

        # the next request to that peer tries the handshake again (and fails the same way)
        d_sched.send(m.encode(m.ExpectKV("ghost-again", 0, (9,), 16, ghost, 30.0)))
        assert silent.poll(5000), "no second Hello: a failed handshake was not retried"
        silent.recv_multipart()
        d_sched.send(m.encode(m.CancelKV("ghost-again", 0, "done")))
        assert isinstance(recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=2.0), m.KVFailed)
    finally:
        silent.close(0)


def test_peer_answering_for_another_engine_is_refused(pair, tmp_path):
    """An endpoint that answers with someone else's Hello fails that request with the reason."""
    cfg, p_sched, d_sched, *_ = pair
    liar = zmq.Context.instance().socket(zmq.ROUTER)
    liar.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{os.path.join(str(tmp_path), 'liar.sock')}"
    liar.bind(endpoint)
    try:
        d_sched.send(m.encode(m.ExpectKV("liar", 0, (10,), 16, m.PrefillSource("expected-engine", 1, (endpoint,)),
                                         30.0)))
        assert liar.poll(5000)
        ident, data = liar.recv_multipart()
        h = m.DEC_HANDSHAKE.decode(data)
        liar.send_multipart([ident, m.encode(m.Hello("other-engine", 0, 1, "x", b"", 0, h.layout))])
        got = recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=5.0)
        assert isinstance(got, m.KVFailed) and "answered by other-engine" in got.reason, got
    finally:
        liar.close(0)


def _ask_raw(endpoint: str, hello: m.Hello) -> bytes:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(m.encode(hello))
        assert s.poll(10_000), "no handshake answer"
        return s.recv()
    finally:
        s.close(0)


def _ask(endpoint: str, hello: m.Hello):
    return m.DEC_HANDSHAKE.decode(_ask_raw(endpoint, hello))


@pytest.mark.parametrize("change,says", [
    ({"model_id": "another-model"}, "model differs"),
    ({"wire_version": m.WIRE_VERSION + 1}, "wire version differs"),
    ({"wire_version": 0}, "wire version differs"),  # a writer from before versions were sent
])
def test_refused_peer_gets_the_reason_not_the_metadata(pair, change, says):
    """A Hello from a writer of another model or wire version is answered with HelloRefused naming
    both sides' values, and none of P's NIXL metadata (which would let it READ and WRITE the pool)."""
    from pushkv.transport.nixl_agent import NixlAgent

    cfg, p_sched, d_sched, *_ = pair
    name = f"probe-{change}"
    agent = NixlAgent(name)  # kept alive while P loads its metadata
    good = m.Hello(name, 0, 1, name, agent.metadata(), 0, cfg_layout(cfg),
                   wire_version=m.WIRE_VERSION, model_id=model_id(cfg))
    ours = _ask(cfg.prefill.handshake_endpoints[0], good)
    assert isinstance(ours, m.Hello) and ours.agent_metadata, "a matching peer is answered with P's Hello"
    hello = msgspec.structs.replace(good, engine_id=name + "-bad", **change)
    raw = _ask_raw(cfg.prefill.handshake_endpoints[0], hello)
    got = m.DEC_HANDSHAKE.decode(raw)
    assert isinstance(got, m.HelloRefused), got
    assert says in got.reason and got.engine_id == cfg.prefill.engine_id, got.reason
    # nothing of P's Hello travels with the refusal: not its NIXL metadata, not its agent's name
    assert ours.agent_metadata not in raw and ours.agent_name.encode() not in raw, raw[:200]
    assert len(raw) < 200 + len(got.reason), len(raw)


def test_refused_link_fails_its_request_at_once(pair, tmp_path):
    """D's writer, refused by a peer, fails the request waiting on it with the peer's reason, not
    at the handshake deadline."""
    cfg, p_sched, d_sched, *_ = pair
    refuser = zmq.Context.instance().socket(zmq.ROUTER)
    refuser.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{os.path.join(str(tmp_path), 'refuser.sock')}"
    refuser.bind(endpoint)
    try:
        t0 = time.monotonic()
        d_sched.send(m.encode(m.ExpectKV("refused", 0, (11,), 16, m.PrefillSource("strict-engine", 1, (endpoint,)),
                                         30.0)))
        assert refuser.poll(5000)
        ident, data = refuser.recv_multipart()
        assert isinstance(m.DEC_HANDSHAKE.decode(data), m.Hello)
        refuser.send_multipart([ident, m.encode(m.HelloRefused("strict-engine", 0, "model differs: test"))])
        got = recv(d_sched, m.DEC_WRITER_TO_SCHED, timeout_s=5.0)
        assert isinstance(got, m.KVFailed) and "refused by strict-engine" in got.reason, got
        assert "model differs: test" in got.reason
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S / 2
    finally:
        refuser.close(0)


def cfg_layout(cfg):
    from pushkv.kv import layout as L

    return L.instance_layout(cfg, cfg.decode, 0)


def model_id(cfg):
    from pushkv.config import model_fingerprint

    return model_fingerprint(cfg.model)
