"""Every layout, end to end: P and D with different block sizes, TP sizes, hybrid
(sliding-window) attention and an MLA-style latent cache, each a real deployment
over loopback and real NIXL.

What is compared to what: greedy tokens through P/D against ``local`` mode run
with P's TP size (the KV is then produced by the very same per-rank computation,
bit for bit; D decodes with its own TP size, whose all-reduce order may differ in
the last float bits, which these tests show does not change a greedy token), and
after every request the KV bytes of every head in every D rank against the P
rank that produced that head (and every P replica of it against the producer).
The matrix itself is tools/layout_report.py's; `pushkv layout-report` runs it
on long prompts and prints descriptors and GB/s.
"""
from __future__ import annotations

import pytest

from pushkv.config import preset
from pushkv.kv import layout as L
from pushkv.protocol.tp import producers_for
from tests.support.deploy import deployment, local_references
from tools.layout_report import MATRIX, expected_notifs, mapped_descs, measured, prompt

pytestmark = pytest.mark.timeout(200)

MAX_TOKENS = 6
NUM_BLOCKS = 64
PROMPTS = {"one-token": [65], "non-multiple": prompt(37, 1), "long": prompt(150, 2)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """local-mode tokens per (model, tp), each deployment started once and stopped at once."""
    return local_references(tmp_path_factory, PROMPTS, MAX_TOKENS, NUM_BLOCKS)


CI_MATRIX = [c for c in MATRIX if c.ci]


@pytest.mark.parametrize("combo", CI_MATRIX, ids=[c.name.replace(" ", "_") for c in CI_MATRIX])
def test_layout_matrix(combo, references, tmp_path):
    ref = references(*combo.reference)
    model = preset(combo.model)
    pairs = sum(len(producers_for(d, combo.d_tp, combo.p_tp, model.cache_kv_heads)) for d in range(combo.d_tp))
    cfg = combo.config(NUM_BLOCKS)  # one WRITE (--push-stream off): one layer group, hybrid's two (full, window)
    groups = len(L.layer_groups(L.instance_layout(cfg, cfg.prefill, 0)))
    heads_layers = sum(L.layout_for(model, combo.d_tp, d, NUM_BLOCKS, combo.d_bs).kv_heads
                       for d in range(combo.d_tp)) * model.num_layers
    with deployment(tmp_path, *combo.flags(NUM_BLOCKS)) as dep:
        for name, toks in PROMPTS.items():
            row = measured(dep, combo, toks, MAX_TOKENS)
            assert row["tokens"] == ref[name], f"{name}: P/D tokens differ from local tp={combo.p_tp}"
            assert row["kv_mismatches"] == [], name
            assert row["kv_compared"] == heads_layers
            descs, nbytes, nblocks = mapped_descs(combo, len(toks), False, NUM_BLOCKS)
            assert (row["descs"], row["kv_bytes"], row["blocks"]) == (descs, nbytes, nblocks), name
            # idle pools hand out contiguous blocks: one descriptor per (P rank, D rank) pair and
            # layer group, whatever the block sizes and TP sizes (the pools are cut to match)
            assert row["descs"] == pairs * groups, name
            if combo.mode == "push":  # one WRITE per (producer, D rank); D counts one per producer
                assert (row["write_posts"], row["notifs"]) == expected_notifs(combo), name


def test_fresh_pool_is_one_descriptor_per_rank_pair_and_group():
    """Contiguous blocks on both sides merge: identical geometry moves a request as one
    region per layer group, whatever its length; a fragmented pool costs a region per run."""
    same = next(c for c in MATRIX if c.name == "hybrid p16/d16")
    assert mapped_descs(same, 150, False, NUM_BLOCKS)[0] == 2  # full group + window group
    d_fresh, b_fresh, _ = mapped_descs(same, 150, False, NUM_BLOCKS)
    d_frag, b_frag, _ = mapped_descs(same, 150, True, NUM_BLOCKS)
    assert b_frag == b_fresh and d_frag > d_fresh
    m = preset("hybrid")
    nb, wb = L.blocks_for(150, 16), (150 - m.sliding_window) // 16
    layer_bytes = 2 * m.num_kv_heads * 16 * m.head_dim * m.dtype_bytes
    assert b_fresh == layer_bytes * (2 * nb + 2 * (nb - wb))  # window layers skip early blocks


def test_report_times_fresh_and_fragmented_writes_over_nixl():
    from tools.layout_nixl import time_writes

    combo = next(c for c in MATRIX if c.name == "small tp2->1")
    got = time_writes(combo, 150, NUM_BLOCKS, reps=1)
    assert got["nixl_fresh_descs"] == 2  # one region per P rank: contiguous blocks on both sides
    assert got["nixl_frag_descs"] == mapped_descs(combo, 150, True, NUM_BLOCKS)[0] > 2
    assert got["nixl_fresh_gbps"] > 0 and got["nixl_frag_gbps"] > 0
