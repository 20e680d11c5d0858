"""Fuzz every wire decoder and the HTTP request parser (hypothesis).

Whatever bytes arrive, a decoder either returns a member of its channel's union
or raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (what the actor
loop counts as ``bad_frame``); the router's parser raises only ``ApiError``
(a 4xx). Every message type round-trips through the decoder of each channel
that carries it.
"""
from __future__ import annotations

import json
import typing

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv import messages as m
from pushkv.router import api, text
from pushkv.supervisor import commands as c

pytestmark = pytest.mark.timeout(120)

DECODERS = {f"m.{k}": v for k, v in vars(m).items() if k.startswith("DEC_")}
DECODERS.update({f"c.{k}": v for k, v in vars(c).items() if k.startswith("DEC_")})
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def members(dec: msgspec.msgpack.Decoder) -> tuple[type, ...]:
    t = dec.type
    return typing.get_args(t) if typing.get_origin(t) is typing.Union else (t,)


def tags(dec) -> list[str]:
    return [mi.type_info(t).tag for t in members(dec)]


def decode_or_reject(dec, payload: bytes) -> None:
    try:
        msg = dec.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    assert isinstance(msg, members(dec)), type(msg)


# ---------------------------------------------------------------------------
# strategies: arbitrary msgpack values, and values shaped like our messages
# ---------------------------------------------------------------------------
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=30,
)


def tagged(dec):
    """Arrays that start with a real tag of the channel: reach field validation."""
    return st.tuples(st.sampled_from(tags(dec)), st.lists(values, max_size=10)).map(lambda t: [t[0], *t[1]])


def for_type(t) -> st.SearchStrategy:
    """A strategy of valid instances of a msgspec type (from msgspec.inspect)."""
    if isinstance(t, mi.IntType):
        return st.integers(-(2**63), 2**63 - 1)
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(t, mi.StrType):
        return st.text(max_size=16)
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=32)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.VarTupleType):
        return st.lists(for_type(t.item_type), max_size=6).map(tuple)
    if isinstance(t, mi.TupleType):
        return st.tuples(*[for_type(x) for x in t.item_types])
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType)):
        return st.lists(for_type(t.item_type), max_size=6).map(type_of(t))
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.DictType):
        return st.dictionaries(for_type(t.key_type), for_type(t.value_type), max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of([for_type(x) for x in t.types])
    if isinstance(t, mi.StructType):
        return st.builds(t.cls, **{f.name: for_type(f.type) for f in t.fields})
    raise NotImplementedError(f"no strategy for {t!r}")


def type_of(t):
    return {mi.ListType: list, mi.SetType: set, mi.FrozenSetType: frozenset}[type(t)]


CHANNEL_TYPES = [(name, typ) for name, dec in DECODERS.items() for typ in members(dec)]


# ---------------------------------------------------------------------------
# decoders
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(payload=st.binary(max_size=256))
def test_random_bytes_only_raise_decode_errors(name, payload):
    decode_or_reject(DECODERS[name], payload)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.data())
def test_random_msgpack_only_raises_decode_errors(name, data):
    dec = DECODERS[name]
    value = data.draw(values | tagged(dec))
    decode_or_reject(dec, msgspec.msgpack.encode(value))


@pytest.mark.parametrize("name,typ", CHANNEL_TYPES, ids=[f"{n}-{t.__name__}" for n, t in CHANNEL_TYPES])
@FUZZ
@given(data=st.data())
def test_round_trip_through_channel_decoder(name, typ, data):
    msg = data.draw(for_type(mi.type_info(typ)))
    wire = m.encode(msg)
    back = DECODERS[name].decode(wire)
    assert back == msg
    assert m.encode(back) == wire


@pytest.mark.parametrize("name,typ", CHANNEL_TYPES, ids=[f"{n}-{t.__name__}" for n, t in CHANNEL_TYPES])
@FUZZ
@given(data=st.data())
def test_mutated_valid_frames_only_raise_decode_errors(name, typ, data):
    """Truncated or bit-flipped real frames: decoded cleanly or refused."""
    wire = bytearray(m.encode(data.draw(for_type(mi.type_info(typ)))))
    cut = data.draw(st.integers(0, len(wire)))
    decode_or_reject(DECODERS[name], bytes(wire[:cut]))
    if wire:
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] ^= 1 << data.draw(st.integers(0, 7))
        decode_or_reject(DECODERS[name], bytes(wire))


def test_deep_nesting_is_refused_not_crashing():
    for name, dec in DECODERS.items():
        tag = tags(dec)[0]
        deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
        decode_or_reject(dec, deep)
        # a real tag, then a deeply nested first field
        decode_or_reject(dec, b"\x92" + msgspec.msgpack.encode(tag) + b"\x91" * 50_000 + b"\xc0")


def test_every_wire_type_is_on_some_channel():
    on_channel = {typ for _, typ in CHANNEL_TYPES}
    declared = {v for v in vars(m).values() if isinstance(v, type) and issubclass(v, m.Msg) and v is not m.Msg}
    assert declared <= on_channel, sorted(t.__name__ for t in declared - on_channel)


# ---------------------------------------------------------------------------
# the router's request parser: any JSON in, a CompletionParams or an ApiError out
# ---------------------------------------------------------------------------
LIMITS = api.Limits(vocab_size=320, max_model_len=1024)
TOK = text.ByteTokenizer()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids, max_size=6),
    max_leaves=40,
)
FIELDS = ["prompt", "max_tokens", "stream", "temperature", "n", "stop_token_ids", "ignore_eos", "model"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values | st.lists(st.integers(-5, 400), max_size=40),
                         max_size=len(FIELDS))


def parse(raw: bytes):
    try:
        body = api.parse_json(raw)
        return api.parse_completion(body, TOK, LIMITS)
    except api.ApiError as e:
        assert 400 <= e.status < 500 and e.message
        return None


@FUZZ
@given(raw=st.binary(max_size=200))
def test_parser_random_bytes(raw):
    parse(raw)


@FUZZ
@given(body=bodies)
def test_parser_random_fields(body):
    p = parse(json.dumps(body, allow_nan=True).encode())
    if p is not None:  # accepted: within every limit the schedulers check again
        assert p.prompt_token_ids and all(0 <= t < LIMITS.vocab_size for t in p.prompt_token_ids)
        assert 1 <= p.max_tokens and len(p.prompt_token_ids) + p.max_tokens <= LIMITS.max_model_len


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud800", "max_tokens": 1}',  # lone surrogate: valid JSON, not encodable text
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting past the recursion limit
    b'{"prompt": [1], "max_tokens": 1e400}',
    b'{"prompt": [1], "max_tokens": NaN}',
    "{\"prompt\": \"\u00e9\"}".encode("latin-1"),  # not UTF-8
], ids=["lone-surrogate", "deep-nesting", "inf", "nan", "latin-1"])
def test_parser_edge_cases_are_4xx(raw):
    parse(raw)
