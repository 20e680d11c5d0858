"""``--kv-events-config``, as vLLM's, through a push deployment: P and D each publish their prefix cache's events
on their own port (P's first, D's the port after), as vLLM's ``KVEventBatch`` (decoded here with vLLM's own types
where vLLM is installed, else pushkv's): the prompt's full blocks stored under the hashes pushkv's prefix cache
names them by, their eviction, ``/reset_prefix_cache`` clearing them; and a consumer that missed batches gets them
again from the replay socket."""
from __future__ import annotations

import functools
import json

import msgspec
import pytest
import zmq

from pushkv.protocol import kv_events as K
from pushkv.protocol.prefix_cache import block_hashes, event_hash
from tests.support.deploy import deployment, wait_pools_free
from tools.launch import free_tcp_port

pytestmark = pytest.mark.timeout(300)

BLOCK = 16

@functools.cache
def _decoder() -> msgspec.msgpack.Decoder:
    """vLLM's own types read the wire where vLLM is installed (CI), else pushkv's (imported when first used, not
    when the suite is collected)."""
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError:
        return K.DECODER
    return msgspec.msgpack.Decoder(KVEventBatch)


def _replay(ctx: zmq.Context, endpoint: str, start: int = 0) -> list[tuple[int, object]]:
    """Every kept batch from ``start`` on, as a consumer that missed them asks for them (a DEALER: the replay
    answers one request with many messages, each ``(delimiter, sequence, payload)``, then the end marker)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 30_000)
    s.connect(endpoint)
    try:
        s.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            empty, seq, payload = s.recv_multipart()
            assert empty == b""
            if seq == K.END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), _decoder().decode(payload)))
    finally:
        s.close(0)


def _events(batches, kind: str) -> list:
    return [e for _, b in batches for e in b.events if type(e).__name__ == kind]


def test_push_instances_publish_their_prefix_caches_events(tmp_path):
    pub, replay = free_tcp_port(), free_tcp_port()
    while replay in (pub + 1, pub - 1):
        replay = free_tcp_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
           "topic": "kv"}
    prompt = [(i * 7 + 3) % 256 for i in range(3 * BLOCK + 5)]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        with deployment(tmp_path, "--mode", "push", "--model", "small", "--num-blocks", "24",
                        "--kv-events-config", json.dumps(cfg)) as dep:
            dep.tokens(prompt, 4)
            wait_pools_free(dep)
            # the prompt's 3 full blocks, as the prefix cache names them (their low 64 bits)
            want = [event_hash(h) for h in block_hashes(prompt, BLOCK)]
            for role, port in (("prefill", replay), ("decode", replay + 1)):
                stored = _events(_replay(ctx, f"tcp://127.0.0.1:{port}"), "BlockStored")
                assert [h for e in stored for h in e.block_hashes] == want, role
                first = stored[0]
                assert first.parent_block_hash is None and first.block_size == BLOCK and first.medium == "CPU"
                assert [t for e in stored for t in e.token_ids] == prompt[:3 * BLOCK], role
            # the live feed: another prompt's blocks reach a subscriber (it may have joined after the first)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            seen: set[int] = set()
            for i in range(8):
                other = [(i * 31 + j * 5 + 1) % 256 for j in range(2 * BLOCK + 1)]
                dep.tokens(other, 2)
                while poller.poll(2000):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kv" and len(seq) == 8
                    for e in _decoder().decode(payload).events:
                        seen.update(getattr(e, "block_hashes", []))
                if {event_hash(h) for h in block_hashes(other, BLOCK)} <= seen:
                    break
            else:
                pytest.fail("no live BlockStored of a later prompt reached the subscriber")
            wait_pools_free(dep)
            # 24 blocks a pool: more prompts than fit evict the first one's blocks
            for i in range(6):
                dep.tokens([(i * 13 + j * 3 + 2) % 256 for j in range(4 * BLOCK + 1)], 2)
            wait_pools_free(dep)
            batches = _replay(ctx, f"tcp://127.0.0.1:{replay}")
            removed = {h for e in _events(batches, "BlockRemoved") for h in e.block_hashes}
            assert set(want) <= removed
            assert [s for s, _ in batches] == list(range(len(batches)))  # every batch kept, in order
            # /reset_prefix_cache: every instance says all blocks are gone
            status, body = dep.post("/reset_prefix_cache", {})
            assert status == 200, body
            for port in (replay, replay + 1):
                tail = _replay(ctx, f"tcp://127.0.0.1:{port}", start=0)
                assert type(tail[-1][1].events[-1]).__name__ == "AllBlocksCleared"
                later = _replay(ctx, f"tcp://127.0.0.1:{port}", start=tail[-1][0])
                assert [s for s, _ in later] == [tail[-1][0]]  # from a sequence number on
    finally:
        sub.close(0)
        ctx.term()


def test_a_setting_that_is_not_vllms_is_refused_before_anything_starts(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--mode", "local", "--kv-events-config",
                        '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--kv-events-config" in r.stderr and "publisher" in r.stderr
