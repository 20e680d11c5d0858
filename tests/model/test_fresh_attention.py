"""Whole prompts' attention through torch's fused attention (``paged.fresh_attention``, ``batched.SDPA_PROMPT_TOKENS``):
which steps are whole prompts (``step.whole_prompts``); the attention equals the paged reference for one and two
prompts, with the query heads' groups given or the keys repeated; the RoPE launch's keys and values out are those it stores, its padding rows zero;
and a small bf16 model's prompt steps through the fused layer loop give the paged kernel's logits to rounding and the
same first layer's pool bits, the prompts of a step with earlier keys, or shorter than the bound, or past a layer's window going
the paged way. The last two on the CPU under Triton's interpreter (a child process); on a GPU the kernels."""
from __future__ import annotations

import pytest
import torch

from pushkv.messages import SeqWork
from pushkv.model.kernels import paged
from pushkv.model.step import StepTensors, plan_step, whole_prompts

pytestmark = pytest.mark.unit


def _plan(seqs):
    return plan_step(seqs, 4, 8)


def test_whole_prompts_are_steps_whose_every_sequence_takes_all_its_keys_anew():
    two = _plan([SeqWork(0, tuple(range(9)), 0, (0, 1, 2)), SeqWork(1, tuple(range(5)), 0, (3, 4))])
    assert whole_prompts(two) == ((0, 9), (9, 5))
    assert StepTensors.upload(two, torch.device("cpu")).whole == ((0, 9), (9, 5))
    # a chunk after earlier keys, or a decode row beside a prompt: every sequence goes the paged way
    assert whole_prompts(_plan([SeqWork(0, tuple(range(6)), 3, (0, 1, 2))])) == ()
    assert whole_prompts(_plan([SeqWork(0, tuple(range(9)), 0, (0, 1, 2)), SeqWork(1, (7,), 5, (3, 4))])) == ()
    assert whole_prompts(_plan([SeqWork(0, (5,), 0, (0,))])) == ((0, 1),)  # a one-token prompt is one too


def test_prompt_rows_pad_to_sixteen_lengths_a_doubling_past_4k():
    """Multiples of 128 up to 4,096 rows, then 1/16 of the octave: few cuDNN plans, few extra rows."""
    assert [paged.fresh_padded(n) for n in (1, 128, 129, 2049, 4096, 4097, 8193, 33000, 65536)] == [
        128, 128, 256, 2176, 4096, 4352, 8704, 34816, 65536]
    lengths = paged.fresh_lengths(2048, 65536)
    assert len(lengths) == 81 and lengths[:2] == [2048, 2176] and lengths[-1] == 65536
    assert lengths == sorted({paged.fresh_padded(n) for n in range(2048, 65537)})
    assert all(n <= paged.fresh_padded(n) <= n * 17 / 16 and paged.fresh_padded(n) % 128 == 0
               for n in range(2048, 70000, 7))
    assert paged.fresh_lengths(2048, 8192)[-1] == 8192 and len(paged.fresh_lengths(2048, 8192)) == 33
    assert paged.fresh_lengths(2048, 2100) == [2048, 2176]  # up to the padded length of the most tokens


@pytest.mark.parametrize("repeat", [False, True])
def test_fresh_attention_equals_the_paged_reference(monkeypatch, repeat):
    monkeypatch.setattr(paged, "FRESH_REPEAT", repeat)
    monkeypatch.setattr(paged, "FRESH_PAD", 4)
    torch.manual_seed(0)
    hq, hk, d, u = 8, 2, 16, 4
    seqs = [SeqWork(0, tuple(range(11)), 0, (2, 0, 4)), SeqWork(1, tuple(range(6)), 0, (1, 3))]
    plan = _plan(seqs)
    meta = StepTensors.upload(plan, torch.device("cpu"))
    T = plan.num_tokens
    # the first prompt's 11 rows are read as 12, the 12th the second prompt's first; the second's 6 as 8, 2 zero
    rows = paged.fresh_rows(meta.whole)
    assert rows == 19
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hk, d), torch.randn(T, hk, d)
    cache = torch.full((5, 2, hk, u, d), float("nan"))
    paged.store_kv_ref(cache, k, v, meta.slots.long())
    want = paged.attention_ref(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens)
    qp, kp, vp = (torch.cat([x, torch.zeros(rows - T, *x.shape[1:])]) for x in (q, k, v))
    out = torch.full_like(q, float("nan"))
    got = paged.fresh_attention(qp, kp, vp, meta.whole, out)
    assert got is out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # one prompt: the first rows of the backend's own output, no copy into out
    one = paged.fresh_attention(qp, kp, vp, ((0, 11),), torch.full_like(q[:11], float("nan")))
    assert one.shape == (11, hq, d)
    torch.testing.assert_close(one, want[:11], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="which read 19 padded"):
        paged.fresh_attention(q, k, v, meta.whole, out)  # the second prompt's rows past the step's
    # one length a doubling: the first prompt's 11 rows read as 16, five of them the second prompt's
    monkeypatch.setattr(paged, "FRESH_STEPS", 1)
    assert paged.fresh_padded(11) == 16 and paged.fresh_rows(meta.whole) == 19
    got = paged.fresh_attention(qp, kp, vp, meta.whole, torch.full_like(q, float("nan")))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


