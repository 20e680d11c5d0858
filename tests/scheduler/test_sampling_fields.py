"""vLLM's bad_words, allowed_token_ids and repetition_penalty in the scheduler: what it bans or sends at each step
(pure), and a request through a scheduler and the real sampler that never completes a banned word."""
from __future__ import annotations

import numpy as np
import pytest

from pushkv import messages as m
from pushkv.scheduler.requests import Request, bad_word_bans
from tests.scheduler.test_scheduler_roles import make
from tests.scheduler.test_scheduler_validate import gen, serve

S = m.SamplingParams


@pytest.mark.parametrize("words, output, banned", [
    (((5,),), [], {5}),  # a one-token word: banned from the first token on (P draws it)
    (((5,),), [1, 2], {5}),
    (((4, 5),), [], set()),  # nothing before it yet
    (((4, 5),), [4], {5}),
    (((4, 5),), [4, 1], set()),  # its first token came, but not last
    (((3, 4, 5),), [9, 3, 4], {5}),
    (((3, 4, 5),), [3, 9, 4], set()),
    (((3, 4, 5),), [4], set()),  # the output is shorter than the word's start
    (((4, 5), (4, 6), (7,)), [4], {5, 6, 7}),
])
def test_a_words_last_token_is_banned_where_the_output_ends_with_the_rest(words, output, banned):
    assert bad_word_bans(words, output) == banned


def req(p: S, output=(), stops=frozenset({9})) -> Request:
    return Request("t", 0, "local", (1, 2), 8, b"r", stop_ids=stops, sampling=p, output=list(output))


def test_sample_fields_suppress_stop_ids_before_min_tokens_and_bad_words_always():
    p = S(min_tokens=2, bad_words=((4, 5), (6,)))
    assert req(p).sample_fields()["suppress"] == (6, 9)
    assert req(p, [4]).sample_fields()["suppress"] == (5, 6, 9)
    assert req(p, [4, 4]).sample_fields()["suppress"] == (5, 6)  # min_tokens reached: stops free again
    assert req(S()).sample_fields()["suppress"] == ()


def test_bans_that_would_leave_no_allowed_token_are_lifted_for_that_step():
    """Only a multi-token word can do it after the router's checks: after 4, the word (4, 5) bans 5, the one
    allowed id left; the step draws it rather than from nothing."""
    p = S(allowed_token_ids=(5, 9), min_tokens=3, bad_words=((4, 5),))
    assert req(p).sample_fields()["suppress"] == (9,)
    assert req(p, [4]).sample_fields()["suppress"] == (9,)  # the word's ban lifted, the stop's kept
    assert req(S(allowed_token_ids=(9,), min_tokens=3)).sample_fields()["suppress"] == ()  # not via the router


def test_a_scheduled_request_never_completes_a_bad_word_and_keeps_to_its_allowed_ids():
    s, wire = make("local", mode="local", tp=1, num_blocks=64)
    free = serve(s, wire, [gen("free", None, max_tokens=8)])["free"]
    a, b = free[2], free[3]
    word_s, word_w = make("local", mode="local", tp=1, num_blocks=64)
    got = serve(word_s, word_w, [gen("word", S(bad_words=((a, b),)), max_tokens=8),
                                 gen("one", S(bad_words=((free[0],),)), max_tokens=8),
                                 gen("only", S(allowed_token_ids=(17, 18, 19), temperature=1.0, seed=3), max_tokens=8)])
    word, one, only = got["word"], got["one"], got["only"]
    assert len(word) == len(one) == len(only) == 8
    assert word != free and all((x, y) != (a, b) for x, y in zip(word, word[1:]))
    assert free[0] not in one and one != free
    assert set(only) <= {17, 18, 19}


def _ids(packed: bytes) -> list[int]:
    return np.frombuffer(packed, dtype="<i4").tolist()


def test_repetition_penalty_sends_the_prompts_and_outputs_distinct_ids():
    """Packed: the prompt's distinct ids sorted, then each output id as it first comes."""
    r = Request("t", 0, "local", (7, 3, 7, 5), 8, b"r", sampling=S(repetition_penalty=1.2))
    assert _ids(r.sample_fields()["seen"]) == [3, 5, 7]
    r.output += [9, 3, 1]
    assert _ids(r.sample_fields()["seen"]) == [3, 5, 7, 9, 1]
    r.output.append(9)
    assert _ids(r.sample_fields()["seen"]) == [3, 5, 7, 9, 1]
    assert req(S()).sample_fields()["seen"] == b""  # off: nothing sent
