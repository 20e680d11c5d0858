"""Every ZMQ socket caps the messages it accepts, sized from the configuration (pushkv.limits):
no legal message comes near a cap, and a scheduler that is sent one past its cap never sees it
(ZeroMQ disconnects the sender) and keeps serving."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pushkv import limits as L
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.router import api, text
from tests.support.procs import children, planned, recv

pytestmark = pytest.mark.timeout(120)


def router_generate_at_every_bound(cfg: DeploymentConfig) -> m.Generate:
    """The largest Generate the router's parser lets through: a prompt of max_model_len - 1 ids,
    every bounded field at its bound, and the legs' source and pull parameters."""
    vocab, n = cfg.model.vocab_size, L.max_len(cfg)
    body = {"prompt": [vocab - 1] * (n - 1), "max_tokens": 1, "temperature": 0.5, "top_p": 0.5, "top_k": vocab,
            "min_p": 0.5, "seed": (1 << 64) - 1, "presence_penalty": -2, "frequency_penalty": -2,
            "logprobs": L.MAX_LOGPROBS, "prompt_logprobs": L.MAX_LOGPROBS,
            "stop_token_ids": list(range(vocab - L.MAX_STOP_TOKEN_IDS, vocab)),
            "logit_bias": {str(vocab - 1 - i): -99.5 for i in range(min(vocab, L.MAX_LOGIT_BIAS))}}
    p = api.parse_completion(body, text.ByteTokenizer(), api.Limits(vocab, n, eos_token_ids=(0,)))
    src = cfg.prefill.source()
    pull = m.PullParams(src, tuple(range(-(-n // 16))), n - 1, vocab - 1, time.monotonic())
    return m.Generate("f" * 35, 0, "decode", tuple(p.prompt_token_ids), p.max_tokens, p.stop_token_ids,
                      src, pull, time.time(), p.sampling)


@pytest.mark.parametrize("model", ["tiny", "small", "qwen3-8b"])
def test_no_legal_message_comes_near_a_cap(model):
    cfg = DeploymentConfig(model=preset(model))
    legal = len(m.encode(router_generate_at_every_bound(cfg)))
    assert legal <= len(m.encode(L.largest_generate(cfg))) and L.generate_cap_bytes(cfg) >= 2 * legal
    assert L.msg_cap_bytes(cfg) >= 2 * L.step_bytes(cfg, cfg.decode) >= L.generate_cap_bytes(cfg)
    longer = msgspec.structs.replace(cfg, max_model_len=4 * cfg.model.max_position)
    # sized from the config: at least a byte per prompt id more, with the margin (a structured output's grammar,
    # 64k characters, is a fixed share of every cap)
    assert L.generate_cap_bytes(longer) - L.generate_cap_bytes(cfg) >= L.MARGIN * 3 * cfg.model.max_position


def test_every_actor_socket_carries_a_cap():
    a = Actor("t", max_msg_bytes=12345)
    try:
        own = a.socket(zmq.DEALER, "inproc://cap-own", bind=True)
        named = a.socket(zmq.DEALER, "inproc://cap-named", bind=True, max_msg_bytes=777)
        assert own.getsockopt(zmq.MAXMSGSIZE) == 12345 and named.getsockopt(zmq.MAXMSGSIZE) == 777
        assert Actor("u").max_msg_bytes == L.CONTROL_MSG_BYTES
    finally:
        own.close(0)
        named.close(0)


def test_a_scheduler_drops_an_oversized_message_and_keeps_serving(tmp_path):
    """A real local scheduler process with this test as its worker. A peer sends one frame past
    the front socket's cap: ZeroMQ disconnects it and the scheduler decodes nothing of it; the
    same peer, reconnected, and a second one are then served."""
    cfg = planned(DeploymentConfig(mode="local", model=preset("tiny"),
                                   local=InstanceConfig(role="local", num_blocks=64)), tmp_path)
    cap = L.generate_cap_bytes(cfg)
    ctx = zmq.Context.instance()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.bind(cfg.local.worker_endpoints[0])
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    mon = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
    other = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    try:
        with children(cfg, [("scheduler", "local", 0)]):
            peer.connect(cfg.local.sched_endpoint)
            other.connect(cfg.local.sched_endpoint)
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_CONNECTED
            peer.send(b"\x93" + b"\x00" * cap)  # a msgpack array head, then past the cap
            events = [recv_event(mon, 10.0) for _ in range(2)]
            assert events == [zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECTED]  # dropped, then back
            for sock, tid in ((peer, "after-drop"), (other, "bystander")):
                sock.send(m.encode(m.Generate(tid, 0, "local", (1, 2, 3), 3)))
                assert serve(worker, sock) == [7, 7, 7], tid
            peer.send(m.encode(m.GetStats()))
            stats = recv(peer, m.DEC_SCHED_TO_ROUTER)
            assert stats.counters.get("bad_frame", 0) == 0 and stats.counters["requests_completed"] == 2
    finally:
        for s in (worker, peer, other, mon):
            s.close(0)


def recv_event(mon: zmq.Socket, timeout_s: float) -> int:
    assert mon.poll(int(timeout_s * 1000)), "no socket event"
    return recv_monitor_message(mon)["event"]


def serve(worker: zmq.Socket, client: zmq.Socket, timeout_s: float = 20.0) -> list[int]:
    """Answer the scheduler's steps (token 7 for every sampled seq) until ``client``'s request ends."""
    poller = zmq.Poller()
    poller.register(worker, zmq.POLLIN)
    poller.register(client, zmq.POLLIN)
    toks: list[int] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for sock, _ in poller.poll(200):
            if sock is worker:
                step = m.DEC_SCHED_TO_WORKER.decode(worker.recv())
                worker.send(m.encode(m.StepDone(step.step_id, tuple(7 for w in step.seqs if w.sample))))
            else:
                msg = m.DEC_SCHED_TO_ROUTER.decode(client.recv())
                assert isinstance(msg, m.TokensGenerated), msg
                toks.extend(msg.token_ids)
                if msg.finished:
                    return toks
    raise TimeoutError(f"request not finished; tokens so far {toks}")


@pytest.mark.parametrize("model,stream,groups", [("qwen3-8b", "off", 4), ("qwen3-8b", "layer", 4),
                                                 ("small", "layer", 8), ("hybrid", "layer", 4)])
def test_a_step_done_with_every_checksum_fits_the_cap(model, stream, groups):
    """--kv-verify full: P's StepDone carries the sums of every prompt whose last chunk the step
    stored, a row per KV head of one sum per (layer group, block); the caps count the layer
    groups the pool is really cut into (layer streaming cuts it in more), and prompts that fill
    P's whole pool in one step stay within half the cap."""
    import torch

    from pushkv.kv import checksum as C
    from pushkv.kv.layout import instance_layout, layer_groups

    cfg = DeploymentConfig(model=preset(model), mode="push", kv_verify="full", push_stream=stream,
                           push_stream_groups=groups)
    inst = cfg.prefill
    lay = instance_layout(cfg, inst, 0)
    assert L._checksum_groups(cfg) == len(layer_groups(lay))
    pool_tokens = inst.num_blocks * inst.block_size
    n = pool_tokens // inst.max_num_seqs  # every sequence a prompt of its share of the pool
    units = C.plan_units("full", n, inst.block_size)
    one = C.to_wire(lay, torch.full((len(layer_groups(lay)), len(units), lay.kv_heads), -(2**63)), units,
                    inst.block_size, n)
    done = m.StepDone(1, (cfg.model.vocab_size - 1,) * inst.max_num_seqs, 1.0, checksums=(one,) * inst.max_num_seqs)
    assert 2 * len(m.encode(done)) <= L.msg_cap_bytes(cfg)
    assert len(m.encode(done)) <= L.step_done_bytes(cfg, inst) + inst.max_num_seqs * 64  # 64 B: a struct's own


@pytest.mark.parametrize("model", ["tiny", "small", "qwen3-8b"])
def test_prompt_logprobs_at_their_widest_stay_within_half_the_cap(model):
    """A prompt of max_model_len tokens scored with the most alternatives, to the router with its
    first token; and a step that scores a whole pool of prompt positions, to its scheduler."""
    cfg = DeploymentConfig(model=preset(model))
    top, k = cfg.model.vocab_size - 1, L.MAX_LOGPROBS

    def scored(start: int, n: int) -> m.PromptLogprobs:
        return m.PromptLogprobs(start, n, k, bytes(4 * n), bytes(4 * n), bytes(4 * n * k), bytes(4 * n * k))

    n = L.max_len(cfg) - 1
    lp = m.TokenLogprob(-1.5, (top,) * k, (-2.5,) * k)
    first = m.TokensGenerated("f" * 35, 0, (top,), True, "length", n + 1, (("local.finished", time.time()),) * 30,
                              None, (lp,), n, 1, 1, n, n, prompt_logprobs=scored(1, n))
    assert 2 * len(m.encode(first)) <= L.msg_cap_bytes(cfg) and len(m.encode(first)) <= L.tokens_bytes(cfg)
    inst = cfg.prefill
    share = inst.num_blocks * inst.block_size // inst.max_num_seqs
    done = m.StepDone(1, (top,) * inst.max_num_seqs, 1.0,
                      prompt_logprobs=tuple(scored(1 + i * share, share) for i in range(inst.max_num_seqs)))
    assert 2 * len(m.encode(done)) <= L.msg_cap_bytes(cfg) and len(m.encode(done)) <= L.step_done_bytes(cfg, inst)
