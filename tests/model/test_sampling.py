"""pushkv.model.sampling: pure, batched, defined by the request (seed, output index)."""
from collections import Counter

import numpy as np
import pytest
import torch

from pushkv.messages import SamplingParams, SeqWork
from pushkv.model.sampling import sample
from pushkv.seeds import derive_seed, uniform

V = 50


def seq(p=None, index=0, history=(), suppress=(), seen=()):
    packed = np.asarray(seen, dtype="<i4").tobytes()  # SeqWork.seen: the scheduler packs the ids
    return SeqWork(0, (1,), 0, (0,), sampling=p, output_index=index, history=history, suppress=suppress, seen=packed)


def logits(rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2


def test_all_greedy_is_argmax():
    x = logits(4)
    assert sample(x, [seq()] * 4).tokens == x.argmax(-1).tolist()
    assert sample(x, [seq(SamplingParams(temperature=0.0))] * 4).logprobs == ()


def test_rows_must_match_seqs():
    with pytest.raises(ValueError, match="3 logits rows for 2"):
        sample(logits(3), [seq()] * 2)


def test_uniform_is_a_pure_function_in_the_open_interval():
    us = [uniform(s, i) for s in range(50) for i in range(50)]
    assert all(0 < u < 1 for u in us)
    assert len(set(us)) > 2400  # 24-bit draws: a few collisions at most
    assert uniform(7, 3) == uniform(7, 3) and uniform(7, 3) != uniform(7, 4)
    assert uniform(-1, 0) == uniform((1 << 64) - 1, 0)  # seeds are taken mod 2**64
    assert derive_seed(9, 0) == 9 and derive_seed(9, 1) != derive_seed(9, 2)


def test_seeded_draw_does_not_depend_on_batch_or_row():
    x = logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(x, [seq(p, index=5)]).tokens[0]
    batch = torch.cat([logits(3, seed=4), x, logits(2, seed=5)])
    others = [seq(SamplingParams(temperature=0.7, seed=s, top_p=0.9), index=s) for s in range(5)]
    seqs = others[:3] + [seq(p, index=5)] + others[3:]
    assert sample(batch, seqs).tokens[3] == alone


def test_temperature_one_follows_softmax():
    x = logits(1, seed=11)
    probs = torch.softmax(x[0], -1)
    n = 4000
    draws = Counter(sample(x, [seq(SamplingParams(temperature=1.0, seed=s))]).tokens[0] for s in range(n))
    # total variation distance between the empirical and the model distribution
    tv = 0.5 * sum(abs(draws.get(t, 0) / n - probs[t].item()) for t in range(V))
    assert tv < 0.06, tv
    assert len(draws) > 10


def test_low_temperature_is_nearly_greedy_and_high_is_spread():
    x = logits(1, seed=12)
    cold = {sample(x, [seq(SamplingParams(temperature=0.01, seed=s))]).tokens[0] for s in range(200)}
    assert cold == {int(x.argmax())}
    hot = {sample(x, [seq(SamplingParams(temperature=5.0, seed=s))]).tokens[0] for s in range(200)}
    assert len(hot) > 25


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_keeps_only_the_k_most_likely(k):
    x = logits(2, seed=13)
    allowed = set(x[0].topk(k).indices.tolist())
    ps = [SamplingParams(temperature=2.0, top_k=k, seed=s) for s in range(300)]
    got = {sample(x, [seq(p), seq(SamplingParams(temperature=2.0, seed=p.seed))]).tokens[0] for p in ps}
    assert got <= allowed and (len(got) == k or k > 3)
    assert len(got) >= min(k, 3)


def test_top_p_keeps_the_nucleus():
    x = logits(1, seed=14)
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, []
    for t in order:
        nucleus.append(t)
        mass += probs[t].item()
        if mass >= 0.6:
            break
    got = {sample(x, [seq(SamplingParams(temperature=1.0, top_p=0.6, seed=s))]).tokens[0] for s in range(400)}
    assert got <= set(nucleus) and len(got) == len(nucleus)
    tiny = {sample(x, [seq(SamplingParams(temperature=1.0, top_p=1e-6, seed=s))]).tokens[0] for s in range(50)}
    assert tiny == {order[0]}


def test_min_p_drops_the_unlikely():
    x = logits(1, seed=15)
    probs = torch.softmax(x[0], -1)
    allowed = {t for t in range(V) if probs[t] >= 0.2 * probs.max()}
    got = {sample(x, [seq(SamplingParams(temperature=1.0, min_p=0.2, seed=s))]).tokens[0] for s in range(300)}
    assert got <= allowed and len(got) == len(allowed)


def test_logit_bias_suppress_and_penalties():
    x = logits(1, seed=16)
    best = int(x.argmax())
    assert sample(x, [seq(SamplingParams(logit_bias=((7, 100.0),)))]).tokens == [7]
    second = int(x[0].topk(2).indices[1])
    assert sample(x, [seq(suppress=(best,))]).tokens == [second]
    # a frequency penalty grows with the count; presence counts once
    gap = (x[0, best] - x[0, second]).item()
    pen = SamplingParams(frequency_penalty=gap / 2 + 0.01)
    assert sample(x, [seq(pen, history=(best,))]).tokens == [best]
    assert sample(x, [seq(pen, history=(best, best))]).tokens == [second]
    pres = SamplingParams(presence_penalty=gap + 0.01)
    assert sample(x, [seq(pres, history=(best,))]).tokens == [second]
    assert sample(x, [seq(pres, history=(second,))]).tokens == [best]  # only what was generated


def test_allowed_token_ids_keep_only_their_own_logits():
    two = logits(2, seed=18)
    x = two[:1]
    allowed = (3, 11, 40)
    top = int(x[0].argmax())
    assert top not in allowed
    best = max(allowed, key=lambda t: float(x[0, t]))
    only = SamplingParams(allowed_token_ids=allowed)
    assert sample(two, [seq(only), seq()]).tokens == [best, int(two[1].argmax())]  # the other row untouched
    # edits apply before the restriction: a bias moves the choice within the set, never out of it
    low = min(allowed, key=lambda t: float(x[0, t]))
    biased = SamplingParams(allowed_token_ids=allowed, logit_bias=((low, 100.0), (top, 100.0)))
    assert sample(x, [seq(biased)]).tokens == [low]
    # suppression (stop ids before min_tokens, a bad word's next token) still applies inside the set
    assert sample(x, [seq(only, suppress=(best,))]).tokens[0] in set(allowed) - {best}
    drawn = {sample(x, [seq(SamplingParams(temperature=5.0, seed=s, allowed_token_ids=allowed))]).tokens[0]
             for s in range(200)}
    assert drawn == set(allowed)
    # the logprobs stay the raw distribution's, as vLLM reports them
    lp = sample(x, [seq(SamplingParams(allowed_token_ids=allowed, logprobs=1))]).logprobs[0]
    assert abs(lp.logprob - float(torch.log_softmax(x[0], -1)[best])) < 1e-5


def test_repetition_penalty_divides_positive_logits_and_multiplies_the_rest_of_the_seen_ids():
    """transformers' and vLLM's: over the prompt's and output's distinct ids, after logit_bias and before the
    presence / frequency penalties and the temperature; the draw follows the edited row, the logprobs stay raw."""
    x = logits(1, seed=21)
    seen = tuple(sorted({int(i) for i in x[0].topk(2).indices} | {int(x[0].argmin())}))
    p = 1.7
    want = x[0].clone()
    at = torch.tensor(seen)
    want[at] = torch.where(want[at] > 0, want[at] / p, want[at] * p)
    assert sample(x, [seq(SamplingParams(repetition_penalty=p), seen=seen)]).tokens == [int(want.argmax())]
    assert int(want.argmax()) != int(x[0].argmax())  # the penalty moved the choice
    # after the bias: a biased seen id is penalised with its bias
    top = int(x[0].argmax())
    biased = SamplingParams(repetition_penalty=p, logit_bias=((top, 10.0),))
    assert sample(x, [seq(biased, seen=seen)]).tokens == [top if (x[0, top] + 10) / p > want.max() else
                                                         int(want.argmax())]
    # the same draw as the edited row's, seeded, and nothing without seen ids (off: 1.0)
    for s in range(20):
        hot = SamplingParams(temperature=0.8, seed=s, repetition_penalty=p)
        assert sample(x, [seq(hot, index=3, seen=seen)]).tokens == sample(want[None].clone(), [
            seq(SamplingParams(temperature=0.8, seed=s), index=3)]).tokens
    assert sample(x, [seq(SamplingParams(repetition_penalty=p))]).tokens == [top]
    lp = sample(x, [seq(SamplingParams(repetition_penalty=p, logprobs=0), seen=seen)]).logprobs[0]
    assert abs(lp.logprob - float(torch.log_softmax(x[0], -1)[int(want.argmax())])) < 1e-5


def test_logprobs_are_the_raw_distribution():
    x = logits(3, seed=17)
    ps = [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=1.0, seed=2, logprobs=3)]
    out = sample(x, [seq(p) for p in ps])
    ref = torch.log_softmax(x, -1)
    assert out.logprobs[1] is None
    a, c = out.logprobs[0], out.logprobs[2]
    assert a.top_ids == () and a.logprob == pytest.approx(ref[0, out.tokens[0]].item(), abs=1e-5)
    assert c.logprob == pytest.approx(ref[2, out.tokens[2]].item(), abs=1e-5)
    assert list(c.top_ids) == ref[2].topk(3).indices.tolist()
    assert list(c.top_logprobs) == pytest.approx(ref[2].topk(3).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])
