"""The config's closed sets (mode, role, leg, switches) are Literal types: a value outside one is
refused when a config is decoded, built or replaced, with an error naming the field and the
values it allows; the values stay plain strings on the wire and in JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from pushkv import messages as m
from pushkv.config import (
    DeploymentConfig,
    InstanceConfig,
    ModelConfig,
    TransferPlan,
    choices,
    config_from_builtins,
    decode_config,
    encode_config,
)
from tests.support import ROOT

BAD_JSON = [
    # the config as JSON, the path msgspec names, the values the error must list
    ({"mode": "pusj"}, "$.mode", "'push', 'pull', 'local'"),
    ({"pull_read": "read"}, "$.pull_read", "'inline', 'background', 'write'"),
    ({"push_stream": "layers"}, "$.push_stream", "'off', 'chunk', 'layer'"),
    ({"kv_verify": "ful"}, "$.kv_verify", "'off', 'sample', 'full'"),
    ({"writer_warm": "yes"}, "$.writer_warm", "'auto', 'on', 'off'"),
    ({"writer_post_thread": "1"}, "$.writer_post_thread", "'auto', 'on', 'off'"),
    ({"link_order": "fifo"}, "$.link_order", "'arrival', 'shortest', 'deadline'"),
    ({"host_role": "both"}, "$.host_role", "'', 'router', 'prefill', 'decode'"),
    ({"prefill": {"role": "prefil"}}, "$.prefill.role", "'prefill', 'decode', 'local'"),
    ({"decodes": [{"role": "decode"}, {"role": "d"}]}, "$.decodes[1].role", "'prefill', 'decode', 'local'"),
    ({"model": {"engine": "fast"}}, "$.model.engine", "'auto', 'batched', 'per-seq'"),
]


@pytest.mark.parametrize("data, path, allowed", BAD_JSON, ids=[p for _, p, _ in BAD_JSON])
def test_a_bad_value_is_refused_at_decode(data, path, allowed):
    for decode in (lambda: decode_config(json.dumps(data)), lambda: config_from_builtins(data)):
        with pytest.raises(msgspec.ValidationError) as e:
            decode()
        assert path in str(e.value) and allowed in str(e.value), str(e.value)


@pytest.mark.parametrize("build, field", [
    (lambda: DeploymentConfig(mode="both"), "DeploymentConfig.mode"),
    (lambda: msgspec.structs.replace(DeploymentConfig(), push_stream="on"), "DeploymentConfig.push_stream"),
    (lambda: InstanceConfig(role="router"), "InstanceConfig.role"),
    (lambda: ModelConfig(random_init="gpu"), "ModelConfig.random_init"),
])
def test_a_bad_value_is_refused_when_built(build, field):
    with pytest.raises(ValueError, match=f"{field}: .* is not one of"):
        build()


def test_values_stay_strings_on_the_wire():
    cfg = DeploymentConfig(mode="pull", pull_read="inline", kv_verify="full", decode=InstanceConfig(role="decode"))
    raw = json.loads(encode_config(cfg))
    assert (raw["mode"], raw["pull_read"], raw["kv_verify"], raw["decode"]["role"]) == ("pull", "inline", "full",
                                                                                        "decode")
    assert decode_config(encode_config(cfg)) == cfg
    gen = m.Generate("t", 0, "decode", (1, 2), 4)
    assert msgspec.msgpack.decode(m.encode(gen))[3] == "decode"
    assert m.DEC_ROUTER_TO_SCHED.decode(m.encode(gen)) == gen


def test_a_message_with_a_bad_leg_is_refused_at_decode():
    frame = msgspec.msgpack.encode(["Generate", "t", 0, "bogus", [1, 2], 4])
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'bogus'"):
        m.DEC_ROUTER_TO_SCHED.decode(frame)


def test_every_closed_field_is_typed():
    """The fields compared against fixed strings across the code are Literals (so mypy's
    strict_equality checks each comparison)."""
    assert set(choices(DeploymentConfig)) == {"mode", "pull_read", "push_stream", "kv_verify", "writer_warm",
                                              "writer_post_thread", "host_role", "link_order", "staging",
                                              "reasoning_parser", "tool_call_parser"}
    assert set(choices(InstanceConfig)) == {"role"}
    assert set(choices(ModelConfig)) == {"engine", "random_init"}
    assert set(choices(m.Generate)) == {"leg"}
    assert set(choices(TransferPlan)) == {"stream", "direction"}


# message -> its closed fields, and the values each allows
CLOSED_MESSAGE_FIELDS = [
    (m.KVSent, {"rendezvous": ("", "registration_first", "prefill_first", "pull", "replica"),
                "stream": ("", "chunk", "layer", "fallback")}),
    (m.KVTransferStats, {"rendezvous": ("", "registration_first", "prefill_first", "pull", "replica")}),
    (m.TokensGenerated, {"finish_reason": ("", "length", "stop")}),
    (m.PoolHandle, {"kind": ("shm", "cuda_ipc")}),
    (m.Generate, {"leg": ("prefill", "decode", "local")}),
]


@pytest.mark.parametrize("cls, fields", CLOSED_MESSAGE_FIELDS, ids=[c.__name__ for c, _ in CLOSED_MESSAGE_FIELDS])
def test_every_closed_message_field_is_typed(cls, fields):
    assert choices(cls) == fields


@pytest.mark.parametrize("decoder, frame", [
    # a fallback's why is the plan's to say, not the message's
    (m.DEC_WRITER_TO_SCHED, ["KVSent", "t", 0, 1, 1, 0.0, "", [], 0, "fallback: sliding-window layers"]),
    (m.DEC_WRITER_TO_SCHED, ["KVSent", "t", 0, 1, 1, 0.0, "registration-first"]),
    (m.DEC_SCHED_TO_ROUTER, ["TokensGenerated", "t", 0, [1], True, "eos"]),
], ids=["stream", "rendezvous", "finish_reason"])
def test_a_message_with_a_value_outside_its_set_is_refused_at_decode(decoder, frame):
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value"):
        decoder.decode(msgspec.msgpack.encode(frame))


def test_mypy_refuses_a_misspelt_comparison(tmp_path):
    """strict_equality (pyproject.toml) with the Literal fields: ``cfg.mode == "pusj"`` is an error."""
    pytest.importorskip("mypy")
    src = tmp_path / "misspelt.py"
    src.write_text("from pushkv.config import DeploymentConfig\n\n\n"
                   "def pushes(cfg: DeploymentConfig) -> bool:\n    return cfg.mode == \"pusj\"\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml"),
                        "--cache-dir", os.devnull, "--follow-imports", "silent", str(src)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Non-overlapping equality check" in r.stdout and "pusj" in r.stdout, r.stdout
