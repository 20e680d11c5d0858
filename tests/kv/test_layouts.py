"""Pool layouts (layer groups, planes) and the launch-time geometry check: pure
tables, plus `pushkv up` refusing a bad combination before starting anything."""
from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch

from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc
from pushkv.supervisor.geometry import check_deployment



def lay(layers=4, wl=(), window=0, planes=2, heads=2, bs=4, hd=3, nb=5, sub=0, hg=0):
    return KVLayoutDesc(num_blocks=nb, num_layers=layers, block_size=bs, kv_heads=heads, head_start=0,
                        total_kv_heads=heads, head_dim=hd, dtype_bytes=4, window_layers=wl, window=window,
                        kv_planes=planes, sub_block=sub, head_group=hg)


@pytest.mark.parametrize("kw,groups,shape6", [
    (dict(), ((0, 1, 2, 3),), True),
    (dict(wl=(0, 2), window=8), ((1, 3), (0, 2)), False),  # full group first
    (dict(wl=(0, 1, 2, 3), window=8), ((0, 1, 2, 3),), True),  # all windowed: one group
    (dict(wl=(1,), window=0), ((0, 1, 2, 3),), True),  # window 0: no window layers
    (dict(planes=1, heads=1), ((0, 1, 2, 3),), True),  # MLA-style latent
])
def test_layer_groups_and_shape(kw, groups, shape6):
    lo = lay(**kw)
    assert L.layer_groups(lo) == groups
    assert (len(L.pool_shape(lo)) == 6) == shape6
    assert L.pool_bytes(lo) == lo.num_blocks * lo.num_layers * lo.kv_planes * lo.kv_heads * lo.block_size \
        * lo.head_dim * 4


@pytest.mark.parametrize("kw", [dict(), dict(wl=(0, 2), window=8), dict(wl=(3,), window=8),
                                dict(planes=1, heads=1, wl=(1, 2), window=8), dict(sub=2), dict(hg=1),
                                dict(sub=1, hg=1, wl=(0,), window=8)])