def test_window_filter_equals_whole_sort(spread):
    """The top-WINDOW shortcut draws exactly what sorting the whole row would, or hands the row on."""
    from pushkv.model import sampling as S

    g = torch.Generator().manual_seed(int(spread * 10))
    x = torch.randn(24, 5000, generator=g) * spread
    ps = [SamplingParams(temperature=1.0, top_p=tp, min_p=mp, top_k=k, seed=i)
          for i, (tp, mp, k) in enumerate([(0.9, 0, 0), (0.5, 0, 0), (1.0, 0.05, 0), (0.95, 0.01, 0),
                                           (0.8, 0, 40), (1.0, 0.2, 3000)] * 4)]
    rows = S._Rows()
    plan = S._draw_plan(ps, [seq(p) for p in ps], x.shape[1], rows)
    t = rows.upload(x.device)
    mask = t["mask"].view(-1, 3)
    assert t["u"].tolist() == torch.tensor([uniform(p.seed, 0) for p in ps]).tolist()
    got, spill = S._draw_window(x, plan, mask, t["has_k"], t["u"])
    whole = S._draw_sorted(x, mask, t["has_k"], t["u"])
    fit = [i for i in range(len(ps)) if i not in spill]
    assert fit and got[fit].tolist() == whole[fit].tolist()
    full = sample(x, [seq(p) for p in ps]).tokens  # spilled rows go the sorted way
    assert full == whole.tolist()
    if spread == 0.5:
        assert spill  # a flat distribution's nucleus is wider than the window


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_edits_on_cuda_draw_what_the_cpu_draws():
    """allowed_token_ids, repetition_penalty, a structured-output mask and suppression, greedy and seeded, at
    Qwen3's vocabulary: the GPU sampler (the Triton kernel after the edits) draws the CPU's tokens."""
    vocab = 151936
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, vocab, generator=g) * 3
    words = (vocab + 31) // 32
    mask = np.zeros(words, dtype="<i4")
    for t in (17, 4000, 151000, 99):
        mask[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))
    seen = tuple(int(i) for i in x[1].topk(50).indices)
    rows = [
        seq(SamplingParams(allowed_token_ids=(3, 77, 150000))),
        seq(SamplingParams(repetition_penalty=1.3), seen=seen),
        SeqWork(0, (1,), 0, (0,), token_mask=mask.tobytes()),
        seq(SamplingParams(temperature=0.9, seed=7, allowed_token_ids=(3, 77, 150000))),
        seq(SamplingParams(temperature=0.8, seed=9, repetition_penalty=1.2), index=4, seen=seen),
        SeqWork(0, (1,), 0, (0,), sampling=SamplingParams(temperature=1.0, seed=3), token_mask=mask.tobytes(),
                suppress=(17,)),
    ]
    cpu, gpu = sample(x, rows).tokens, sample(x.cuda(), rows).tokens
    assert cpu == gpu
    assert cpu[0] in (3, 77, 150000) and cpu[2] in (17, 4000, 151000, 99) and cpu[5] in (4000, 151000, 99)
