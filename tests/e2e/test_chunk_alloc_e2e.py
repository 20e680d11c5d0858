"""Chunked prefill takes its blocks chunk by chunk (vLLM's allocate_slots), over real processes: on a pool that holds
two of the prompts whole, more of them prefill in one step than whole-prompt admission let in (the scheduler's
``prefills_in_step_max``), locally and on P (pull, and push with --push-stream off: nothing streams before a prompt's
prefill ends); a prompt short of blocks mid-prefill is preempted by recompute. Every request's greedy tokens equal
local mode's on a pool that holds them all, and every block is free on every instance after."""
import json

import pytest

from pushkv.kv.layout import blocks_for
from tests.support.deploy import deployment, in_threads, wait_pools_free
from tools.layout_report import prompt

pytestmark = pytest.mark.timeout(600)

BS = 16
N, LEN, MAX_TOKENS, CHUNK = 6, 160, 8, 16  # a prompt: 10 blocks; computed 16 tokens a step
TIGHT, LARGE = 24, 256  # two prompts whole (and the first output's slot, 11 blocks each); all of them at once
PROMPTS = [prompt(LEN, 40 + i) for i in range(N)]
COMMON = ("--model", "tiny", "--load-format", "dummy", "--prefill-chunk", str(CHUNK))


def run_all(dep) -> list[list[int]]:
    return in_threads(lambda p: dep.tokens(p, MAX_TOKENS), PROMPTS, 500)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("large"), "--mode", "local", "--num-blocks", str(LARGE), *COMMON) as dep:
        ref = run_all(dep)
        st = wait_pools_free(dep)
    assert st["local"].counters.get("preemptions", 0) == 0
    return ref


@pytest.mark.parametrize("mode", ["local", "pull", "push"])
def test_chunked_prefills_share_a_tight_pool_chunk_by_chunk_and_equal_local_modes_tokens(
        tmp_path_factory, reference, mode):
    tmp = tmp_path_factory.mktemp(mode)
    flags = ["--mode", mode, *COMMON]
    if mode == "local":
        flags += ["--num-blocks", str(TIGHT)]
        role = "local"
    else:  # the tight pool on P; D's holds every prompt (its legs take theirs whole: registration, READ)
        conf = tmp / "pools.json"
        conf.write_text(json.dumps({"prefill": {"num_blocks": TIGHT}, "decode": {"num_blocks": LARGE}}))
        flags += ["--config", str(conf)] + (["--push-stream", "off"] if mode == "push" else [])
        role = "prefill"
    with deployment(tmp, *flags) as dep:
        assert dep.cfg.instance(role).num_blocks == TIGHT
        got = run_all(dep)
        st = wait_pools_free(dep)
    whole = TIGHT // blocks_for(LEN + (role == "local"), BS)  # prompts a pool held at once, each taken whole
    assert st[role].counters.get("prefills_in_step_max", 0) > whole, st[role].counters
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, i
