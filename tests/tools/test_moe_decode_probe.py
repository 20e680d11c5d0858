"""experiments/moe_decode_probe.py's bookkeeping, on the CPU: what a GPU run of it decides from.

A variant is a set of module switches, and Python lets a misspelt one be assigned without a word. A
variant that set ``triton_moe.PREFETCH_OWN_TOKEN`` would then time the shipped step under another
name. So each switch a variant sets must already exist and take the variant's value; the variant
called shipped must leave every switch as the code ships it; every variant a list or ``gpu_run.sh``
names must exist; and the report and the plot must come out of a saved run."""
from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("triton")

from experiments import moe_decode_probe as probe  # noqa: E402
from pushkv.model import batched  # noqa: E402
from pushkv.model.kernels import (  # noqa: E402
    chain,
    triton_fused,
    triton_gemv,
    triton_moe,
    triton_moe_decode,
    triton_moe_token,
    triton_paged,
)

MODULES = (batched, chain, triton_fused, triton_gemv, triton_moe, triton_moe_decode, triton_moe_token, triton_paged)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Forward:
    """The part of BatchedForward a variant touches: its captured graphs, dropped."""

    def __init__(self):
        self.dropped = 0

    def drop_graphs(self):
        self.dropped += 1


def _switches() -> dict[tuple[str, str], object]:
    """Every upper-case module constant of the decode path, with its value now."""
    return {(m.__name__, k): v for m in MODULES for k, v in vars(m).items() if k.isupper()}


class _Driver:
    """cuda_driver.persisting_l2 on a made-up device whose most is 30 MiB: the set-aside each call asked for."""

    MOST = 30 << 20

    def __init__(self):
        self.now = 0

    def persisting_l2(self, nbytes=None):
        if nbytes is not None:
            self.now = max(0, min(nbytes, self.MOST))
        return self.now, self.MOST


@pytest.fixture
def restored(monkeypatch):
    """Every switch (and PUSHKV_MOE_DECODE) put back as it was after the test; a GPU's driver made up."""
    for m in MODULES:
        for k, v in list(vars(m).items()):
            if k.isupper():
                monkeypatch.setattr(m, k, v)
    monkeypatch.delenv("PUSHKV_MOE_DECODE", raising=False)
    driver = _Driver()
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe.cuda_driver, "persisting_l2", driver.persisting_l2)
    fwd = _Forward()
    fwd.driver = driver
    return fwd


def _read(driver: _Driver) -> probe.Flags:
    """The switches as the modules and the device hold them, read back field by field (the mapping set_variant
    writes)."""
    return probe.Flags(chain.ON, batched.ROUTER_IN_NORM_TOKENS, os.environ["PUSHKV_MOE_DECODE"], batched.GEMV_TOKENS,
                       triton_gemv.COLUMNS, triton_moe.SELF_ROUTE_ONE_TOKEN, triton_paged.FUSED_MERGE,
                       triton_moe.DOWN_GEMV_TOKENS, triton_moe.DOWN_GEMV_COLUMNS, triton_moe.PREFETCH_DOWN_TOKENS,
                       triton_moe_decode.ONE_LAUNCH, triton_moe_decode.PREFETCH_DOWN, batched.AHEAD_TOKENS,
                       batched.AHEAD, triton_moe.PREFETCH_OWN_TOKENS, triton_moe_decode.PREFETCH_OWN,
                       triton_paged.PREFETCH_KV, driver.now == driver.MOST, triton_moe.PERSISTENT_ONE_TOKEN,
                       triton_moe_token.PER_SM, triton_fused.ROUTER_EARLY, chain.EARLY_NEXT,
                       triton_moe.ROUTE_ONE_TOKEN, triton_moe.ONE_TOKEN_TILES, triton_moe.ROWS_ONE_TOKEN,
                       triton_moe.DOWN_ROWS_ONE_TOKEN, triton_moe.ROWS, triton_moe.ROWS_WARPS, triton_moe.DOWN_ROWS,
                       triton_moe.DOWN_ROWS_WARPS, triton_moe.ROWS_TOKENS, triton_moe.ROUTE_FEW_TOKENS,
                       triton_moe.ROUTE_FEW_WARPS, _copies())