SCRIPT = r"""
import torch
from pushkv.config import preset
from pushkv.messages import SeqWork
from pushkv.model import batched, build_model
from pushkv.model.kernels import paged, triton_fused as K
from tests.model.test_model import new_pool, prompt_of
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
paged.FRESH_PAD = 8

# the RoPE launch's keys out: the keys it stores, the queries as without them
T, Hq, Hk, D, U = 13, 4, 2, 32, 4
qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=dev).to(torch.bfloat16)
qn, kn = (torch.rand(D, device=dev) + 0.5).to(torch.bfloat16), (torch.rand(D, device=dev) + 0.5).to(torch.bfloat16)
ang = torch.arange(32, device=dev)[:, None] * (0.1 + torch.arange(D, device=dev) / D)[None, :]
cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
pos = torch.arange(T, device=dev)
slots = torch.arange(T, device=dev, dtype=torch.int32)
caches = [torch.zeros(4, 2, Hk, U, D, device=dev, dtype=torch.bfloat16) for _ in range(2)]
q0 = K.qk_norm_rope_store(qkv, Hq, Hk, D, qn, kn, 1e-6, cos, sin, pos, slots, caches[0])
q1, k1, v1 = K.qk_norm_rope_store(qkv, Hq, Hk, D, qn, kn, 1e-6, cos, sin, pos, slots, caches[1], rows_out=16)
assert q1.shape == (16, Hq, D) and k1.shape == v1.shape == (16, Hk, D)
assert torch.equal(q0, q1[:T]) and torch.equal(caches[0], caches[1])
assert torch.equal(k1[:T], caches[1][:, 0].permute(0, 2, 1, 3).reshape(-1, Hk, D)[:T])
assert torch.equal(v1[:T], caches[1][:, 1].permute(0, 2, 1, 3).reshape(-1, Hk, D)[:T])
assert not q1[T:].any() and not k1[T:].any() and not v1[T:].any()

# a small bf16 model's prompt steps: the fused attention on against off
cfg = preset("tiny", dtype="bfloat16", sliding_window=12, window_layers=(1,))
model = build_model(cfg, device=dev)
model.enable_batched(max_num_seqs=8, use_graphs=False)
fwd = model.batched
fwd.fused = True  # the fused layer loop (the CPU's default is torch's)
calls = []
real = paged.fresh_attention
def counted(*a, **k):
    calls.append(a[3])  # the prompts' (first row, length)
    return real(*a, **k)
paged.fresh_attention = counted
prompts = [SeqWork(0, tuple(prompt_of(21, seed=1)), 0, tuple(range(6))),
           SeqWork(1, tuple(prompt_of(10, seed=2)), 0, tuple(range(6, 9)))]
later = [SeqWork(0, tuple(prompt_of(7, seed=3)), 21, tuple(range(8)))]  # after the first prompt's keys
for step, bound, uses in ((prompts, 8, 1), (prompts, 11, 0), (later, 4, 0), ([prompts[1]], 4, 2)):
    out = {}
    for value in (0, bound):
        batched.SDPA_PROMPT_TOKENS = value
        pool = new_pool(model, 12, 4).to(dev)
        views = model._layer_pools(pool)
        if step is later:
            batched.SDPA_PROMPT_TOKENS = 0
            fwd.logits(prompts[:1], views)
            batched.SDPA_PROMPT_TOKENS = value
        n = len(calls)
        out[value] = (fwd.logits(step, views), pool)
        # layer 1's window (12) is shorter than the 21-token prompt, so only layer 0 takes the fused attention
        assert len(calls) - n == (uses if value else 0), (bound, len(calls) - n)
    (off, pool_off), (on, pool_on) = out[0], out[bound]
    torch.testing.assert_close(on, off, atol=3e-2, rtol=3e-2)
    assert torch.equal(on.argmax(-1), off.argmax(-1))
    # the first layer's keys and values come before any attention (a later layer's from rounded rows)
    assert torch.equal(pool_on[:, 0].nan_to_num(7.0), pool_off[:, 0].nan_to_num(7.0)), "the pool differs"
    if uses:
        assert calls[-1] == tuple((s, len(w.token_ids)) for s, w in zip((0, 21), step)) or len(step) == 1
# the start-up warm-up: one call a padded length from the bound up to the step's most tokens, on CUDA only
batched.SDPA_PROMPT_TOKENS = 8
n = len(calls)
took = fwd.warm_fresh(30)
assert [c[0][1] for c in calls[n:]] == ([8, 16, 24, 32] if dev == "cuda" else []), calls[n:]
assert (took > 0) == (dev == "cuda")
print("ok", dev, len(calls))
"""


def test_fused_layers_take_whole_prompts_through_the_fused_attention():
    from tests.model.kernel_script import run_kernel_script

    pytest.importorskip("triton")
    run_kernel_script(SCRIPT, timeout_s=600)
