"""What a P/D pair of vLLM instances set up unlike each other is told, pure: no vLLM needed."""
import pytest

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
