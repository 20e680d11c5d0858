"""A scheduler re-checks every parameter it acts on, and a bad one fails that request alone.

Driven by plain calls (tests/scheduler/test_scheduler_roles.py), with a worker that runs the real sampler
(pushkv.model.sampling) on logits that depend only on each sequence's own tokens, so a request's
output is the same whoever shares its batch, unless something crosses rows.
"""
from __future__ import annotations

import math

import msgspec
import pytest
import torch

from pushkv import limits as L
from pushkv import messages as m
from pushkv.model.sampling import sample
from pushkv.scheduler.validate import check_generate
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, all_free, deliver, make

VOCAB = 320  # the "small" preset's (make() uses it)
S = m.SamplingParams


def logits_of(w: m.SeqWork) -> torch.Tensor:
    """A row that depends only on the sequence's last token and position."""
    g = torch.Generator().manual_seed(w.token_ids[-1] * 100_003 + w.start_pos + len(w.token_ids))
    return torch.randn(VOCAB, generator=g)


def run_step(s, wire) -> m.ExecuteStep:
    """Answer the step the scheduler sent its workers, sampling with the real sampler."""
    (step,) = {x.step_id: x for x in wire.take("worker")}.values()
    seqs = [w for w in step.seqs if w.sample]
    try:
        out = sample(torch.stack([logits_of(w) for w in seqs]) if seqs else torch.empty(0, VOCAB), seqs)
        answer = m.StepDone(step.step_id, tuple(out.tokens))
    except Exception as e:  # as the real worker answers (worker/engine.py)
        answer = m.StepFailed(step.step_id, f"{type(e).__name__}: {e}")
    for ch in s.workers:
        deliver(s, ch, answer)
    return step


def serve(s, wire, gens: list[m.Generate]) -> dict[str, list]:
    """Send ``gens``, run steps until nothing is left, compiling the grammars asked for whenever no step is
    out; each transfer id's tokens, or its failure."""
    for g in gens:
        deliver(s, ROUTER, g)
    while True:
        if any(isinstance(x, m.ExecuteStep) for _, x in wire.sent):
            run_step(s, wire)
        elif not wire.compile_asked():
            break
    got: dict[str, list] = {}
    for x in wire.take("router"):
        got.setdefault(x.transfer_id, []).extend(x.token_ids if isinstance(x, m.TokensGenerated) else [x])
    return got


def gen(tid: str, sampling=None, prompt=(5, 6, 7), max_tokens=6, **kw) -> m.Generate:
    return m.Generate(tid, 0, "local", prompt, max_tokens, sampling=sampling, **kw)


VICTIM = gen("victim", None, (11, 12, 13, 14))  # greedy: sent with no sampling params


def test_the_sampler_trusts_its_input():
    """Why the scheduler must check: in one step's sampling, a negative logit_bias id lands in the
    row before (another request's), and an id past the vocabulary fails the whole step."""
    x = torch.zeros(2, VOCAB)
    x[0, 3] = 1.0
    victim = m.SeqWork(1, (1,), 0, (0,))
    assert sample(x, [victim, m.SeqWork(2, (1,), 0, (0,))]).tokens[0] == 3
    neg = m.SeqWork(2, (1,), 0, (0,), sampling=S(logit_bias=((-1, 100.0),)))
    assert sample(x, [victim, neg]).tokens[0] == VOCAB - 1  # the victim's token changed
    past = m.SeqWork(2, (1,), 0, (0,), sampling=S(logit_bias=((2 * VOCAB, 1.0),)))
    with pytest.raises((IndexError, RuntimeError)):
        sample(x, [victim, past])  # the real worker answers StepFailed: every request in the step fails
    stop = m.SeqWork(2, (1,), 0, (0,), sampling=S(min_tokens=2), suppress=(-VOCAB + 3,))
    assert sample(x, [victim, stop]).tokens[0] != 3  # a stop id suppressed in the victim's row


