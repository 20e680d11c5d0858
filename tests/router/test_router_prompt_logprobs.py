"""Prompt logprobs in the router, by plain calls: which requests ask and how many alternatives (vLLM's
``prompt_logprobs``, echo with logprobs, echo with max_tokens 0) and what is refused; the request
machine holding D's first tokens for what only P computed; the shapes they are rendered in
(OpenAI's echoed completion logprobs, vLLM's ``prompt_logprobs`` per choice and per chat response);
and placement assuming no cached prefix for such a request."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.router import api, chat, render
from pushkv.router import policy as P
from pushkv.router import request as R
from pushkv.router.output import ChoiceOutput, Delta
from pushkv.router.text import ByteTokenizer
from tests.model.test_prompt_logprobs import _packed
from tests.router.test_router_policy import ChatRun, primed
from tests.router.test_router_request import PULL, START_PULL, START_PUSH, T0, pf, placed, show

TOK = ByteTokenizer()
LIMITS = api.Limits(vocab_size=300, max_model_len=64)
TEMPLATE = chat.ChatTemplate(chat.PLAIN_TEMPLATE)


# --------------------------------------------------------------------------- what is asked
@pytest.mark.parametrize("body, prompt_logprobs, logprobs, echo_only, max_tokens", [
    ({}, -1, -1, False, 16),
    ({"prompt_logprobs": 0}, 0, -1, False, 16),
    ({"prompt_logprobs": 20, "logprobs": 2}, 20, 2, False, 16),
    ({"echo": True, "logprobs": 3}, 3, 3, False, 16),  # echo scores the prompt as widely as the output
    ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 1, 3, False, 16),  # unless prompt_logprobs says
    ({"echo": True}, -1, -1, False, 16),
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, 1, 1, True, 1),  # lm-eval's scoring: the prompt alone
    ({"echo": True, "max_tokens": 0}, -1, -1, True, 1),
    ({"echo": True, "logprobs": 1, "stream": True}, 1, 1, False, 16),  # streamed in the prompt's chunk
    ({"prompt_logprobs": 0, "stream": True}, 0, -1, False, 16),  # vLLM takes 0 with a stream
])
def test_completions_ask(body, prompt_logprobs, logprobs, echo_only, max_tokens):
    p = api.parse_completion({"prompt": "hello", **body}, TOK, LIMITS)
    assert (p.sampling.prompt_logprobs, p.sampling.logprobs, p.echo_only, p.max_tokens) == \
        (prompt_logprobs, logprobs, echo_only, max_tokens)


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": True}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),  # without echo there is nothing to answer
    ({"echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
])
def test_bad_values_are_400_naming_the_field(body, param, needle):
    parsers = [lambda b: api.parse_completion({"prompt": "hello", **b}, TOK, LIMITS)]
    if param == "prompt_logprobs":  # chat takes vLLM's field too
        parsers.append(lambda b: chat.parse_chat({"messages": [{"role": "user", "content": "hi"}], **b}, TOK,
                                                 LIMITS, TEMPLATE))
    for parse in parsers:
        with pytest.raises(api.ApiError) as e:
            parse(body)
        assert (e.value.status, e.value.param) == (400, param) and needle in e.value.message, e.value.message


def test_chat_asks_by_prompt_logprobs_alone():
    msgs = [{"role": "user", "content": "hi"}]
    assert chat.parse_chat({"messages": msgs}, TOK, LIMITS, TEMPLATE).sampling.prompt_logprobs == -1
    p = chat.parse_chat({"messages": msgs, "prompt_logprobs": 4, "logprobs": True}, TOK, LIMITS, TEMPLATE)
    assert (p.sampling.prompt_logprobs, p.sampling.logprobs) == (4, 0)


# ----------------------------------------------------------------------------- the renderings
IDS = [104, 105, 33]  # "hi!"
PLP = _packed(1, [(-1.25, 2, (33, 105), (-0.5, -1.25)), (float("-inf"), 300, (7, 8), (-0.1, -0.2))], 2)


def test_vllm_prompt_logprobs_shape():
    got = render.vllm_prompt_logprobs(TOK, IDS, PLP)
    assert got == [
        None,
        # the prompt's token first with its rank, then the top N ranked 1..N; in the top, it takes its rank there
        {"105": {"logprob": -1.25, "rank": 2, "decoded_token": "i"},
         "33": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}},
        {"33": {"logprob": -9999.0, "rank": 300, "decoded_token": "!"},  # -inf as OpenAI's floor
         "7": {"logprob": -0.10000000149011612, "rank": 1, "decoded_token": "\x07"},
         "8": {"logprob": -0.20000000298023224, "rank": 2, "decoded_token": "\x08"}},
    ]
    assert list(got[1]) == ["105", "33"]  # dict order: the prompt's token first


def test_completion_prompt_logprobs_shape():
    got = render.completion_prompt_logprobs(TOK, IDS, PLP)
    assert got["tokens"] == ["h", "i", "!"] and got["text_offset"] == [0, 1, 2]
    assert got["token_logprobs"] == [None, -1.25, -9999.0]
    assert got["top_logprobs"] == [None, {"i": -1.25, "!": -0.5}, {"!": -9999.0, "\x07": pytest.approx(-0.1),
                                                                   "\x08": pytest.approx(-0.2)}]


@pytest.mark.parametrize("plp, needle", [(None, "missing"), (_packed(1, [(-1.0, 1, (), ())], 0), "3-token")])
def test_rendering_refuses_what_does_not_fit_the_prompt(plp, needle):
    with pytest.raises(ValueError, match=needle):
        render.vllm_prompt_logprobs(TOK, IDS, plp)


def _choice(body: dict, out_ids=(), lps=(), finish="length"):
    params = api.parse_completion({"prompt": IDS, **body}, TOK, LIMITS)
    out = ChoiceOutput(0, TOK, hide=params.echo_only)
    out.add(list(out_ids), list(lps), PLP)
    out.finish(finish)
    return params, out, render.for_endpoint(TOK, params)


def test_echoed_choice_covers_the_prompt_then_the_output():
    lp = m.TokenLogprob(-0.75, (65,), (-0.75,))
    params, out, r = _choice({"echo": True, "logprobs": 1, "max_tokens": 1}, [65], [lp])
    c = r.choice(out)
    assert c["text"] == "hi!A" and c["token_ids"] == [65]
    assert c["logprobs"]["tokens"] == ["h", "i", "!", "A"] and c["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert c["logprobs"]["token_logprobs"] == [None, -1.25, -9999.0, -0.75]
    assert c["logprobs"]["top_logprobs"][0] is None and c["logprobs"]["top_logprobs"][3] == {"A": -0.75}
    assert c["prompt_logprobs"] == render.vllm_prompt_logprobs(TOK, IDS, PLP)  # vLLM's, beside it


def test_echo_only_answers_the_prompt_alone():
    params, out, r = _choice({"echo": True, "logprobs": 1, "max_tokens": 0}, [65], [m.TokenLogprob(-0.75)])
    c = r.choice(out)
    assert (c["text"], c["token_ids"], c["finish_reason"]) == ("hi!", [], "length")
    assert c["logprobs"]["tokens"] == ["h", "i", "!"] and c["logprobs"]["token_logprobs"] == [None, -1.25, -9999.0]
    assert out.completion_tokens == 1  # drawn and counted, as vLLM counts it; not shown


def test_a_stream_sends_the_echoed_prompt_with_the_first_output():
    """vLLM's stream: an echoed prompt goes out in the chunk of the choice's first tokens, its text and its tokens'
    logprobs first (text offsets from the prompt's start), never a chunk of its own (pushkv sent one, token-less)."""
    lp = m.TokenLogprob(-0.75, (65,), (-0.75,))
    params, out, r = _choice({"echo": True, "logprobs": 1, "stream": True}, [65], [lp])
    assert r.openings(out) == []
    first = r.chunk_choice(0, Delta("A", [65], [lp]))
    assert (first["text"], first["token_ids"]) == ("hi!A", [65]) and "prompt_logprobs" not in first
    assert first["logprobs"]["tokens"] == ["h", "i", "!", "A"] and first["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert first["logprobs"]["token_logprobs"] == [None, -1.25, -9999.0, -0.75]
    then = r.chunk_choice(0, Delta("B", [66], [m.TokenLogprob(-0.5, (66,), (-0.5,))]))
    assert then["text"] == "B" and then["logprobs"]["tokens"] == ["B"] and then["logprobs"]["text_offset"] == [4]


def test_requests_without_them_render_as_before():
    params, out, r = _choice({"logprobs": 1}, [65], [m.TokenLogprob(-0.75, (65,), (-0.75,))])
    c = r.choice(out)
    assert "prompt_logprobs" not in c and c["logprobs"]["tokens"] == ["A"]
    params, out, r = _choice({"echo": True, "stream": True}, [65])
    assert r.openings(out) == [] and r.chunk_choice(0, Delta("A", [65], [])) == render.completion_choice(
        0, "hi!A", [65], None)


def test_chat_puts_them_on_the_response():
    params = chat.parse_chat({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2}, TOK, LIMITS,
                             TEMPLATE)
    ids = params.prompt_token_ids
    plp = _packed(1, [(-1.0, 1, (5, 6), (-1.0, -2.0))] * (len(ids) - 1), 2)
    out = ChoiceOutput(0, TOK)
    out.add([65], [], plp)
    r = render.for_endpoint(TOK, params)
    assert r.response_fields([out]) == {"prompt_logprobs": render.vllm_prompt_logprobs(TOK, ids, plp)}
    plain = chat.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, TOK, LIMITS, TEMPLATE)
    assert render.for_endpoint(TOK, plain).response_fields([out]) == {}


# ------------------------------------------------------------------------ the request machine
PLP3 = _packed(1, [(-1.0, 1, (), ())] * 2, 0)  # the prompt (1, 2, 3) of test_router_request


def new(mode: str, logprobs: int = -1) -> R.Request:
    spec = R.Spec(mode=mode, transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(9,), request_s=10.0,
                  sampling=m.SamplingParams(logprobs=logprobs, prompt_logprobs=0), local_engine="l0")
    return R.Request(spec, arrival=T0)


def toks(ids, finished=False, reason="", lps=(), prompt=None):
    return m.TokensGenerated("t", 0, tuple(ids), finished, reason, logprobs=tuple(lps), prompt_logprobs=prompt)


def _tokens(req: R.Request, steps) -> list[R.Tokens]:
    got: list[R.Tokens] = []
    for msg, leg, now in steps:
        got += [a for a in req.on(msg, now, leg) if isinstance(a, R.Tokens)]
    return got


def test_push_d_waits_for_p_and_the_prompt_goes_with_the_first_tokens():
    req = new("push")
    for msg, leg, now, _ in START_PUSH:
        req.on(msg, now, leg)
    assert req.on(toks([7, 8]), T0 + 1, "decode") == []  # P computed the prompt: its report first
    assert req.on(toks([9]), T0 + 1, "decode") == []  # held behind it, in order
    got = _tokens(req, [(toks([7], prompt=PLP3), "prefill", T0 + 2)])
    assert [(t.token_ids, t.prompt_logprobs) for t in got] == [((7, 8), PLP3), ((9,), None)]


def test_pull_p_reports_first_and_nothing_waits():
    req = new("pull", logprobs=0)
    for msg, leg, now, _ in START_PULL:
        req.on(msg, now, leg)
    lp = m.TokenLogprob(-0.5)
    assert req.on(toks([7], lps=[lp], prompt=PLP3), T0 + 1, "prefill") == []
    req.on(pf(PULL), T0 + 1, "prefill")
    req.on(R.DecodePlaced("d1"), T0 + 1, "router")
    (t,) = _tokens(req, [(toks([7, 8], lps=[m.TokenLogprob(-1.0)]), "decode", T0 + 2)])
    assert t.prompt_logprobs == PLP3 and [x.logprob for x in t.logprobs] == [-0.5, -1.0]


@pytest.mark.parametrize("mode, verdict", [("local", None), ("push", "decode-local")])
def test_the_instance_that_prefilled_sends_them_itself(mode, verdict):
    from pushkv.router import policy as P

    req = new(mode)
    req.on(R.Start(), T0, "router")
    leg = "local" if mode == "local" else "decode"
    if verdict:
        req.on(placed(P.DECODE_LOCAL), T0, "router")
    (first,) = _tokens(req, [(toks([7], prompt=PLP3), leg, T0 + 1)])
    (second,) = _tokens(req, [(toks([8]), leg, T0 + 2)])
    assert (first.prompt_logprobs, second.prompt_logprobs) == (PLP3, None)


def test_first_tokens_without_them_fail_the_request():
    req = new("local")
    req.on(R.Start(), T0, "router")
    actions = req.on(toks([7]), T0 + 1, "local")
    assert [show(a) for a in actions] == [
        ("failed", 502, "the instance that prefilled the prompt sent no prompt logprobs", "failed"), ("disarm",)]


# ----------------------------------------------------------------------------------- placement
def test_placement_assumes_no_cached_prefix_for_them():
    b = primed()
    again = ChatRun("t2", range(100))
    again.reuses_prefix = True
    assert b.ask(again).hits.get("p0", 0) > 0
    scored = ChatRun("t3", range(100))
    scored.reuses_prefix = False
    ask = b.ask(scored)
    assert ask.whole and ask.hits == b.ask(again).hits  # what each instance holds is still known ...
    p0 = b.loads["p0"]
    assert ask.compute_hit(p0) == 0 < b.ask(again).compute_hit(p0)  # ... but P computes the prompt whole
    assert P.prefill_wait_ms(p0, ask) > P.prefill_wait_ms(p0, b.ask(again))


def test_a_d_that_holds_a_prefix_still_spares_the_transfer_but_not_its_own_prefill():
    """Prompt logprobs: a D holding 64 of the prompt's 100 tokens takes them in push (only the rest moves), so
    the split path is priced with the smaller handoff; were D to prefill the request itself, it would compute
    all 100 tokens."""
    p0, d0 = P.Load("p0", "prefill", num_blocks=100), P.Load("d0", "decode", num_blocks=100, block_size=16)
    plain, whole = P.Ask(100, {"d0": 64}), P.Ask(100, {"d0": 64}, whole=True)
    none = P.Ask(100, {})
    assert P.decode_cost_ms(d0, 120, whole) == P.decode_cost_ms(d0, 120, plain) < P.decode_cost_ms(d0, 120, none)
    a, b, c = (P.path_costs(p0, d0, x, 16) for x in (plain, whole, none))
    assert b.split_ms == a.split_ms < c.split_ms  # the handoff of what D lacks
    assert b.local_ms == c.local_ms > a.local_ms  # D's own prefill: whole


def test_a_run_says_whether_it_reuses_a_prefix():
    from pushkv.config import DeploymentConfig
    from pushkv.router.flow import RequestRun
    from pushkv.router.metrics import RouterMetrics

    cfg, metrics = DeploymentConfig(mode="local"), RouterMetrics("local")
    plain = RequestRun(cfg, None, "a", [1, 2], 2, (), T0, metrics, m.SamplingParams(logprobs=1))
    scored = RequestRun(cfg, None, "b", [1, 2], 2, (), T0, metrics, m.SamplingParams(prompt_logprobs=0))
    assert plain.reuses_prefix and not scored.reuses_prefix
