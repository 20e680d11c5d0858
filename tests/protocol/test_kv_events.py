"""KV cache events as vLLM publishes them (protocol/kv_events.py, pure): the prefix cache's journal, the events it
becomes, the wire as vLLM's own types decode it, the setting's refusals and each instance's endpoint."""
from __future__ import annotations

import msgspec
import pytest

from pushkv.protocol import kv_events as K
from pushkv.protocol.prefix_cache import PrefixCache, block_hashes, event_hash, root_of

pytestmark = pytest.mark.unit


def test_the_journal_records_what_the_index_did_and_nothing_when_not_asked():
    pc = PrefixCache(4)
    a = pc.allocate(2)
    assert a is not None and pc.insert(a[0], 11) and pc.take_journal() == []  # no journal: nothing kept
    pc.journal = []
    assert pc.insert(a[1], 12, parent=11, tokens=(5, 6), salt="")
    assert not pc.insert(a[1], 12, parent=11, tokens=(5, 6))  # indexed already: no event either
    pc.release(a)
    b = pc.allocate(4)  # two free, two cached: both evicted, the table's last block first
    assert b is not None
    pc.reset()
    assert pc.take_journal() == [("stored", 12, 11, (5, 6), "", None), ("removed", 12), ("removed", 11), ("cleared",)]
    assert pc.take_journal() == []


def test_chained_blocks_are_one_stored_event_and_removals_one_removed_event():
    j = [("stored", 1, None, (1, 2), "", None), ("stored", 2, 1, (3, 4), "", None), ("stored", 9, 7, (8, 8), "", None),
         ("removed", 5), ("removed", 6), ("cleared",), ("stored", 3, None, (0, 0), "tenant", None),
         ("stored", 4, 3, (0, 1), "", (2, "sql")), ("stored", 5, 4, (0, 2), "", (2, "sql"))]
    ev = K.events_of(j, 2, K.MEDIUM_GPU)
    assert ev[0] == K.BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0)
    assert ev[1] == K.BlockStored([9], 7, [8, 8], 2, None, "GPU", None, None, 0)  # 7 is not 2: a run of its own
    assert ev[2] == K.BlockRemoved([5, 6], "GPU", 0)
    assert ev[3] == K.AllBlocksCleared()
    assert ev[4].extra_keys == [("tenant",)] and ev[4].parent_block_hash is None  # a salted prompt's first block
    # a LoRA adapter's blocks, as vLLM reports them: its id and name, the name as every block's extra key, a run of
    # their own after the base model's
    assert ev[5] == K.BlockStored([4, 5], 3, [0, 1, 0, 2], 2, 2, "GPU", "sql", [("sql",), ("sql",)], 0)
    with pytest.raises(ValueError, match="unknown journal entry"):
        K.events_of([("moved", 1)], 2, "GPU")


def test_the_wire_is_vllms_as_its_own_types_decode_it():
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    toks = list(range(100, 132))
    hashes = [event_hash(h) for h in block_hashes(toks, 16)]  # what an event names a block by
    payload = K.encode(1234.5, [K.BlockStored(hashes, None, toks, 16, None, "CPU", None, None, 0),
                                K.BlockRemoved([hashes[1]], "CPU", 0), K.AllBlocksCleared()])
    batch = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0  # vLLM's publisher fills in its rank, 0 alone
    stored, removed, cleared = batch.events
    assert isinstance(stored, vllm_events.BlockStored) and stored.block_hashes == hashes
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, toks, 16)
    assert (stored.medium, stored.lora_id, stored.lora_name, stored.group_idx) == ("CPU", None, None, 0)
    assert isinstance(removed, vllm_events.BlockRemoved) and removed.block_hashes == [hashes[1]]
    assert isinstance(cleared, vllm_events.AllBlocksCleared)
    # and ours reads vLLM's
    back = K.DECODER.decode(msgspec.msgpack.encode(batch))
    assert back.events[0].block_hashes == hashes and isinstance(back.events[2], K.AllBlocksCleared)


