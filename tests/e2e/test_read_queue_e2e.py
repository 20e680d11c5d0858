"""Pull's READs through D's link queue end to end (``--pull-read background --link-window 1``): real
processes over loopback, real NIXL. Prompts sent at once give local mode's greedy tokens, token for
token, with P at TP 2 and D at TP 1 (each READ takes both P ranks' heads); D's writer queued every READ
and moved one at a time on P's link; every pool is free again."""
from __future__ import annotations

import pytest

from tests.support.deploy import concurrent, deployment, local_references, wait_pools_free
from tools.layout_report import prompt

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4
NUM_BLOCKS = 96
PROMPTS = {n: prompt(n, n) for n in (5, 40, 131)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return local_references(tmp_path_factory, PROMPTS, MAX_TOKENS, NUM_BLOCKS)


def test_reads_queued_on_ps_link_give_local_tokens(references, tmp_path):
    ref = references("small", 2)
    flags = ("--mode", "pull", "--pull-read", "background", "--link-window", "1", "--prefill-tp", "2",
             "--decode-tp", "1", "--model", "small", "--num-blocks", str(NUM_BLOCKS), "--no-prefix-cache")
    with deployment(tmp_path, *flags) as dep:
        order = list(PROMPTS) * 2
        got = concurrent(dep, [PROMPTS[n] for n in order], MAX_TOKENS)
        assert got == [ref[n] for n in order]
        wait_pools_free(dep)
        counters = dep.stats("decode").counters
        assert counters.get("writer.0.read_posts_queued") == len(order), counters
        assert counters.get("writer.0.link_inflight_peak") == 1, counters  # one READ on P's link at a time
        assert (counters.get("writer.0.link_queued"), counters.get("writer.0.link_inflight")) == (0, 0), counters
        assert counters.get("writer.0.read_posts_dropped", 0) == 0, counters
