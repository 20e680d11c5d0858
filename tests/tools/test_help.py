"""A help that reads: `pushkv --help` puts the deployment commands first and groups the tools;
every flag of `pushkv up` has a help line that shows its default, and the defaults shown are
what an `up` without the flag runs."""
from __future__ import annotations

import argparse

import pytest

from processes import cli as deployment
from pushkv import up_help
from pushkv.cuda_driver import device_count as cuda_device_count
from tools import cli


def up_parser() -> argparse.ArgumentParser:
    sub = next(a for a in deployment.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["up"]


def test_no_up_flag_lacks_help_or_default():
    missing = [a.option_strings[-1] for a in up_parser()._actions
               if not isinstance(a, argparse._HelpAction) and (not a.help or "default" not in a.help)]
    assert missing == []


def test_up_help_renders():
    text = up_parser().format_help()  # a % in a help line would raise here
    assert "--mode {push,pull,local}" in text and "(default: push)" in text


# (flag's dest, what the unflagged config says): the shown default is the one that runs
RUNS = {
    "mode": lambda c: c.mode, "port": lambda c: c.port, "host": lambda c: c.host,
    "block_size": lambda c: c.prefill.block_size,
    "max_num_seqs": lambda c: c.prefill.max_num_seqs, "max_batch_tokens": lambda c: c.prefill.max_batch_tokens,
    "prefill_chunk": lambda c: c.prefill.prefill_chunk,
    "gpu_memory_utilization": lambda c: c.gpu_memory_utilization,
    "tensor_parallel_size": lambda c: c.prefill.tp, "prefill_instances": lambda c: c.prefill_instances,
    "router_queue": lambda c: c.router_queue, "max_in_flight": lambda c: c.router_max_in_flight,
    "registry_ttl": lambda c: c.registry_ttl_s, "metrics_port": lambda c: c.metrics_port,
    "seed": lambda c: c.model.seed, "engine": lambda c: c.model.engine, "pull_read": lambda c: c.pull_read,
    "link_order": lambda c: c.link_order, "log_level": lambda c: c.log_level,
}


@pytest.mark.parametrize("dest", sorted(RUNS))
def test_shown_default_is_what_runs(dest):
    cfg = deployment.config_from_args(deployment.build_parser().parse_args(["up"]))
    shown = up_help.defaults()[dest]
    assert str(shown) == str(RUNS[dest](cfg))
    (action,) = [a for a in up_parser()._actions if a.dest == dest]
    # the default appended, or the flag's own help saying it ("0 (default) = ...", "(default 1024)")
    assert action.help.endswith(f"(default: {shown})") or str(shown) in action.help, action.help


def test_shown_device_and_pool_defaults_are_what_runs_on_this_host():
    """The device and the pool's size depend on the host: CUDA and a pool sized from memory where
    the driver shows a GPU, the CPU and 2048 blocks where not; the help says both."""
    cfg = deployment.config_from_args(deployment.build_parser().parse_args(["up"]))
    on_gpu = cuda_device_count()[0] > 0
    assert (cfg.prefill.device, cfg.decode.num_blocks) == (("cuda", 0) if on_gpu else ("cpu", 2048))
    helps = {a.dest: a.help for a in up_parser()._actions}
    assert helps["device"].endswith("(default: cuda where the driver shows a GPU, else cpu)")
    assert helps["num_blocks"].endswith("(default: sized from --gpu-memory-utilization on CUDA, 2048 on cpu)")


def test_top_level_help_lists_deployment_commands_first_then_every_tool_in_one_group():
    text = cli.build_parser().format_help()
    first_tool = text.index("tools (pushkv TOOL --help")
    assert all(text.index(f"    {c} ") < first_tool for c in ("up", "status", "stop"))
    grouped = [n for names in cli.GROUPS.values() for n in names]
    assert sorted(grouped) == sorted(cli.TOOLS)  # every tool, each once
    for name in cli.TOOLS:
        assert f"\n    {name} " in text[first_tool:] or f"\n    {name}\n" in text[first_tool:], name


UP_GROUPS = ["deployment", "model", "parallelism", "memory", "transfer", "routing", "security", "hosts",
             "vllm serve", "supervision"]


def test_up_flags_are_grouped_by_topic_in_order():
    up = up_parser()
    groups = {g.title: [a.option_strings[-1] if a.option_strings else a.dest for a in g._group_actions]
              for g in up._action_groups}
    assert groups["options"] == ["--help"]  # every flag of up sits in a topic
    assert [t for t in groups if t in UP_GROUPS] == UP_GROUPS
    assert {"--gpu-memory-utilization", "--num-blocks", "--block-size"} <= set(groups["memory"])
    assert {"--tensor-parallel-size", "--device", "--prefill-instances"} <= set(groups["parallelism"])
    assert {"--push-stream", "--link-window", "--kv-verify"} <= set(groups["transfer"])
    assert {"--startup-timeout", "--load-timeout"} <= set(groups["supervision"])
    assert {"model_tag", "--model"} <= set(groups["model"])  # vllm serve MODEL's positional beside --model
    assert {"--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"} <= set(groups["model"])
    assert {"--max-num-batched-tokens", "--enforce-eager", "--speculative-config"} <= set(groups["vllm serve"])
    text = up.format_help()
    assert [text.index(f"\n{t}:") for t in UP_GROUPS] == sorted(text.index(f"\n{t}:") for t in UP_GROUPS)


def test_a_closed_flag_offers_exactly_its_kind():
    """A flag whose config field is a closed set offers that set's values (read from ``pushkv.kinds``),
    so a value added to a kind is a value the CLI takes."""
    from pushkv.config import DeploymentConfig, ModelConfig, choices

    kinds = {**choices(DeploymentConfig), **choices(ModelConfig)}
    kinds["role"] = tuple(r for r in kinds.pop("host_role") if r)  # --role sets host_role; "": without it
    for name in ("reasoning_parser", "tool_call_parser"):
        kinds[name] = tuple(r for r in kinds[name] if r)  # "": without the flag
    offered = {a.dest: tuple(a.choices) for a in up_parser()._actions if a.dest in kinds}
    assert offered == {dest: kinds[dest] for dest in offered}
    assert set(offered) == {"mode", "pull_read", "push_stream", "kv_verify", "writer_warm", "writer_post_thread",
                            "role", "link_order", "staging", "engine", "random_init", "reasoning_parser",
                            "tool_call_parser"}
