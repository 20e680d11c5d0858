"""Prompt logprobs in the schedulers, driven by plain calls with a worker that runs the real model
in this process: the instance that computes the prompt (local, P, a D prefilling it itself) asks
its steps to score each chunk, joins them and sends them with the first token (P: in its own
TokensGenerated, before the KV leaves), equal to log_softmax of the model's logits at every
position; a request that asks is computed whole (no prefix-cache hit), and nothing changes for one
that does not."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv import prompt_logprobs as PL
from pushkv.model import build_model
from pushkv.model.reference import prompt_logits
from pushkv.scheduler.requests import Request, build_batch
from tests.model.test_model import new_pool
from tests.model.test_prompt_logprobs import _close, _naive
from tests.scheduler.test_scheduler_prefix import generate, idle, make, prompt
from tests.scheduler.test_scheduler_roles import P_SRC

ASK = m.SamplingParams(prompt_logprobs=2)


@pytest.mark.parametrize("n, chunk, want", [
    (10, 4, [(2, 5), (2, 9), (2, -1)]),  # each chunk scores the prompt's token after it, but the last
    (10, 0, [(2, -1)]),  # whole
])
def test_build_batch_asks_each_chunk_to_score(n, chunk, want):
    asks = Request("a", 0, "local", tuple(range(1, n + 1)), 4, b"", sampling=ASK, seq_id=1)
    plain = Request("b", 0, "local", tuple(range(1, n + 1)), 4, b"", seq_id=2)
    got = []
    while asks.prefilled < n:
        (wa, wb) = [w for _, w in build_batch([asks, plain], [], 8, 100, chunk)]
        got.append((wa.score_prompt, wa.next_prompt_token))
        assert (wb.score_prompt, wb.next_prompt_token) == (-1, -1)  # no cost for a request that did not ask
        asks.prefilled = plain.prefilled = wa.start_pos + len(wa.token_ids)
    assert got == want


class Engine:
    """The worker: the model's step on a pool of the scheduler's blocks, answered as the worker does."""

    def __init__(self, s, wire):
        self.s, self.wire = s, wire
        self.model = build_model(s.cfg.model)
        self.pool = new_pool(self.model, s.inst.num_blocks, s.inst.block_size)
        self.steps: list[m.ExecuteStep] = []

    def run(self, drop_scores: bool = False) -> None:
        while any(isinstance(x, m.ExecuteStep) for _, x in self.wire.sent):
            (step,) = [x for x in self.wire.take("worker") if isinstance(x, m.ExecuteStep)]
            self.steps.append(step)
            out = self.model.execute_sampled(list(step.seqs), self.pool)
            scores = () if drop_scores else out.prompt
            for ch in self.s.workers:
                self.s.handle(m.StepDone(step.step_id, tuple(out.tokens), 0.0, out.logprobs, (), scores), ch,
                              self.s.now, self.s.now)

    def want(self, ids) -> list[PL.Position]:
        return _naive(prompt_logits(self.model, list(ids))[:-1], list(ids)[1:], 2)


def _answers(wire, tid: str) -> list[m.Msg]:
    return [x for x in wire.take("router") if x.transfer_id == tid]


def _tokens(msgs) -> list[int]:
    return [t for x in msgs if isinstance(x, m.TokensGenerated) for t in x.token_ids]


def test_local_scores_every_chunk_and_takes_no_prefix_hit():
    s, wire = make("local", "local", num_blocks=16, chunk=16)
    e = Engine(s, wire)
    ids = prompt(50)
    generate(s, "plain", ids, max_tokens=3)
    e.run()
    plain = _answers(wire, "plain")
    assert all(x.prompt_logprobs is None for x in plain)
    generate(s, "scored", ids, max_tokens=3, sampling=ASK)
    e.run()
    scored = _answers(wire, "scored")
    assert _tokens(scored) == _tokens(plain)  # scoring changes no token
    first = scored[0]
    assert first.prompt_logprobs is not None and all(x.prompt_logprobs is None for x in scored[1:])
    _close(PL.positions(first.prompt_logprobs), e.want(ids))
    starts = [w.start_pos for st in e.steps for w in st.seqs if w.score_prompt >= 0]
    assert starts == [0, 16, 32, 48]  # computed whole: the cached prefix (48 tokens) was not taken
    assert s.counters["prefix_skipped_prompt_logprobs"] == 1 and scored[-1].cached_tokens == 0
    generate(s, "again", ids, max_tokens=3)  # a later request without them still hits the cache
    e.run()
    again = _answers(wire, "again")
    assert _tokens(again) == _tokens(plain) and again[-1].cached_tokens == 48
    assert idle(s)


def test_a_one_token_prompt_scores_nothing_and_says_so():
    s, wire = make("local", "local")
    e = Engine(s, wire)
    generate(s, "one", (65,), max_tokens=2, sampling=ASK)
    e.run()
    first = _answers(wire, "one")[0]
    assert first.prompt_logprobs == m.PromptLogprobs(1, 0, 2) and idle(s)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_sends_them_with_its_first_token_before_the_kv_leaves(mode):
    s, wire = make("prefill", mode, chunk=16)
    e = Engine(s, wire)
    ids = prompt(40)
    generate(s, "t", ids, leg="prefill", sampling=ASK)
    e.run()
    sent = wire.take("router")
    assert [type(x) for x in sent] == [m.TokensGenerated] + ([m.PrefillFinished] if mode == "pull" else [])
    _close(PL.positions(sent[0].prompt_logprobs), e.want(ids))
    assert sent[0].logprobs == ()  # the first token's logprob was not asked
    assert [type(x) for x in wire.take("writer")] == [m.HoldKV if mode == "pull" else m.SendKV]


def test_a_decode_instance_scores_only_a_prompt_it_prefills_itself():
    s, wire = make("decode", "push", num_blocks=16)
    e = Engine(s, wire)
    ids = prompt(40)
    generate(s, "here", ids, leg="decode", max_tokens=2, sampling=ASK, prefill_here=True)
    e.run()
    _close(PL.positions(_answers(wire, "here")[0].prompt_logprobs), e.want(ids))
    generate(s, "moved", ids, leg="decode", max_tokens=2, sampling=ASK, source=P_SRC)
    (expect,) = [x for x in wire.take("writer") if isinstance(x, m.ExpectKV)]
    assert expect.cached_tokens == 32  # the KV that moves may come from D's cache: P computed the prompt
    deliver_kv = m.KVReceived("moved", 0, 7)
    s.handle(deliver_kv, s.writers[0], s.now, s.now)
    e.run()
    assert all(x.prompt_logprobs is None for x in _answers(wire, "moved"))
    assert all(w.score_prompt < 0 for st in e.steps[-2:] for w in st.seqs)
    assert idle(s)


def test_a_step_without_the_scores_fails_that_request_alone():
    s, wire = make("local", "local")
    e = Engine(s, wire)
    generate(s, "asks", prompt(20), max_tokens=2, sampling=ASK)
    generate(s, "plain", prompt(20, first=7), max_tokens=2)
    e.run(drop_scores=True)
    sent = wire.take("router")
    (failed,) = [x for x in sent if x.transfer_id == "asks"]
    assert isinstance(failed, m.RequestFailed) and failed.status == 500 and "prompt logprobs" in failed.reason
    assert len(_tokens(x for x in sent if x.transfer_id == "plain")) == 2
    assert s.counters["prompt_logprobs_missing"] == 1 and idle(s)