BAD = [
    ("bias id -1", gen("x", S(logit_bias=((-1, 100.0),))), "logit_bias token id -1"),
    ("bias id = vocab", gen("x", S(logit_bias=((VOCAB, 1.0),))), f"logit_bias token id {VOCAB}"),
    ("bias id twice", gen("x", S(logit_bias=((7, 60.0), (7, 60.0)))), "token id twice"),
    ("bias too many", gen("x", S(logit_bias=tuple((i % VOCAB, 1.0) for i in range(L.MAX_LOGIT_BIAS + 1)))),
     f"at most {L.MAX_LOGIT_BIAS}"),
    ("bias value", gen("x", S(logit_bias=((7, 101.0),))), "value 101.0"),
    ("bias nan", gen("x", S(logit_bias=((7, math.nan),))), "value nan"),
    ("stop id -1", gen("x", None, stop_token_ids=(-1,)), "stop_token_ids: token id -1"),
    ("stop id = vocab", gen("x", None, stop_token_ids=(VOCAB,)), f"token id {VOCAB}"),
    ("stop ids too many", gen("x", None, stop_token_ids=(1,) * (L.MAX_STOP_TOKEN_IDS + 10)), "stop_token_ids has"),
    ("temperature -1", gen("x", S(temperature=-1.0)), "sampling.temperature"),
    ("temperature tiny", gen("x", S(temperature=1e-300)), "sampling.temperature"),
    ("temperature nan", gen("x", S(temperature=math.nan)), "sampling.temperature"),
    ("temperature huge", gen("x", S(temperature=1e9)), "sampling.temperature"),
    ("top_p 0", gen("x", S(top_p=0.0)), "sampling.top_p"),
    ("top_p nan", gen("x", S(top_p=math.nan)), "sampling.top_p"),
    ("top_k -1", gen("x", S(top_k=-1)), "sampling.top_k"),
    ("min_p 2", gen("x", S(min_p=2.0)), "sampling.min_p"),
    ("presence 3", gen("x", S(presence_penalty=3.0)), "sampling.presence_penalty"),
    ("frequency inf", gen("x", S(frequency_penalty=math.inf)), "sampling.frequency_penalty"),
    ("logprobs 21", gen("x", S(logprobs=21)), "sampling.logprobs"),
    ("logprobs huge", gen("x", S(logprobs=1 << 40)), "sampling.logprobs"),
    ("logprobs -2", gen("x", S(logprobs=-2)), "sampling.logprobs"),
    ("prompt_logprobs 21", gen("x", S(prompt_logprobs=21)), "sampling.prompt_logprobs"),
    ("prompt_logprobs -2", gen("x", S(prompt_logprobs=-2)), "sampling.prompt_logprobs"),
    ("min_tokens > max_len", gen("x", S(min_tokens=1 << 40)), "sampling.min_tokens"),
    ("min_tokens -1", gen("x", S(min_tokens=-1)), "sampling.min_tokens"),
    ("repetition 0", gen("x", S(repetition_penalty=0.0)), "sampling.repetition_penalty"),
    ("repetition nan", gen("x", S(repetition_penalty=math.nan)), "sampling.repetition_penalty"),
    ("repetition huge", gen("x", S(repetition_penalty=1e9)), "sampling.repetition_penalty"),
    ("allowed id -1", gen("x", S(allowed_token_ids=(3, -1))), "allowed_token_ids token id -1"),
    ("allowed id = vocab", gen("x", S(allowed_token_ids=(VOCAB,))), f"allowed_token_ids token id {VOCAB}"),
    ("allowed too many", gen("x", S(allowed_token_ids=tuple(i % VOCAB for i in range(L.MAX_ALLOWED_TOKEN_IDS + 1)))),
     "sampling.allowed_token_ids has"),
    ("bad word id -1", gen("x", S(bad_words=((4, -1),))), "bad_words token id -1"),
    ("bad word empty", gen("x", S(bad_words=((),))), "sampling.bad_words: each"),
    ("bad word long", gen("x", S(bad_words=((4,) * (L.MAX_BAD_WORD_TOKENS + 1),))), "sampling.bad_words: each"),
    ("bad words too many", gen("x", S(bad_words=((4,),) * (2 * L.MAX_BAD_WORDS + 1))), "sampling.bad_words has"),
    ("prompt id -1", gen("x", None, (1, -1)), "token id -1"),
    ("max_tokens 0", gen("x", None, max_tokens=0), "max_tokens"),
]


