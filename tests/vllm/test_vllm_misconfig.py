"""What a P/D pair of vLLM instances set up unlike each other is told, pure: no vLLM needed."""
import pytest

from pushkv.vllm import params as P
from pushkv.vllm import regions as R

HEAD, HEADS = 64, 2  # bytes of one head's page row per token, the model's KV heads


def pages(block_tokens=16, heads=HEADS, layers=2, head=HEAD, dims=True):
    """A CPU instance's description: [blocks, heads, block_size, 2 * head_size] pages, 8 blocks."""
    page = heads * block_tokens * head
    axes = ((heads, block_tokens * head), (block_tokens * head, 1)) if dims else ()
    region = [R.LayerRegion(i * 8 * page, page, page, block_tokens * head, axes, 0 if dims else -1)
              for i in range(layers)]
    return R.KVMemory(layers * 8 * page, 8, tuple(region), heads, block_tokens)


@pytest.mark.parametrize("theirs,says", [
    (pages(block_tokens=32), "block size 16 tokens here, 32 there (P and D need the same --block-size)"),
    (pages(layers=3), "2 KV layers here, 3 there"),
    (pages(heads=4), "2 KV heads here, 4 there"),
    (pages(head=2 * HEAD), "layer 0's page is 2048 bytes here, 4096 there"),
    (pages(dims=False), "layer 0's page axes are (2, 1024) here, () there"),
])
def test_a_peer_with_other_pages_is_refused_naming_both_values(theirs, says):
    """Before, every such peer got one sentence listing five things that might differ."""
    why = pages().pairing_problem(1, theirs, 1, "D-1")
    assert why.startswith("peer D-1's KV pages differ from this instance's: ")
    assert says in why
    assert not pages().same_pages(theirs)


def test_a_peer_with_the_same_pages_pairs():
    assert pages().pairing_problem(1, pages(), 1, "D-1") == ""
    assert pages().same_pages(pages())


@pytest.mark.parametrize("extra,says", [
    ({"stream_group": 4}, "unknown key(s) ['stream_group'] in kv_connector_extra_config (it takes ["),
    ({"handshake_port": 7100, "transfer_sec": 5}, "unknown key(s) ['transfer_sec']"),
    ({"stream_groups": "two"}, "stream_groups must be an integer, got 'two'"),
    ({"stream_groups": 1.5}, "stream_groups must be an integer, got 1.5"),
    ({"stream_groups": -1}, "stream_groups must be at least 0, got -1"),
    ({"transfer_s": 0}, "transfer_s must be at least 0.001, got 0"),
    ({"registration_wait_s": "soon"}, "registration_wait_s must be a number, got 'soon'"),
    ({"idle_wait_ms": -1}, "idle_wait_ms must be at least 0, got -1"),
    ({"handshake_port": 70000}, "handshake_port must be from 1 to 65534, got 70000"),  # tp 2: port + 1 listens too
    ({"handshake_port": "x"}, "handshake_port must be an integer, got 'x'"),
    ({"cuda_memory": "gpu"}, "cuda_memory must be one of ['writer', 'vllm'], got 'gpu'"),
])
def test_a_bad_extra_config_is_refused_naming_the_key(extra, says):
    """Before, a misspelt key was dropped without a word (no streaming, default deadlines) and a
    bad value raised int()'s or float()'s message, which names no key."""
    with pytest.raises(ValueError) as e:
        P.settings("E", 2, extra, env={})
    assert says in str(e.value)
    assert str(e.value).startswith("pushkv's connector: ")


def test_every_key_the_readme_lists_is_taken():
    extra = {"handshake_host": "10.0.0.1", "handshake_port": "7100", "secret_file": "/s", "registration_wait_s": 5,
             "transfer_s": 6.5, "idle_wait_ms": 0, "stream_groups": 4, "cuda_memory": "vllm"}
    s = P.settings("E", 1, extra, env={})
    assert (s.handshake_endpoint(0), s.registration_wait_s, s.transfer_s, s.idle_wait_ms, s.stream_groups,
            s.cuda_memory) == ("tcp://10.0.0.1:7100", 5.0, 6.5, 0.0, 4, "vllm")
    assert set(extra) == set(P.EXTRA_KEYS)


@pytest.mark.parametrize("leg,kv_role,refused", [
    ("prefill", "kv_producer", False), ("decode", "kv_consumer", False),
    ("prefill", "kv_both", False), ("decode", "kv_both", False),
    ("decode", "kv_producer", True), ("prefill", "kv_consumer", True),
])
def test_a_leg_on_the_other_roles_instance_is_refused(leg, kv_role, refused):
    why = P.leg_refused(leg, kv_role)
    assert bool(why) == refused
    if refused:
        assert why.startswith(f"a {leg} leg sent to a {kv_role} instance") and "wrong way round" in why
