"""Random valid-shaped messages sent straight to a scheduler (hypothesis), driven by plain calls
with a worker that runs the real sampler.

Each message decodes (it went through the wire's encoder and decoder) but its values are
anything: ids outside the vocabulary or negative, NaN and infinite floats, huge counts, wrong
legs, stale generations, aborts and writer answers for any of them. Checked: no handler
raises; every id a step hands the worker is one it can index (the worker here refuses the
step otherwise); the requests that were there first (greedy, and sampled with logprobs) get
exactly the tokens and log-probabilities they get alone; every block comes back.
"""
from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv import messages as m
from pushkv.model import scoring
from pushkv.model.sampling import sample
from tests.scheduler.test_scheduler_roles import P_SRC, ROUTER, all_free, deliver, make
from tests.scheduler.test_scheduler_validate import VOCAB, logits_of

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
TIDS = ["a", "b", "c", "d", "e", "f", "g", ""]  # few, so aborts and writer answers find the requests they name
VICTIMS = [m.Generate("victim-greedy-0123456789", 0, "", (11, 12, 13, 14), 8),
           m.Generate("victim-sampled-0123456789", 0, "", (21, 22, 23), 8,
                      sampling=m.SamplingParams(temperature=0.9, seed=77, logprobs=2))]
VICTIM_FIRST = 42  # D: the first token P's writer reports for a victim

# A request is drawn valid, then 0-2 of its fields are drawn from everything the wire can carry:
# it is often admitted, and its one bad value has a step to spoil.
EDGE_INTS = [-1, -2, VOCAB, VOCAB + 1, -(2**63), 2**63 - 1, 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 5e-324, -1.0, 1.5, 100.0, 1e9, math.nan, math.inf, -math.inf]
vocab_id = st.integers(0, VOCAB - 1)
ids = vocab_id | vocab_id | vocab_id | st.sampled_from(EDGE_INTS)
wild_int = st.sampled_from(EDGE_INTS) | st.integers(-3, 30)
wild_float = st.sampled_from(EDGE_FLOATS) | st.floats(-3, 3)
wild_ids = st.lists(ids, max_size=6).map(tuple)
wild_bias = st.lists(st.tuples(ids, wild_float), max_size=6).map(tuple)

SAMPLING = {  # field: (valid, wild)
    "temperature": (st.sampled_from([0.0, 0.5, 1.0, 1.7]), wild_float),
    "top_p": (st.sampled_from([1.0, 0.9, 0.3]), wild_float),
    "top_k": (st.sampled_from([0, 1, 5, VOCAB, 2 * VOCAB]), wild_int),
    "min_p": (st.sampled_from([0.0, 0.05, 0.5]), wild_float),
    "seed": (st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**64 - 1)),
    "presence_penalty": (st.floats(-2, 2), wild_float),
    "frequency_penalty": (st.floats(-2, 2), wild_float),
    "logit_bias": (st.lists(st.tuples(vocab_id, st.floats(-100, 100)), max_size=4, unique_by=lambda x: x[0])
                   .map(tuple), wild_bias),
    "logprobs": (st.integers(-1, 5), wild_int),
    "min_tokens": (st.integers(0, 1), wild_int),
    "prompt_logprobs": (st.integers(-1, 3), wild_int),
    "allowed_token_ids": (st.lists(vocab_id, max_size=4, unique=True).map(tuple), wild_ids),
    "bad_words": (st.lists(st.lists(vocab_id, min_size=1, max_size=3).map(tuple), max_size=3).map(tuple),
                  st.lists(wild_ids, max_size=3).map(tuple)),
    "repetition_penalty": (st.sampled_from([1.0, 1.05, 1.5]), wild_float),
}
GENERATE = {
    "generation": (st.integers(0, 2), st.integers(-1, 2)),
    "prompt_token_ids": (st.lists(vocab_id, min_size=1, max_size=10).map(tuple), wild_ids),
    "max_tokens": (st.integers(1, 8), wild_int),
    "stop_token_ids": (st.lists(vocab_id, max_size=3).map(tuple), wild_ids),
    "pull": (st.none(), st.builds(m.PullParams, st.just(P_SRC), wild_ids, wild_int, ids, wild_float)),
    "late": (st.booleans(), st.booleans()),
    "cache_salt": (st.sampled_from(["", "a", "b"]), st.text(max_size=3) | st.just("x" * 300)),
}


@st.composite
def fields(draw, table: dict) -> dict:
    wild = set(draw(st.lists(st.sampled_from(sorted(table)), max_size=2)))
    return {k: draw(table[k][k in wild]) for k in sorted(table)}


@st.composite
def generate(draw, role: str):
    sampling = m.SamplingParams(**draw(fields(SAMPLING))) if draw(st.integers(0, 3)) else None
    return m.Generate(draw(st.sampled_from(TIDS)), leg=draw(st.sampled_from([role] * 6 + ["local", "x"])),
                      source=P_SRC if role == "decode" else None, sampling=sampling, **draw(fields(GENERATE)))


def router_msgs(role: str):
    tid, gen = st.sampled_from(TIDS), st.integers(-1, 2)
    return st.one_of(generate(role), generate(role),
                     st.builds(m.Abort, tid, gen, st.text(max_size=4)), st.just(m.GetStats()),
                     st.builds(m.PeerLost, st.text(max_size=4), st.sampled_from(["prefill", "decode"]),
                               st.text(max_size=4)))