def test_the_setting_takes_vllms_fields_and_refuses_the_rest_by_name():
    on = K.parse_config('{"enable_kv_cache_events": true}')
    assert on.on and on.endpoint == "tcp://*:5557" and on.replay_endpoint is None and on.buffer_steps == 10_000
    assert not K.parse_config('{"enable_kv_cache_events": true, "publisher": "null"}').on
    assert not K.parse_config("{}").on
    for bad, says in (('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                      ('{"enable_events": true}', "enable_events"), ("not json", "--kv-events-config"),
                      ('{"endpoint": "http://x:1"}', "endpoint"), ('{"endpoint": "tcp://*"}', "port"),
                      ('{"replay_endpoint": "x"}', "replay_endpoint"), ('{"hwm": 0}', "hwm")):
        with pytest.raises(ValueError, match=says):
            K.parse_config(bad)


def test_each_instance_publishes_on_its_own_endpoint():
    assert K.endpoint_for("tcp://*:5557", 0) == "tcp://*:5557"
    assert K.endpoint_for("tcp://*:5557", 2) == "tcp://*:5559"
    assert K.endpoint_for("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_1"
    assert K.endpoint_for(None, 3) is None
    assert K.endpoint_for("tcp://*:0", 3) == "tcp://*:0"  # vLLM's: port 0 stays the system's to pick, not port 3


def test_port_zero_gives_each_instance_a_port_of_its_own_that_its_log_names(caplog):
    """tcp://*:0 (vLLM's way to let the system pick): no fixed port to check or clash (it was 0, 1, 2, ... per
    instance: ports 1 and 2 are privileged, and endpoint and replay 'met' at 0), and each instance's publisher says
    where it bound."""
    import logging
    from types import SimpleNamespace

    import msgspec as ms
    import zmq

    from pushkv.config import DeploymentConfig
    from pushkv.scheduler.kv_events_pub import Publisher
    from pushkv.supervisor.plan import fixed_ports, port_clash

    ev = K.parse_config('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", '
                        '"replay_endpoint": "tcp://*:0"}')
    cfg = DeploymentConfig(mode="push", prefill_instances=2, decode_instances=2, kv_events=ev, port=8123)
    assert fixed_ports(cfg) == [("--port", 8123)] and port_clash(cfg) == ""
    ev = K.parse_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}')
    cfg = DeploymentConfig(mode="push", prefill_instances=2, kv_events=ev)
    ctx = zmq.Context()
    actor = SimpleNamespace(ctx=ctx, add_socket=lambda sock, fn: None)
    pubs = []
    try:
        with caplog.at_level(logging.INFO, logger="pushkv.scheduler.kv_events_pub"):
            for i in (0, 1):
                pubs.append(Publisher(actor, cfg, ms.structs.replace(cfg.prefill, index=i)))  # type: ignore[arg-type]
        ports = {int(ep.rsplit(":", 1)[1]) for p in pubs for ep in p.where}
        assert len(ports) == 4 and 0 not in ports, [p.where for p in pubs]
        assert all(f"KV events on {p.where[0]} (replay on {p.where[1]})" in caplog.text for p in pubs)
    finally:
        for p in pubs:
            p.close()
        ctx.term()
    assert K.binds("tcp://*:5557") and K.binds("ipc:///tmp/x") and not K.binds("tcp://10.0.0.2:5557")


@pytest.mark.parametrize("salt, lora", [("t", (2, "sql")), ("", (2, "sql")), ("t", None), ("", None)])
def test_extra_keys_are_the_ones_vllm_publishes_for_the_same_request(salt, lora):
    """vLLM names a LoRA adapter on every block of its request and the cache salt on the first (a consumer that keys
    blocks by their tokens and extra keys told an adapter's blocks from the base model's by them): three blocks of a
    prompt give vLLM's own per-block extra keys."""
    from types import SimpleNamespace
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    lr = SimpleNamespace(lora_name=lora[1], lora_path="/adapters/sql", adapter_id=lora[0]) if lora else None
    req = SimpleNamespace(mm_features=[], lora_request=lr, cache_salt=salt, prompt_embeds=None)
    want = utils.to_event_extra_keys([utils.generate_block_hash_extra_keys(req, s, s + 2, 0)[0] for s in (0, 2, 4)])
    j = [("stored", 1, None, (1, 2), salt, lora), ("stored", 2, 1, (3, 4), "", lora),
         ("stored", 3, 2, (5, 6), "", lora)]
    got = [k for ev in K.events_of(j, 2, K.MEDIUM_CPU) for k in (ev.extra_keys or [None] * len(ev.block_hashes))]
    assert got == (want or [None] * 3)


def test_a_salted_prompt_chains_from_its_salt_yet_reports_no_parent():
    # the first block's hash is chained to root_of(salt); its event says None and carries the salt as an extra key
    h = block_hashes([1] * 16, 16, root_of("t"))
    ev = K.events_of([("stored", h[0], None, tuple([1] * 16), "t", None)], 16, "CPU")[0]
    assert ev.block_hashes == [event_hash(h[0])] and ev.parent_block_hash is None and ev.extra_keys == [("t",)]


def test_events_name_a_block_by_the_low_64_bits_of_its_name_and_chain_by_them():
    """A block's name is a whole sha256 digest; msgpack carries integers of 64 bits, so an event carries its low 64
    (vLLM cuts its own names so too), the parent of a run and a removal alike, and a run still chains."""
    h = block_hashes(list(range(48)), 16)
    assert any(x >= 1 << 64 for x in h)
    j = [("stored", h[0], None, tuple(range(16)), "", None), ("stored", h[1], h[0], tuple(range(16, 32)), "", None),
         ("stored", h[2], h[1], tuple(range(32, 48)), "", None), ("removed", h[2])]
    stored, removed = K.events_of(j, 16, "CPU")
    assert stored.block_hashes == [x & (1 << 64) - 1 for x in h] and removed.block_hashes == [h[2] & (1 << 64) - 1]
    cut = K.events_of(j[1:2], 16, "CPU")[0]
    assert cut.parent_block_hash == h[0] & (1 << 64) - 1
    K.encode(0.0, [stored, removed, cut])  # within msgpack's integers


def test_each_instance_of_a_host_takes_the_port_after_the_one_before_it():
    """P's instances first, then D's, as --metrics-port counts them; a host of one role counts its own from 0."""
    import msgspec as ms

    from pushkv.config import DeploymentConfig
    from pushkv.scheduler.kv_events_pub import endpoints
    from pushkv.supervisor.plan import fixed_ports

    ev = K.parse_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                        '"replay_endpoint": "tcp://*:7000"}')
    cfg = DeploymentConfig(mode="push", prefill_instances=2, decode_instances=2, kv_events=ev)
    p1 = ms.structs.replace(cfg.prefill, index=1)
    d0, d1 = cfg.decode, ms.structs.replace(cfg.decode, index=1)
    got = [endpoints(cfg, i) for i in (cfg.prefill, p1, d0, d1)]
    assert got == [(f"tcp://*:{6000 + k}", f"tcp://*:{7000 + k}") for k in range(4)]
    flags = [(f, p) for f, p in fixed_ports(cfg) if f == "--kv-events-config"]
    assert sorted(p for _, p in flags) == [6000, 6001, 6002, 6003, 7000, 7001, 7002, 7003]
    d_host = ms.structs.replace(cfg, host_role="decode")
    assert endpoints(d_host, d1) == ("tcp://*:6001", "tcp://*:7001")
    local = DeploymentConfig(mode="local", kv_events=ev)
    assert endpoints(local, local.local) == ("tcp://*:6000", "tcp://*:7000")
