"""``pushkv up --help`` that reads: a help line for every flag and the default each takes.

Most of ``up``'s flags parse to None (so that a ``--config`` file's value survives a flag not
given); argparse would show that None. The defaults shown here are read from an unplanned
``DeploymentConfig()`` (and its instance and model templates), so they cannot drift from what
an ``up`` without the flag runs. ``annotate(parser)`` fills what a flag's own help leaves out.
"""
from __future__ import annotations

import argparse
from typing import Any

from pushkv.config import DeploymentConfig

# help for the flags whose add_argument gives none
HELP = {
    "mode": "push: P WRITEs the KV into blocks D reserved when the request arrived; pull: D fetches P's KV "
            "after P's prefill; local: one instance prefills and decodes (no disaggregation)",
    "host": "address the router's HTTP port binds (0.0.0.0: every interface); also where each instance's "
            "/metrics listens unless --advertise",
    "port": "the router's HTTP port (OpenAI API, /health, /metrics)",
    "num_layers": "override the model's layer count",
    "hidden_size": "override the model's hidden size",
    "num_heads": "override the model's attention heads",
    "num_kv_heads": "override the model's KV heads",
    "head_dim": "override the model's head width",
    "intermediate_size": "override the model's MLP width",
    "vocab_size": "override the model's vocabulary size",
    "seed": "seed of random weights (--load-format dummy)",
    "prefill_block_size": "tokens per KV block on P (wins over --block-size)",
    "decode_block_size": "tokens per KV block on D (wins over --block-size)",
    "on_child_exit": "a child that dies: restart its whole instance, or shut the deployment down",
    "restart_window": "seconds over which --max-restarts counts a child's restarts",
    "stop_timeout": "seconds children have to exit once asked to stop (SIGTERM at 0.3 of it) before they are killed",
    "log_level": "every process's log level",
}


def defaults() -> dict[str, Any]:
    """Flag dest -> what an ``up`` without that flag (and without --config) runs."""
    c = DeploymentConfig()
    p, d, model = c.prefill, c.decode, c.model
    return {
        "config": "none", "mode": c.mode, "pull_read": c.pull_read, "push_stream": c.push_stream,
        "push_stream_groups": c.push_stream_groups, "kv_verify": c.kv_verify,
        "host": c.host, "port": c.port, "metrics_port": c.metrics_port,
        "model": f"{model.name} (random weights)", "revision": "main", "tokenizer": "--model's",
        "load_format": "auto", "max_model_len": "the model's max_position_embeddings",
        "checkpoint": "none", "generation_config": "auto",
        **{g: "the model's" for g in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                       "intermediate_size", "vocab_size", "dtype")},
        "seed": model.seed, "engine": model.engine, "batch_invariant": "the model's (on for the tiny and small shapes)",
        "random_init": model.random_init, "max_num_seqs": p.max_num_seqs, "max_batch_tokens": p.max_batch_tokens,
        "prefill_chunk": p.prefill_chunk, "tensor_parallel_size": p.tp, "prefill_tp": "-tp's",
        "decode_tp": "-tp's", "tp": p.tp, "device": "cuda where the driver shows a GPU, else cpu",
        "prefill_device": "--device's",
        "decode_device": "--device's", "prefill_block_size": "--block-size's", "decode_block_size": "--block-size's",
        "block_size": p.block_size, "num_blocks": f"sized from --gpu-memory-utilization on CUDA, {d.num_blocks} on cpu",
        "gpu_memory_utilization": c.gpu_memory_utilization, "prefill_instances": c.prefill_instances,
        "decode_instances": c.decode_instances, "writer_post_thread": c.writer_post_thread,
        "link_window": c.link_window, "link_window_mib": c.link_window_mib, "link_order": c.link_order,
        "staging": c.staging, "staging_mib": "auto: 1/16 of host memory, at most the pool",
        "writer_warm": c.writer_warm, "served_model_name": "the --model string", "router_queue": c.router_queue,
        "max_in_flight": c.router_max_in_flight,
        "max_connections": c.router_max_connections, "shutdown_timeout": c.shutdown_timeout_s,
        "push_pin_fraction": c.push_pin_fraction,
        "trace": "off", "secret_file": "none (no CURVE)", "api_key": "none: /v1/* open",
        "metrics_auth": "off: /metrics open",
        "role": "none: the whole deployment here", "registry": "none: one host",
        "advertise": "none", "registry_ttl": c.registry_ttl_s, "log_level": c.log_level,
    }


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def annotate(up: argparse.ArgumentParser) -> None:
    """Give every flag of ``up`` a help line that ends with its default (unless it says it already)."""
    known = defaults()
    for action in up._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.help is None:
            action.help = HELP.get(action.dest)
        if action.help is None or "default" in action.help:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            value: Any = "off"
        elif action.default is not None:
            value = action.default
        elif action.dest in known:
            value = known[action.dest]
        else:
            continue  # no known default: the test of this module names the flag
        action.help = f"{action.help} (default: {_shown(value)})"