def _copies() -> int:
    """A replay's copies of its step arrays as the switches stand: 7 (the probe's old run), 1 (the table staged at
    a small graph's width) or 2."""
    if batched._DecodeGraph.run is probe.SEVEN_COPIES_RUN:
        return 7
    return 1 if batched.ONE_COPY_ENTRIES == probe.ONE_COPY_ENTRIES > 0 else 2


def test_every_variant_sets_existing_switches_to_its_values(restored):
    before = set(_switches())
    for name, flags in probe.VARIANTS.items():
        set_aside = probe.set_variant(restored, name)
        assert _read(restored.driver) == flags, name
        assert set_aside == (_Driver.MOST if flags.l2_set_aside else 0), name  # and none left by the last
        assert set(_switches()) == before, f"{name} made a switch that no code reads"
    assert restored.dropped == len(probe.VARIANTS)  # each re-captures its graphs
    assert probe.VARIANTS[name].l2_set_aside and probe.set_variant(restored, "gemv1_2") == 0  # taken back


def test_the_shipped_variant_is_what_the_code_ships(restored):
    from pushkv import envs

    shipped = _switches()
    assert probe.set_variant(restored, "gemv1_2") == 0  # no L2 set aside, as a worker leaves it
    assert _switches() == shipped
    assert os.environ["PUSHKV_MOE_DECODE"] == envs.get("PUSHKV_MOE_DECODE", {})
    assert probe.VARIANTS["gemv1_2"] == probe.SHIPPED


def test_every_named_variant_exists():
    names = set(probe.VARIANTS)
    assert {n for pair in probe.PAIRS for n in pair} <= names
    assert set(probe.PROFILED) <= names
    for name, flags in probe.VARIANTS.items():
        assert flags.ahead <= batched.AHEAD_PLACES, name
        assert flags.moe_decode in ("grouped", "ungrouped"), name
    with open(os.path.join(ROOT, "experiments", "gpu_run.sh")) as f:
        script = f.read()
    lists = re.findall(r"--variants (?:\$\{AHEAD_VARIANTS:-)?([\w,]+)", script)
    assert len(lists) >= 2  # moeahead's and denseahead's
    for names_given in lists:
        assert set(names_given.split(",")) <= names, names_given


def test_ahead_places_follow_the_switches_and_refuse_a_misspelt_one(restored, monkeypatch):
    monkeypatch.setattr(batched, "AHEAD_TOKENS", 8)
    monkeypatch.setattr(batched, "AHEAD", frozenset({"o", "qkv_sum"}))
    assert batched.ahead_places(1, 1) == {"o", "qkv_sum"}
    assert batched.ahead_places(8, 1) == {"o", "qkv_sum"}
    assert batched.ahead_places(9, 1) == frozenset()  # past AHEAD_TOKENS
    assert batched.ahead_places(1, 2) == frozenset()  # under TP
    assert batched.ahead_places(0, 1) == frozenset()  # a step of no decode rows
    monkeypatch.setattr(batched, "AHEAD", frozenset({"o", "qkv_rout"}))
    with pytest.raises(ValueError, match="qkv_rout"):
        batched.ahead_places(1, 1)


def _saved_run(names: list[str]) -> dict:
    rows = []
    for batch, bound in ((1, 1.43), (8, 6.1)):
        row: dict = {"batch": batch, "bound_ms": bound, "chained_same_bits": True}
        for i, n in enumerate(names):
            row[n] = {"ms": bound * (2.0 - 0.01 * i)}
        for a, b in probe.PAIRS:
            if a in names and b in names:
                row[f"{a}_vs_{b}"] = {"max_abs": 0.0, "argmax_agree": 1.0}
        rows.append(row)
    profile = {"gemv1_2": {"kernel_us_a_layer": [{"us": 18.6, "kernel": "_gate_up_kernel"}],
                           "busy_us_a_layer": 60.0, "span_us_a_layer": 61.9}}
    return {"gpu": "NVIDIA H200", "model": "qwen3-30b-a3b", "copy_GBps": 4291.0, "ctx": 512, "variants": names,
            "rows": rows, "profile": profile}


