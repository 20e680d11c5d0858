"""vLLM's POST /reset_prefix_cache through a whole push deployment: P and D forget their cached prefixes, so a prompt
that hit before computes whole again, with the same tokens."""
import pytest

from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

BLOCK = 16


def test_reset_prefix_cache_forgets_every_instances_prefixes(tmp_path):
    prompt = [(i * 7 + 3) % 256 for i in range(5 * BLOCK)]
    with deployment(tmp_path, "--mode", "push", "--model", "small", "--num-blocks", "512") as dep:
        def hits() -> int:
            return sum(dep.stats(role).counters.get("prefix_hit_tokens", 0) for role in ("prefill", "decode"))

        first = dep.tokens(prompt, 4)
        before = hits()
        assert dep.tokens(prompt, 4) == first and hits() >= before + 4 * BLOCK  # the prompt's blocks were cached
        wait_pools_free(dep)
        status, body = dep.post("/reset_prefix_cache", {})
        assert status == 200, body
        assert sorted(e["role"] for e in body["reset"]) == ["decode", "prefill"], body
        assert all(e["cached_blocks"] == 0 for e in body["reset"]), body
        after = hits()
        assert dep.tokens(prompt, 4) == first and hits() == after  # nothing left to hit, the same tokens
        assert dep.stats("prefill").counters["prefix_resets"] == 1
        assert dep.tokens(prompt, 4) == first and hits() >= after + 4 * BLOCK  # and it caches anew
        wait_pools_free(dep)
