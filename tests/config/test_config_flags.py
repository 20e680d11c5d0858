"""``pushkv up``'s flags -> the user's config (pushkv.config_flags), table-driven per mode; the
user's config holds no planned field, and planning adds only planned fields to it."""
from __future__ import annotations

import pytest

from processes import cli
from pushkv.config import (PLANNED_FIELDS, PLANNED_INSTANCE_FIELDS, TRACE_AUTO, DeploymentConfig, preset,
                           unplanned)
from pushkv.config_flags import user_config
from pushkv.supervisor.plan import plan_deployment


def from_argv(*flags: str) -> DeploymentConfig:
    return user_config(vars(cli.build_parser().parse_args(["up", *flags])))


CASES = [
    # id, flags, {dotted field: value}
    ("defaults", (), {"mode": "push", "push_stream": "layer", "kv_verify": "sample", "model": preset("small"),
                      "prefill.tp": 1, "decode.device": "cpu", "writer_warm": "auto"}),
    ("push", ("--mode", "push", "--push-stream", "chunk", "--prefill-chunk", "64", "--push-stream-groups", "2"),
     {"mode": "push", "push_stream": "chunk", "push_stream_groups": 2, "prefill.prefill_chunk": 64,
      "decode.prefill_chunk": 64}),
    ("push-tp", ("--model", "tiny", "--prefill-tp", "2", "--decode-tp", "1", "--device", "cuda:0",
                 "--decode-device", "cuda:2", "--block-size", "32", "--decode-block-size", "16"),
     {"model": preset("tiny"), "prefill.tp": 2, "decode.tp": 1, "prefill.device": "cuda:0",
      "decode.device": "cuda:2", "prefill.block_size": 32, "decode.block_size": 16, "local.block_size": 32}),
    ("pull", ("--mode", "pull", "--pull-read", "inline", "--kv-verify", "off"),
     {"mode": "pull", "pull_read": "inline", "kv_verify": "off"}),
    ("pull-write", ("--mode", "pull", "--pull-read", "write", "--writer-warm", "off", "--writer-post-thread", "on"),
     {"mode": "pull", "pull_read": "write", "writer_warm": "off", "writer_post_thread": "on"}),
    ("link-queue", ("--link-window", "2", "--link-window-mib", "64", "--link-order", "shortest"),
     {"link_window": 2, "link_window_mib": 64, "link_order": "shortest"}),
    ("local", ("--mode", "local", "--tp", "2", "--num-blocks", "64", "--no-prefix-cache", "--engine", "per-seq"),
     {"mode": "local", "local.tp": 2, "local.num_blocks": 64, "local.prefix_cache": False,
      "prefill.prefix_cache": False, "model.engine": "per-seq"}),
    ("geometry", ("--model", "tiny", "--num-layers", "3", "--dtype", "bfloat16", "--batch-invariant", "off"),
     {"model": preset("tiny", num_layers=3, dtype="bfloat16", deterministic=False)}),
    ("xpyd", ("--prefill-instances", "2", "--decode-instances", "3", "--router-queue", "9", "--conditional-disagg"),
     {"prefill_instances": 2, "decode_instances": 3, "router_queue": 9, "conditional_disagg": True,
      "prefills": ()}),
    ("trace", ("--trace",), {"trace_endpoint": TRACE_AUTO, "trace_tap_endpoint": ""}),
    ("trace-at", ("--trace", "ipc:///x/tap.sock"), {"trace_endpoint": TRACE_AUTO,
                                                     "trace_tap_endpoint": "ipc:///x/tap.sock"}),
    ("router-host", ("--role", "router", "--registry", "etcd://h:2379", "--advertise", "10.0.0.9",
                     "--registry-ttl", "7"),
     {"host_role": "router", "registry": "etcd://h:2379", "advertise": "10.0.0.9", "host": "10.0.0.9",
      "registry_ttl_s": 7}),
    ("router-host-own-host", ("--role", "router", "--advertise", "10.0.0.9", "--host", "0.0.0.0"),
     {"host": "0.0.0.0"}),
    ("served-names", ("--served-model-name", "a", "b", "--log-level", "debug"),
     {"served_model_name": ("a", "b"), "log_level": "DEBUG"}),
]


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("flags, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_flags_to_user_config(flags, want):
    cfg = from_argv(*flags)
    assert {k: _get(cfg, k) for k in want} == want
    assert unplanned(cfg) == cfg  # flags never set a planned field


def test_a_flag_left_out_is_the_default():
    """The mapping reads the flags it is given: a mapping with only some of them (no parser) is fine."""
    assert user_config({}) == DeploymentConfig()
    assert user_config({"mode": "pull", "pull_read": "inline"}) == DeploymentConfig(mode="pull", pull_read="inline")


def test_file_then_flags(tmp_path):
    f = tmp_path / "d.json"
    f.write_text('{"mode": "pull", "pull_read": "write", "model": "tiny", "decode": {"num_blocks": 7}}')
    cfg = from_argv("--config", str(f), "--pull-read", "background")
    assert (cfg.mode, cfg.pull_read, cfg.model, cfg.decode.num_blocks) == ("pull", "background", preset("tiny"), 7)


def test_a_bad_file_value_names_the_field(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('mode = "pull"\n[decode]\nrole = "prefil"\n')
    with pytest.raises(Exception, match=r"\$\.decode\.role.*'prefill', 'decode', 'local'"):
        from_argv("--config", str(f))


@pytest.mark.parametrize("flags", [(), ("--mode", "pull"), ("--mode", "local"), ("--decode-instances", "2")])
def test_planning_adds_only_planned_fields(flags):
    user = from_argv("--model", "tiny", *flags)
    ports = iter(range(20000, 21000))
    planned = plan_deployment(user, pick_port=lambda: next(ports), run_root="/tmp/x")
    assert planned.deployment_id and planned.run_dir and planned.control_endpoint
    assert all(i.engine_id and i.sched_endpoint and i.handshake_endpoints for i in planned.instances())
    assert unplanned(planned) == user
    assert set(PLANNED_FIELDS) <= set(DeploymentConfig.__struct_fields__)
    assert all(f in planned.prefill.__struct_fields__ for f in PLANNED_INSTANCE_FIELDS)


@pytest.mark.parametrize("flags, mode, said", [
    ({"pull_read": "write"}, "push", ["--pull-read has no effect with --mode push (only --mode pull reads it)"]),
    ({"push_stream": "chunk", "push_stream_groups": 2}, "pull",
     ["--push-stream has no effect with --mode pull (only --mode push reads it)",
      "--push-stream-groups has no effect with --mode pull (only --mode push reads it)"]),
    ({"kv_verify": "full", "link_window": 1}, "local",
     ["--kv-verify has no effect with --mode local (no KV moves between instances)",
      "--link-window has no effect with --mode local (no KV moves between instances)"]),
    ({"pull_read": "write", "kv_verify": "full", "link_order": "arrival"}, "pull", []),
    ({"push_stream": "layer", "writer_post_thread": "on"}, "push", []),
    ({"pull_read": None, "push_stream": None}, "pull", []),
])
def test_a_transfer_flag_the_mode_never_reads_is_said(flags, mode, said):
    from pushkv.config_flags import unused_by_mode
    assert unused_by_mode(flags, mode) == said


def test_every_mode_flag_is_a_flag_of_up():
    from pushkv.config_flags import _MODE_FLAGS
    args = cli.build_parser().parse_args(["up"])
    assert set(_MODE_FLAGS) <= set(vars(args))
    assert all(getattr(args, k) is None for k in _MODE_FLAGS)  # not given: nothing said


@pytest.mark.parametrize("file, needle", [
    ({"decode": {"max_num_seqs": 0}}, r"decode instance: max_num_seqs \(--max-num-seqs\) must be >= 1, got 0"),
    ({"prefill": {"max_batch_tokens": 0}}, r"prefill instance: max_batch_tokens \(--max-batch-tokens\) must be >= 1"),
    ({"mode": "local", "local": {"max_num_seqs": 0}}, r"local instance: max_num_seqs .* must be >= 1, got 0"),
    ({"model": {"name": "tiny", "dtype": "int8"}}, r"model dtype 'int8' unsupported"),
    ({"model": "tiny", "decode": {"tp": 3}}, r"decode instance: tp=3 cannot shard model 'tiny': num_heads=4"),
    ({"chat_template": "{% if %}"}, r"chat template 'chat_template \(--config .*d.json\)' does not compile"),
    ({"chat_template": "no/such/template.jinja"},
     r"chat_template \(--config .*d.json\) 'no/such/template.jinja': no such file, and not a Jinja template either"),
    ({"kv_events": {"enable_kv_cache_events": True, "endpoint": "http://x:1"}},
     r"kv_events \(--config .*d.json\) endpoint 'http://x:1': a ZeroMQ endpoint"),
    ({"kv_events": {"buffer_steps": 0}}, r"kv_events \(--config .*d.json\) buffer_steps 0 must be >= 1"),
])
def test_a_config_file_is_refused_where_the_flags_are(tmp_path, file, needle):
    """What ``pushkv up`` refuses from a flag (a zero step size, an unknown dtype, a TP size the heads do not split
    into, a chat template that does not compile or is no file, a KV-events endpoint no socket takes) is refused from
    a ``--config`` file too, per side and per instance, before anything starts: the file's chat template and KV-events
    settings went unchecked to the router and the schedulers."""
    import json

    f = tmp_path / "d.json"
    f.write_text(json.dumps(file))
    ports = iter(range(20000, 21000))
    with pytest.raises(ValueError, match=needle):
        plan_deployment(from_argv("--config", str(f)), pick_port=lambda: next(ports), run_root=str(tmp_path))


def test_a_config_files_chat_template_is_read_as_the_flags_is(tmp_path):
    """A file's chat_template may be the template or its file's path, as --chat-template: the text is what travels."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    f = tmp_path / "d.json"
    f.write_text(f'{{"chat_template": "{template}"}}')
    assert from_argv("--config", str(f)).chat_template == template.read_text()
    f.write_text('{"chat_template": "{{ messages }}"}')
    assert from_argv("--config", str(f)).chat_template == "{{ messages }}"