def test_report_ranks_each_batch_against_the_shipped_step_and_plots(tmp_path):
    names = ["gemv1_2", "prefetch_down", "one_launch", "ungrouped1", "own_all_kv"]
    rep = _saved_run(names)
    text = probe.markdown(rep)
    # the last named is the fastest in this made-up run, and the shipped step the slowest
    assert "Batch 1, fastest first (against the shipped gemv1_2, 2.860 ms): own_all_kv 2.803 (-2.0 %)" in text
    assert text.count("fastest first") == 2
    assert "| one_launch against ungrouped1 | 0, 100% | 0, 100% |" in text
    assert "Batch-1 graph replay, gemv1_2: 61.9 us a layer" in text
    pytest.importorskip("matplotlib")
    saved = tmp_path / "moe_decode.json"
    saved.write_text(json.dumps(rep))
    probe.plot(json.loads(saved.read_text()), str(tmp_path / "moe_decode.png"))
    png = (tmp_path / "moe_decode.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_refused_set_aside_is_said_and_the_run_goes_on(restored, monkeypatch, capsys):
    def refuse(nbytes=None):
        raise probe.cuda_driver.DriverError("cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE) error 1")

    monkeypatch.setattr(probe.cuda_driver, "persisting_l2", refuse)
    assert probe.set_variant(restored, "own_all_l2") == -1
    assert "own_all_l2: the L2 set-aside was refused" in capsys.readouterr().out
    assert probe.set_variant(restored, "gemv1_2") == 0


def test_the_swept_variants_take_the_sweeps_best_one_token_tiles_and_leave_the_rest_as_shipped():
    rows = [{"tokens": 1, "kernel": "gate_up", "tile": [32, 128, 4, 4], "us": 17.0},
            {"tokens": 1, "kernel": "gate_up", "tile": [64, 128, 4, 5], "us": 18.0},
            {"tokens": 1, "kernel": "down", "tile": [128, 64, 8, 3], "us": 9.0},
            {"tokens": 1, "kernel": "down", "tile": [64, 128, 2, 3], "us": 9.5},
            {"tokens": 8, "kernel": "down", "tile": [16, 64, 2, 3], "us": 1.0}]  # another count: not taken
    shipped = triton_moe.tiles_for(1)
    v = probe.swept_variants(rows)
    both, up, down = (v[n].one_token_tiles for n in ("swept_1", "swept_up", "swept_down"))
    assert (both.bm, both.bn_up, both.bk, both.warps, both.stages) == (shipped.bm, 32, 128, 4, 4)
    assert (both.bn_down, both.bk_down, both.down_warps, both.down_stages) == (128, 64, 8, 3)
    assert (up.bn_up, up.bn_down, up.bk_down, up.down_warps) == (32, shipped.bn_down, shipped.bk_down,
                                                                   shipped.down_warps)
    assert (down.bn_up, down.bk, down.bn_down) == (shipped.bn_up, shipped.bk, 128)
    # a variant sets the switch, and the shipped variant leaves it unset
    before = triton_moe.ONE_TOKEN_TILES
    try:
        probe.VARIANTS.update(v)
        probe.set_variant(_Forward(), "swept_1")
        assert triton_moe.tiles_for(1) == both and triton_moe.tiles_for(2) == triton_moe.tiles_for(8)
        probe.set_variant(_Forward(), "gemv1_2")
        assert triton_moe.tiles_for(1) == shipped
    finally:
        for n in v:
            probe.VARIANTS.pop(n)
        triton_moe.ONE_TOKEN_TILES = before
