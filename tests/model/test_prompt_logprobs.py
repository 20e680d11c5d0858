"""Prompt logprobs where the prompt is computed: the pure pieces (which rows a step scores, the
log-softmax, rank and top-N of a slice of rows, the wire's packing and joining) as tables, then
both engines against a direct torch computation (log_softmax of the dense reference's logits at
every position), whole and in chunks, and against transformers' own float32 logits."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pushkv import prompt_logprobs as PL
from pushkv.config import preset
from pushkv.messages import PromptLogprobs, SeqWork
from pushkv.model import build_model, scoring
from pushkv.model.reference import prompt_logits
from tests.model.test_model import new_pool, prompt_of

ATOL = 1e-4


# ----------------------------------------------------------------- which rows a step scores
def _w(tokens, start=0, score=-1, nxt=-1, sample=True) -> SeqWork:
    return SeqWork(0, tuple(tokens), start, (0,), sample=sample, score_prompt=score, next_prompt_token=nxt)


@pytest.mark.parametrize("seqs, rows, targets, per_seq", [
    ([_w([5, 6, 7])], [], [], []),  # nothing asked: nothing kept
    ([_w([5, 6, 7], score=2)], [0, 1], [6, 7], [(1, 2, 2)]),  # the prompt's end: its last row samples
    ([_w([5, 6, 7], score=0, nxt=8, sample=False)], [0, 1, 2], [6, 7, 8], [(1, 3, 0)]),  # a chunk: the next token too
    ([_w([9], start=4, score=1)], [], [], [(5, 0, 1)]),  # a last chunk of one token scores nothing
    ([_w([1], start=9), _w([5, 6], start=3, score=3, nxt=7, sample=False), _w([2, 3, 4], score=1)],
     [1, 2, 3, 4], [6, 7, 3, 4], [(4, 2, 3), (1, 2, 1)]),  # packed after a decode, two prompts
])
def test_score_plan(seqs, rows, targets, per_seq):
    p = scoring.plan(seqs)
    assert (p.rows, p.targets, p.seqs) == (rows, targets, per_seq)
    assert scoring.rows(seqs) == rows


# ------------------------------------------------------------------ log-softmax, rank, top-N
def _naive(logits: torch.Tensor, targets: list[int], k: int) -> list[PL.Position]:
    lp = torch.log_softmax(logits.double(), -1)
    out = []
    for row, t in zip(lp, targets):
        order = sorted(range(row.shape[0]), key=lambda i: -float(row[i]))[:k]
        out.append(PL.Position(float(row[t]), sum(1 for v in row if v >= row[t]), tuple(order),
                               tuple(float(row[i]) for i in order)))
    return out


def _close(got: list[PL.Position], want: list[PL.Position]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=ATOL)
        assert (g.rank, g.top_ids) == (w.rank, w.top_ids)
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=ATOL)


@pytest.mark.parametrize("slice_rows", [512, 3, 1])
def test_score_equals_a_naive_log_softmax(monkeypatch, slice_rows):
    monkeypatch.setattr(scoring, "SLICE_ROWS", slice_rows)
    g = torch.Generator().manual_seed(3)
    head_w = torch.randn(50, 8, generator=g)
    hidden = torch.randn(7, 8, generator=g)
    p = scoring.ScorePlan(list(range(7)), [3, 0, 49, 7, 7, 12, 1], [(1, 4, 5), (9, 3, 0)])
    got = scoring.score(hidden, lambda h: h @ head_w.T, p)
    logits = hidden @ head_w.T
    assert [(x.start, x.count, x.top) for x in got] == [(1, 4, 5), (9, 3, 0)]
    _close(PL.positions(got[0]), _naive(logits[:4], [3, 0, 49, 7], 5))
    _close(PL.positions(got[1]), _naive(logits[4:], [7, 12, 1], 0))


def test_rank_counts_ties_as_vllm_does():
    """vLLM's rank: the ids at least as likely as the token, itself included."""
    logits = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0]])
    p = scoring.ScorePlan([0, 0], [2, 4], [(1, 1, 1), (2, 1, 1)])
    a, b = scoring.score(logits[[0, 0]], lambda h: h, p)
    assert PL.positions(a)[0].rank == 3 and PL.positions(b)[0].rank == 5
    assert PL.positions(a)[0].top_ids[0] in (0, 2, 3)


def test_nothing_scored_is_an_empty_entry_per_seq():
    assert scoring.score(None, lambda h: h, scoring.ScorePlan([], [], [(7, 0, 2)])) == (PromptLogprobs(7, 0, 2),)


# ---------------------------------------------------------------------------------- the wire
def _packed(start: int, values: list[tuple[float, int, tuple, tuple]], top: int) -> PromptLogprobs:
    import numpy as np

    return PromptLogprobs(start, len(values), top, np.array([v[0] for v in values], "<f4").tobytes(),
                          np.array([v[1] for v in values], "<i4").tobytes(),
                          np.array([i for v in values for i in v[2]], "<i4").tobytes(),
                          np.array([x for v in values for x in v[3]], "<f4").tobytes())


def test_positions_and_join_read_the_chunks_as_one():
    a = _packed(1, [(-0.5, 1, (3, 4), (-0.5, -1.5)), (-2.0, 7, (9, 1), (-0.25, -1.0))], 2)
    b = _packed(3, [(-1.0, 2, (5, 6), (-0.75, -1.0))], 2)
    last = PromptLogprobs(4, 0, 2)  # the prompt's last chunk of one token
    whole = PL.join([a, b, last])
    assert (whole.start, whole.count, whole.top) == (1, 3, 2)
    assert PL.positions(whole) == [PL.Position(-0.5, 1, (3, 4), (-0.5, -1.5)),
                                   PL.Position(-2.0, 7, (9, 1), (-0.25, -1.0)),
                                   PL.Position(-1.0, 2, (5, 6), (-0.75, -1.0))]
    assert PL.join([a]) is a and PL.join([]) == PromptLogprobs(1, 0, 0)


