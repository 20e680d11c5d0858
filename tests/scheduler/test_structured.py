"""Structured output in a scheduler (pushkv/scheduler/grammar.py) with the real sampler on logits that ignore the
grammar: every step's draw is masked to the grammar's tokens, the request ends when the grammar is complete, and
P's first token, drawn under the mask on P, is taken by D's grammar before D's first step."""
from __future__ import annotations

import json
import re

import msgspec
import pytest

from pushkv import messages as m
from pushkv.config import preset
from pushkv.scheduler.grammar import Grammars, XgrammarCompile, allowed_ids
from tests.scheduler.test_scheduler_roles import make
from tests.scheduler.test_scheduler_validate import gen, serve

pytest.importorskip("xgrammar")

S = m.SamplingParams
EOS = 257
CHOICES = ["yes", "no", "maybe so"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def text(tokens: list) -> str:
    return bytes(t for t in tokens if t < 256).decode()


def compiled(*specs: m.Structured) -> Grammars:
    """A scheduler's grammars with ``specs`` compiled (as its shell's threads compile them)."""
    g, compile = Grammars(preset("small")), XgrammarCompile(preset("small"))
    for spec in specs:
        g.add(spec, compile(spec))
    return g


@pytest.mark.parametrize("spec, check", [
    (m.Structured("choice", json.dumps(CHOICES)), lambda s: s in CHOICES),
    (m.Structured("regex", "[0-9]{3}-[a-z]{2}"), lambda s: re.fullmatch("[0-9]{3}-[a-z]{2}", s)),
    (m.Structured("json", json.dumps(SCHEMA), any_whitespace=False),
     lambda s: set(json.loads(s)) == {"ok", "n"} and json.loads(s)["n"] in range(10)),
], ids=["choice", "regex", "json"])
@pytest.mark.parametrize("sampling", [None, S(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_a_structured_request_draws_only_what_its_grammar_allows_and_ends_with_it(spec, check, sampling):
    s, wire = make("local", mode="local", tp=1, num_blocks=64)
    got = serve(s, wire, [gen("g", sampling, max_tokens=40, structured=spec), gen("free", sampling, max_tokens=6)])
    out = got["g"]
    assert out[-1] == EOS and check(text(out)), text(out)  # complete, then its stop token: finished "stop"
    assert len(got["free"]) == 6  # a request beside it is not held to the grammar


def test_a_matcher_follows_the_output_and_masks_the_next_draw():
    g = compiled(m.Structured("choice", json.dumps(CHOICES)), m.Structured("regex", "a+"))
    mt = g.matcher(m.Structured("choice", json.dumps(CHOICES)))
    assert allowed_ids(mt.mask([]), 320) == sorted(b"ynm")
    assert allowed_ids(mt.mask(list(b"may")), 320) == [ord("b")]
    assert allowed_ids(mt.mask(list(b"maybe so")), 320) == [EOS] and not mt.terminated
    mt.advance(list(b"maybe so") + [EOS])
    assert mt.terminated
    again = g.matcher(m.Structured("choice", json.dumps(CHOICES)))  # compiled once, a fresh state each
    assert again is not mt and allowed_ids(again.mask([]), 320) == sorted(b"ynm")
    bad = g.matcher(m.Structured("regex", "a+"))
    bad.advance([ord("b")])
    assert bad.terminated and bad.broken  # a token the grammar never allowed ends it, never hangs it


def test_d_takes_ps_first_token_into_the_grammar():
    """D's grammar starts from P's first token (KVReceived.first_token): its first mask continues it."""
    from pushkv.scheduler.requests import Request

    spec = m.Structured("choice", json.dumps(CHOICES))
    r = Request("t", 0, "decode", (1, 2), 8, b"r", sampling=S(), grammar=compiled(spec).matcher(spec))
    r.output = [ord("m")]
    assert allowed_ids(r.sample_fields()["token_mask"], 320) == [ord("a")]


def test_a_bad_spec_from_a_direct_sender_is_refused_alone():
    s, wire = make("local", mode="local", tp=1, num_blocks=64)
    got = serve(s, wire, [gen("bad", None, structured=m.Structured("regex", "(")), gen("ok", None, max_tokens=3)])
    (failed,) = got["bad"]
    assert isinstance(failed, m.RequestFailed) and failed.status == 400 and "structured output" in failed.reason
    assert len(got["ok"]) == 3


def test_with_a_reasoning_parser_the_grammar_holds_what_follows_the_reasoning():
    """The grammar holds the output from the tokens that end the reasoning on (vLLM's): nothing masked while the
    model reasons, then the grammar, also where the prompt holds those tokens (an earlier turn's reasoning: the
    router sends no ``after`` where the prompt closed the reasoning, reasoning.reasons); the scheduler started the
    grammar at once on a prompt holding the end tag anywhere, so a later turn's thinking was held to it."""
    from pushkv.scheduler.requests import Request

    end = tuple(b"</think>")
    spec = m.Structured("choice", json.dumps(CHOICES), after=end)
    g = compiled(spec)
    r = Request("t", 0, "local", (1, 2), 40, b"r", sampling=S(), grammar=g.matcher(spec))
    r.output = list(b"hmm, let me see </thi")
    assert r.sample_fields()["token_mask"] == b"" and r.finished() is None  # still reasoning: free
    r.output += list(b"nk>")
    assert allowed_ids(r.sample_fields()["token_mask"], 320) == sorted(b"ynm")
    r.output += list(b"no") + [EOS]
    assert r.finished() == "stop"
    prompt = (5,) + end + (10,)  # an earlier turn's reasoning
    q = Request("t", 0, "local", prompt, 40, b"r", sampling=S(), grammar=g.matcher(spec))
    assert q.sample_fields()["token_mask"] == b""  # this turn's reasoning: free
    plain = msgspec.structs.replace(spec, after=())  # the router's, where the prompt closed the reasoning
    q = Request("t", 0, "local", prompt, 40, b"r", sampling=S(), grammar=compiled(plain).matcher(plain))
    assert allowed_ids(q.sample_fields()["token_mask"], 320) == sorted(b"ynm")  # held from the start


def test_the_core_starts_no_grammar_on_an_end_tag_in_its_prompt():
    """Through the core: a request whose ``after`` the prompt holds (an earlier turn's reasoning) still reasons
    free first; the core started its grammar at once there (the router now decides where the output reasons)."""
    from tests.scheduler.test_scheduler_roles import ROUTER, deliver

    s, wire = make("local", mode="local", tp=1, num_blocks=64)
    end = tuple(b"</think>")
    spec = m.Structured("choice", json.dumps(CHOICES), after=end)
    deliver(s, ROUTER, gen("t", None, prompt=(5,) + end + (10,), structured=spec))
    assert wire.compile_asked() == 1
    (step,) = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)]
    assert [w.token_mask for w in step.seqs] == [b""]