def writer_msgs():
    tid, gen = st.sampled_from(TIDS), st.integers(-1, 2)
    return st.one_of(st.builds(m.KVReceived, tid, gen, ids, wild_int, wild_int, wild_float),
                     st.builds(m.KVFailed, tid, gen, st.text(max_size=4), st.text(max_size=4)),
                     st.builds(m.KVSent, tid, gen, wild_int, wild_int, wild_float))


def wire_trip(msg, dec):
    """What the scheduler would receive had ``msg`` crossed the wire (None: not encodable, or
    refused when decoded, as a leg outside messages.Role is: no handler sees it)."""
    try:
        return dec.decode(m.encode(msg))
    except (OverflowError, msgspec.EncodeError, msgspec.ValidationError):
        return None


def strict_step(s, wire) -> None:
    """The worker: every id it is handed must index its tables (as an embedding or a scatter
    would), and the real sampler runs on each sequence's own logits."""
    (step,) = [x for x in wire.take("worker") if isinstance(x, m.ExecuteStep)]
    for w in step.seqs:
        p = w.sampling or m.SamplingParams()
        ids = list(w.token_ids) + list(w.history) + list(w.suppress) + [t for t, _ in p.logit_bias]
        assert all(0 <= t < VOCAB for t in ids), w
        assert all(0 <= b < s.alloc.num_blocks for b in w.block_table), w
    seqs = [w for w in step.seqs if w.sample]
    out = sample(torch.stack([logits_of(w) for w in seqs]), seqs) if seqs else None
    plan = scoring.plan(step.seqs)  # the prompt chunks that asked: scored from rows of the same logits
    assert all(0 <= t < VOCAB and 0 <= k <= 20 for t in plan.targets for _, _, k in plan.seqs), plan
    rows = torch.stack([logits_of(m.SeqWork(0, (t,), i, ())) for i, t in enumerate(plan.targets)]) \
        if plan.targets else None
    answer = m.StepDone(step.step_id, tuple(out.tokens) if out else (), logprobs=out.logprobs if out else (),
                        prompt_logprobs=scoring.score(rows, lambda h: h, plan))
    for ch in s.workers:
        deliver(s, ch, answer)


def pending_step(wire) -> bool:
    return any(isinstance(x, m.ExecuteStep) for _, x in wire.sent)


def start_victims(s, wire, role: str) -> None:
    for v in VICTIMS:
        v = msgspec.structs.replace(v, leg=role, source=P_SRC if role == "decode" else None)
        deliver(s, ROUTER, v)
    if role == "decode":
        wire.take("writer")
        for v in VICTIMS:
            for ch in s.writers:
                deliver(s, ch, m.KVReceived(v.transfer_id, 0, VICTIM_FIRST))


def finish(s, wire) -> None:
    """Run every step, then end what still waits for writers (abort it, the writers answer)."""
    while pending_step(wire):
        strict_step(s, wire)
    for r in list(s.reqs.values()):
        deliver(s, ROUTER, m.Abort(r.transfer_id, r.generation))
        for ch in s.writers:
            deliver(s, ch, m.KVFailed(r.transfer_id, r.generation, "cancelled"))
    while pending_step(wire):
        strict_step(s, wire)


def victim_outputs(wire) -> dict[str, list]:
    out: dict[str, list] = {}
    for x in wire.take("router"):
        if x.transfer_id.startswith("victim"):
            out.setdefault(x.transfer_id, []).append(x if isinstance(x, m.RequestFailed) else
                                                     (x.token_ids, x.logprobs, x.finished, x.finish_reason))
    return out


BASELINE: dict[str, dict] = {}


def baseline(role: str) -> dict:
    if role not in BASELINE:
        s, wire = make(role, mode="local" if role == "local" else "push", tp=1, num_blocks=64)
        start_victims(s, wire, role)
        finish(s, wire)
        BASELINE[role] = victim_outputs(wire)
        assert sorted(BASELINE[role]) == sorted(v.transfer_id for v in VICTIMS)
        assert all(sum(len(x[0]) for x in v) == 8 for v in BASELINE[role].values())
    return BASELINE[role]


@pytest.mark.parametrize("role", ["local", "decode"])
@FUZZ
@given(data=st.data())
def test_random_messages_change_no_other_requests_tokens(role, data):
    want = baseline(role)
    s, wire = make(role, mode="local" if role == "local" else "push", tp=1, num_blocks=64)
    start_victims(s, wire, role)
    for _ in range(data.draw(st.integers(1, 10))):
        if role == "decode" and data.draw(st.booleans()):
            msg, ch = wire_trip(data.draw(writer_msgs()), m.DEC_WRITER_TO_SCHED), s.writers[0]
        else:
            msg, ch = wire_trip(data.draw(router_msgs(role)), m.DEC_ROUTER_TO_SCHED), ROUTER
        if msg is not None:
            deliver(s, ch, msg)
        for x in wire.take("writer"):  # D: the KV of what it admitted arrives, with any first token
            if isinstance(x, (m.ExpectKV, m.ReadKV)) and data.draw(st.booleans()):
                deliver(s, s.writers[0], m.KVReceived(x.transfer_id, x.generation, data.draw(ids)))
        if pending_step(wire) and data.draw(st.booleans()):
            strict_step(s, wire)  # the fuzzed requests share steps with the victims
    finish(s, wire)
    assert victim_outputs(wire) == want
    assert all_free(s)