@pytest.mark.parametrize("parts, needle", [
    ([_packed(2, [(-1.0, 1, (), ())], 0)], "start at 2"),  # a gap before the first
    ([_packed(1, [(-1.0, 1, (), ())], 0), _packed(3, [(-1.0, 1, (), ())], 0)], "expected 2"),  # a gap between
    ([_packed(1, [(-1.0, 1, (3,), (-1.0,))], 1), _packed(2, [(-1.0, 1, (), ())], 0)], "top 0"),
    ([PromptLogprobs(1, 2, 0, b"\0" * 4, b"\0" * 8)], "logprobs holds 4 bytes, not 8"),
    ([PromptLogprobs(0, 0, 0)], "start must be >= 1"),
])
def test_join_refuses_what_does_not_follow(parts, needle):
    with pytest.raises(ValueError, match=needle):
        PL.join(parts)


# ---------------------------------------------------------- the engines against torch directly
def _want(model, prompt: list[int], k: int) -> list[PL.Position]:
    return _naive(prompt_logits(model, prompt)[:-1], prompt[1:], k)


def _scored(model, prompt: list[int], k: int, chunk: int, table: tuple[int, ...], pool) -> tuple[list, list[int]]:
    """Prefill ``prompt`` in chunks as the scheduler cuts it, a decode of another sequence in every
    step (its own blocks), asking prompt logprobs; the joined entry's positions and what was sampled."""
    parts, sampled = [], []
    other = SeqWork(1, (7,), 0, (len(table),))
    for s in range(0, len(prompt), chunk):
        end = min(len(prompt), s + chunk)
        last = end == len(prompt)
        w = SeqWork(0, tuple(prompt[s:end]), s, table, sample=last, rope_len=0 if last else len(prompt),
                    score_prompt=k, next_prompt_token=-1 if last else prompt[end])
        out = model.execute_sampled([other, w], pool)
        assert len(out.prompt) == 1
        parts.append(out.prompt[0])
        sampled.append(out.tokens)
    return PL.positions(PL.join(parts)), sampled


@pytest.mark.parametrize("engine", ["per-seq", "batched"])
@pytest.mark.parametrize("n, chunk", [(2, 2), (40, 40), (45, 7), (33, 16)])
def test_engines_score_the_prompt_as_torch_does(engine, n, chunk):
    cfg = msgspec.structs.replace(preset("tiny"), engine=engine)
    model = build_model(cfg)
    assert (model.batched is not None) == (engine == "batched")
    prompt = prompt_of(n, seed=n)
    table = tuple(range(8))
    got, sampled = _scored(model, prompt, 5, chunk, table, new_pool(model, 9, 8))
    _close(got, _want(model, prompt, 5))
    # the step samples as it would without scoring: the other sequence each step, then the prompt's first token
    plain = new_pool(model, 9, 8)
    for s in range(0, n, chunk):
        end = min(n, s + chunk)
        w = SeqWork(0, tuple(prompt[s:end]), s, table, sample=end == n, rope_len=0 if end == n else n)
        assert model.execute_sampled([SeqWork(1, (7,), 0, (8,)), w], plain).tokens == sampled[s // chunk]


def test_scoring_is_rank_zeros_and_the_deterministic_path_keeps_the_rows():
    det = build_model(msgspec.structs.replace(preset("tiny"), deterministic=True))
    prompt = prompt_of(20, seed=5)
    got, _ = _scored(det, prompt, 2, 20, tuple(range(8)), new_pool(det, 9, 8))
    _close(got, _want(det, prompt, 2))
    pool = new_pool(det, 9, 8)
    det.tp_rank = 1  # another rank computes the same logits: only rank 0 answers with the scores
    out = det.execute_sampled([SeqWork(0, tuple(prompt), 0, tuple(range(8)), score_prompt=2)], pool)
    assert out.prompt == () and len(out.tokens) == 1


def test_prompt_logprobs_equal_transformers_float32(tmp_path):
    """A tiny checkpoint transformers writes: pushkv's prompt logprobs on both engines are the
    float32 log_softmax of transformers' own logits at each position."""
    transformers = pytest.importorskip("transformers")
    from pushkv.model.checkpoint import model_config_from_hf
    from tests.model.test_hf_reference import save_hf_checkpoint

    path = save_hf_checkpoint(str(tmp_path / "llama"), "llama", seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(path)("the quick brown fox jumps over the lazy dog").input_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    want = _naive(logits[:-1], ids[1:], 3)
    for engine in ("per-seq", "batched"):
        model = build_model(model_config_from_hf(path, engine=engine))
        got, _ = _scored(model, ids, 3, 5, tuple(range(8)), new_pool(model, 9, 16))
        _close(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_batched_engine_scores_the_prompt_as_torch_does(deterministic):
    """On CUDA (the batched engine's kernels; a step that scores is run eager, not replayed): the chunked prompt's
    logprobs equal log_softmax of the dense reference's logits, computed on the CPU from the same weights."""
    cfg = preset("small", deterministic=deterministic)  # float32
    model = build_model(cfg, device="cuda")
    model.enable_batched(max_num_seqs=8)
    prompt = prompt_of(45, seed=3)
    table = tuple(range(8))
    got, _ = _scored(model, prompt, 5, 16, table, new_pool(model, 9, 8).cuda())
    cpu = build_model(cfg)
    _close(got, _want(cpu, prompt, 5))