def test_layer_views_agree_with_offset(kw):
    """Every element the per-layer views address sits at layout.offset, each exactly once."""
    lo = lay(**kw)
    flat = torch.zeros(L.pool_bytes(lo) // 4, dtype=torch.int32)
    pool = flat.view(L.pool_shape(lo))
    for layer, v in enumerate(L.layer_views(pool, lo)):
        if v.dim() == 6:  # head groups: [subs, planes, groups, group heads, sub_block, dim]
            assert v.shape[2:4] == (L.head_groups(lo), L.group_heads(lo))
            v = v.flatten(2, 3)  # a copy: write through the 6-d view below
        assert v.shape == (L.phys_blocks(lo), lo.kv_planes, lo.kv_heads, L.unit(lo), lo.head_dim)
        view6 = L.layer_views(pool, lo)[layer]
        for b in range(L.phys_blocks(lo)):
            for k in range(lo.kv_planes):
                for h in range(lo.kv_heads):
                    for t in range(L.unit(lo)):
                        off = L.offset(lo, b, layer, k, h, t) // 4
                        row = torch.arange(off, off + lo.head_dim, dtype=torch.int32) + 1
                        if view6.dim() == 6:
                            g, hh = divmod(h, L.group_heads(lo))
                            view6[b, k, g, hh, t] += row
                        else:
                            view6[b, k, h, t] += row
    assert torch.equal(flat, torch.arange(flat.numel(), dtype=torch.int32) + 1)


def test_window_group_is_contiguous_per_block_run():
    lo = lay(wl=(0, 2), window=8)
    base, stride, _ = L.layer_place(lo, 0)  # first window layer
    assert base == L.region_base(lo, 1) and stride == L.region_block_bytes(lo, 1) == 2 * L.layer_bytes(lo)
    assert L.offset(lo, 3, 2) + L.layer_bytes(lo) == L.offset(lo, 4, 0)  # block 3's last -> block 4's first


# ---------------------------------------------------------------------- launch-time geometry
def dep(model="small", mode="push", p_tp=1, d_tp=1, p_bs=16, d_bs=16, **model_kw):
    return DeploymentConfig(mode=mode, model=preset(model, **model_kw),
                            prefill=InstanceConfig(role="prefill", tp=p_tp, block_size=p_bs),
                            decode=InstanceConfig(role="decode", tp=d_tp, block_size=d_bs),
                            local=InstanceConfig(role="local", tp=p_tp, block_size=p_bs))


ACCEPTED = [
    dep(p_bs=16, d_bs=32), dep(p_bs=32, d_bs=16), dep(p_bs=16, d_bs=24), dep(p_bs=1, d_bs=256),
    dep(p_tp=1, d_tp=2), dep(p_tp=2, d_tp=1), dep(p_tp=2, d_tp=4), dep(p_tp=4, d_tp=2), dep(p_tp=8, d_tp=8),
    dep("tiny", p_tp=4, d_tp=2), dep("tiny", p_tp=1, d_tp=4),  # more ranks than the 2 KV heads
    dep("hybrid", p_tp=2, d_tp=1, p_bs=16, d_bs=48), dep("mla", p_tp=4, d_tp=2, p_bs=32, d_bs=16),
    dep(mode="local", p_tp=4), dep(mode="pull", p_tp=2, d_tp=4, d_bs=8),
]


@pytest.mark.parametrize("cfg", ACCEPTED)
def test_supported_combinations_pass(cfg):
    check_deployment(cfg)


REFUSED = [
    (dep(p_tp=3), "prefill instance: tp=3 cannot shard model 'small': num_heads=8 is not divisible by tp_size=3"),
    (dep(d_tp=16), "decode instance: tp=16 cannot shard model 'small': num_heads=8"),
    (dep("tiny", d_tp=8), "decode instance: tp=8 cannot shard model 'tiny'"),
    (dep(num_kv_heads=8, num_heads=24, intermediate_size=768, p_tp=3), "num_kv_heads=8 is not divisible by tp_size=3"),
    (dep(num_heads=12, num_kv_heads=3, intermediate_size=768, d_tp=4), "tp_size=4 > num_kv_heads=3 needs"),
    (dep(intermediate_size=770, d_tp=4), "intermediate_size=770 is not divisible by tp_size=4"),
    (dep(d_bs=0), "decode instance: block_size must be >= 1, got 0"),
    (dep(p_bs=16, d_bs=18), "prefill block_size 16 and decode block_size 18 share sub-blocks of only 2"),
    (dep(p_bs=5, d_bs=7), "share sub-blocks of only 1 token(s)"),
    (dep(mode="local", p_tp=0), "local instance: tp must be >= 1"),
    (dep(sliding_window=0, window_layers=(1,)), "window_layers [1] given but sliding_window is 0"),
    (dep(sliding_window=8, window_layers=(9,)), "window_layers [9] outside num_layers=4"),
    (dep(head_dim=15), "RoPE dims (15) must be even"),
    (dep(dtype="int8"), "dtype 'int8' unsupported"),
    (dep("mla", checkpoint="/x"), "MLA-style models run on random weights, or from a DeepSeek-V2/V3 checkpoint"),
]


@pytest.mark.parametrize("cfg,msg", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_unsupported_combinations_refused_with_reason(cfg, msg):
    with pytest.raises(ValueError) as e:
        check_deployment(cfg)
    assert msg in str(e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,msg", [
    (("--prefill-tp", "3"), "prefill instance: tp=3 cannot shard model 'small'"),
    (("--model", "tiny", "--decode-tp", "8", "--prefill-tp", "4"), "decode instance: tp=8"),
    (("--decode-block-size", "-4"), "decode instance: block_size must be >= 1"),
    (("--max-num-seqs", "0"), "instance: max_num_seqs (--max-num-seqs) must be >= 1, got 0"),  # it hung every request
    (("--max-batch-tokens", "0"), "instance: max_batch_tokens (--max-batch-tokens) must be >= 1"),
    (("--max-num-batched-tokens", "16", "--max-num-seqs", "32"),  # vLLM's SchedulerConfig refuses it
     "(16) must be greater than or equal to max_num_seqs (--max-num-seqs) (32)"),
])
def test_pushkv_up_refuses_before_starting_anything(tmp_path, flags, msg):
    env = dict(os.environ, PUSHKV_REGISTRY_DIR=str(tmp_path / "reg"))
    r = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--port", "1", *flags], env=env,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    assert "bad configuration" in r.stderr and msg in r.stderr
    assert r.stdout == ""  # no router URL, no READY
    assert not (tmp_path / "reg").exists() or not os.listdir(tmp_path / "reg")  # no deployment registered


def test_config_roundtrip_keeps_new_model_fields():
    cfg = dep("mla")
    back = msgspec.json.decode(msgspec.json.encode(cfg), type=DeploymentConfig)
    assert back.model.kv_lora_rank == 64 and back.model.kv_planes == 1


@pytest.mark.parametrize("model,p_tp,d_tp,p_bs,d_bs,expected", [
    ("small", 1, 1, 16, 16, (16, 4)),
    ("small", 1, 1, 16, 32, (16, 4)),  # D cuts its 32-token blocks into two sub-blocks
    ("small", 1, 1, 32, 16, (16, 4)),
    ("small", 1, 1, 16, 24, (8, 4)),
    ("small", 2, 1, 16, 16, (16, 2)),  # D holds 4 heads as two groups of P's 2
    ("small", 1, 2, 16, 16, (16, 2)),
    ("small", 2, 4, 16, 16, (16, 1)),
    ("tiny", 4, 2, 16, 32, (16, 1)),  # replicated: one head per rank
    ("mla", 2, 2, 16, 32, (16, 1)),
])
def test_transfer_geometry(model, p_tp, d_tp, p_bs, d_bs, expected):
    cfg = dep(model, p_tp=p_tp, d_tp=d_tp, p_bs=p_bs, d_bs=d_bs)
    assert L.transfer_geometry(cfg) == expected
    for inst in (cfg.prefill, cfg.decode):
        lo = L.instance_layout(cfg, inst, 0)
        assert L.unit(lo) == expected[0] and L.group_heads(lo) == min(expected[1], lo.kv_heads)
        assert L.pool_bytes(lo) == inst.num_blocks * inst.block_size * preset(model).kv_bytes_per_token() // (
            inst.tp if preset(model).cache_kv_heads >= inst.tp else preset(model).cache_kv_heads)
    local = L.instance_layout(msgspec.structs.replace(cfg, mode="local"), cfg.local, 0)
    assert (local.sub_block, local.head_group) == (0, 0)  # nothing to match: one region