@pytest.mark.parametrize("name, msg, needle", BAD, ids=[b[0] for b in BAD])
def test_check_generate_names_the_field(name, msg, needle):
    why = check_generate(msg, VOCAB, 1024, L.MAX_STOP_TOKEN_IDS + 1)
    assert why is not None and needle in why, why


def test_the_edges_are_accepted():
    ok = S(temperature=L.MIN_TEMPERATURE, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0,
           frequency_penalty=2.0, logprobs=L.MAX_LOGPROBS, min_tokens=6, prompt_logprobs=L.MAX_LOGPROBS,
           logit_bias=tuple((i, 100.0 if i % 2 else -100.0) for i in range(VOCAB)),
           allowed_token_ids=(0, VOCAB - 1), repetition_penalty=L.MAX_REPETITION_PENALTY, bad_words=((0,) * L.MAX_BAD_WORD_TOKENS, (VOCAB - 1,)))
    assert check_generate(gen("x", ok, stop_token_ids=(0, VOCAB - 1)), VOCAB, 1024, 300) is None


@pytest.mark.parametrize("name, bad, needle", [(b[0], b[1], b[2]) for b in BAD if b[1].sampling is not None
                                                or b[1].stop_token_ids], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_request_fails_alone_and_the_batch_is_untouched(name, bad, needle):
    """The victim alone, then the victim with the bad request sent beside it (and a good one
    behind): the bad one gets 400 naming the field, the others' tokens do not change."""
    alone_s, alone_w = make("local", mode="local", tp=1, num_blocks=64)
    want = serve(alone_s, alone_w, [VICTIM, gen("good", S(temperature=0.7, seed=5))])
    s, wire = make("local", mode="local", tp=1, num_blocks=64)
    got = serve(s, wire, [VICTIM, msgspec.structs.replace(bad, transfer_id="bad"), gen("good", S(temperature=0.7, seed=5))])
    bad_out = got.pop("bad")
    assert got == want and len(want["victim"]) == VICTIM.max_tokens  # the others: as if it were not there
    (failed,) = bad_out
    assert isinstance(failed, m.RequestFailed) and failed.status == 400 and needle in failed.reason
    assert s.counters["rejected"] == 1 and all_free(s)


def test_decode_checks_the_first_token_from_a_peer():
    """D's first token comes from P's writer (a peer): one outside the vocabulary fails that
    request (it would be the next step's input), and a pull leg's claims are checked on arrival."""
    s, wire = make("decode", tp=1, num_blocks=64)
    deliver(s, ROUTER, m.Generate("t1", 0, "decode", (1, 2, 3), 4, source=P_SRC))
    deliver(s, ROUTER, m.Generate("t2", 0, "decode", (1, 2, 3), 4, source=P_SRC))
    wire.take("writer")
    deliver(s, s.writers[0], m.KVReceived("t1", 0, VOCAB + 5))
    deliver(s, s.writers[0], m.KVReceived("t2", 0, 42))
    out = wire.take("router")
    assert [(type(x), x.transfer_id) for x in out] == [(m.RequestFailed, "t1"), (m.TokensGenerated, "t2")]
    assert out[0].status == 502 and f"first token {VOCAB + 5}" in out[0].reason
    for tok, n, needle in [(VOCAB, 3, "pull.first_token"), (7, 9, "pull.num_tokens")]:
        pull = m.PullParams(P_SRC, (0,), n, tok, 0.0)
        assert needle in check_generate(m.Generate("t", 0, "decode", (1, 2, 3), 4, pull=pull), VOCAB, 1024, 10)
