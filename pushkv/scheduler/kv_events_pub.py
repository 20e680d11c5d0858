"""The scheduler's KV-event publisher (``--kv-events-config``): after each message or tick the shell hands it what
the instance's prefix cache did, and it sends that as one vLLM ``KVEventBatch`` on its PUB socket
(``protocol/kv_events.py`` says the wire), keeping the latest batches for a consumer's replay request.

The sockets are plain ZeroMQ, as vLLM's: their consumers speak no CURVE. The events carry prompts' token ids, so
bind the endpoint to an address only trusted consumers reach (docs/security.md). A PUB socket never blocks the
loop: past its high-water mark a slow consumer loses batches (and asks for them again by sequence number).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Optional

import zmq

from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.protocol import kv_events as K

if TYPE_CHECKING:
    from pushkv.actor import Actor

log = logging.getLogger(__name__)


def ordinal(cfg: DeploymentConfig, inst: InstanceConfig) -> int:
    """The instance's place among the ones this host runs, as --metrics-port counts them: P's, then D's."""
    if inst.role != "decode":
        return inst.index
    return inst.index + (cfg.prefill_instances if cfg.host_role == "" and cfg.mode != "local" else 0)


def endpoints(cfg: DeploymentConfig, inst: InstanceConfig) -> tuple[str, Optional[str]]:
    """(PUB endpoint, replay endpoint or None) of this instance."""
    k = ordinal(cfg, inst)
    pub = K.endpoint_for(cfg.kv_events.endpoint, k)
    assert pub is not None
    return pub, K.endpoint_for(cfg.kv_events.replay_endpoint, k)


class Publisher:
    def __init__(self, actor: "Actor", cfg: DeploymentConfig, inst: InstanceConfig) -> None:
        ev = cfg.kv_events
        self.topic = ev.topic.encode()
        self.block_size = inst.block_size
        self.medium = K.MEDIUM_GPU if inst.device.startswith("cuda") else K.MEDIUM_CPU
        self.kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=ev.buffer_steps)
        self.seq = 0
        self.published = 0
        pub_ep, replay_ep = endpoints(cfg, inst)
        self.pub = actor.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, ev.hwm)
        if K.binds(pub_ep):
            self.pub.bind(pub_ep)
        else:
            self.pub.connect(pub_ep)
        self.replay: Optional[zmq.Socket] = None
        if replay_ep:
            self.replay = actor.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_ep)
            actor.add_socket(self.replay, self._serve_replay)
            if replay_ep.endswith(":0"):  # tcp port 0: the port the system picked, for the log and the consumer
                replay_ep = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        if pub_ep.endswith(":0") and K.binds(pub_ep):
            pub_ep = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.where = (pub_ep, replay_ep)
        log.info("%s: KV events on %s%s", inst.name, pub_ep, f" (replay on {replay_ep})" if replay_ep else "")

    def publish(self, journal: list[tuple]) -> None:
        """One batch of what the prefix cache did (nothing when it did nothing)."""
        if not journal:
            return
        payload = K.encode(time.time(), K.events_of(journal, self.block_size, self.medium))
        seq = self.seq
        self.seq += 1
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:  # at the high-water mark: dropped, and kept for replay
            pass
        self.kept.append((seq, payload))

    def _serve_replay(self) -> None:
        """Each replay request waiting: the kept batches from its sequence number on, then the end marker."""
        assert self.replay is not None
        while True:
            try:
                frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a replay request that is no (delimiter, 8-byte sequence): %d frame(s)",
                            len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self.kept:
                if seq >= start:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", K.END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
