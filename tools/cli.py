"""``pushkv``: the one command. ``up``, ``status`` and ``stop`` run deployments
(``processes/cli.py``); every other subcommand is a tool, imported only when asked for,
so ``pushkv up`` loads no benchmark and ``pushkv plot`` loads no deployment code.

    pushkv up --mode push --port 8000
    pushkv bench --url http://127.0.0.1:8000 --qps 2
    pushkv tap --breakdown
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Optional

from pushkv import extras

# name -> (module, its function taking argv, one line of help)
TOOLS: dict[str, tuple[str, str, str]] = {
    "demo": ("tools.demo", "main", "bring up P/D (push) on the built-in model, answer requests, print measurements"),
    "bench": ("tools.cli", "bench", "load generator for /v1/completions (Poisson arrivals, streaming); "
              "--workload chat: multi-turn conversations sharing a system prompt"),
    "sweep": ("tools.sweep", "main", "modes x QPS x input lengths, one deployment per mode"),
    "plot": ("tools.plot", "main", "TTFT and TPOT vs input length from a sweep's result dir"),
    "stages": ("tools.stages", "main", "per result file: TTFT/TPOT medians and each stage's median"),
    "tap": ("tools.trace.tap", "main", "attach to a running deployment's trace: live log, Perfetto, breakdown"),
    "stream-bench": ("tools.stream_bench", "main", "lone requests per mode and prompt length, stage by stage"),
    "chat-bench": ("tools.chat_bench", "main", "multi-turn conversations sharing one system prompt"),
    "chat-sweep": ("tools.chat_sweep", "main", "the chat workload per cache and conditional setting, the planner "
                   "checked against each run"),
    "prefix-bench": ("tools.prefix_bench", "main", "lone chat turns: TTFT with the prefix cache on and off"),
    "blocksec": ("tools.blocksec", "main", "push's cost in D memory against pull's, under one load"),
    "link-bench": ("tools.link_bench", "cli", "serving over a capped link between two namespace hosts (root)"),
    "transfer-report": ("tools.transfer_report", "main", "what one request's KV transfer costs"),
    "layout-report": ("tools.layout_report", "main", "P/D layouts that differ, each run as a real deployment"),
    "tcp-write-report": ("tools.tcp_write_report", "main", "NIXL WRITE over UCX TCP against a plain socket (root)"),
    "sampling-bench": ("tools.sampling_bench", "main", "cost of sampling per step: batch x vocab x mix"),
    "roofline": ("tools.roofline", "main", "the batched engine's steps against their hardware bounds (GPU)"),
    "check-deploy": ("tools.check_deploy", "main", "offline checks of the Kubernetes manifests under deploy/"),
    "vllm-proxy": ("pushkv.vllm.proxy", "main", "the router in front of vLLM instances with the pushkv connector"),
    "vllm-bench": ("tools.vllm_bench", "main", "vLLM P/D with the pushkv connector against vLLM's connectors on one "
                   "client; --ab REV: this tree's connector against REV's, interleaved, TPOT ratio"),
    "plan": ("pushkv.plan.cli", "main", "predict TTFT and TPOT per mode and P:D ratio from a workload and a hardware "
             "profile (a simulation: starts nothing)"),
    "link-plan": ("tools.link_plan", "main", "the planner's link model against a link-bench run: its loads' TTFT "
                  "predicted and measured"),
}


# `pushkv --help` lists the deployment commands first, then the tools in these groups, each tool once
GROUPS: dict[str, tuple[str, ...]] = {
    "try it": ("demo",),
    "bench (load a running deployment, read what it measured)": (
        "bench", "sweep", "plot", "stages", "stream-bench", "chat-bench", "chat-sweep", "prefix-bench"),
    "trace (one request's stages and transfer)": ("tap", "transfer-report"),
    "plan (no deployment: predictions and offline checks)": ("plan", "link-plan", "check-deploy"),
    "vLLM": ("vllm-proxy", "vllm-bench"),
    "lab (instruments behind the docs' results; some need root or a GPU)": (
        "blocksec", "link-bench", "layout-report", "tcp-write-report", "sampling-bench", "roofline"),
}


def tools_help(width: int = 100) -> str:
    """The tools, group by group, for the top-level help's epilog (a name at four spaces, as argparse
    lists the deployment commands)."""
    import textwrap

    lines = ["tools (pushkv TOOL --help: its options):"]
    for title, names in GROUPS.items():
        lines.append(f"  {title}:")
        for name in names:
            head = f"    {name:<18}"
            body = textwrap.wrap(TOOLS[name][2], width - len(head)) or [""]
            if len(name) > 16:  # the help starts on the next line, as argparse does
                lines.append(f"    {name}")
                head = " " * len(head)
            lines.append(head + body[0])
            lines.extend(" " * len(head) + more for more in body[1:])
    return "\n".join(lines)


def bench(argv: list[str]) -> Optional[int]:
    """``pushkv bench``: the open-loop load generator, or with ``--workload chat`` the chat
    workload (tools/chat_bench.py, whose own flags follow)."""
    rest = list(argv)
    for i, a in enumerate(rest):
        if a == "--workload" or a.startswith("--workload="):
            value = a.split("=", 1)[1] if "=" in a else (rest[i + 1] if i + 1 < len(rest) else "")
            if value != "chat":
                raise SystemExit(f"pushkv bench: --workload {value!r}: the one workload is 'chat'")
            del rest[i:i + (1 if "=" in a else 2)]
            from tools import chat_bench

            return chat_bench.main(rest)
    from tools import bench as open_loop

    return open_loop.main(rest)


def build_parser() -> argparse.ArgumentParser:
    """The deployment commands' parser with every tool listed beside them (for help and errors;
    a tool parses its own arguments)."""
    from processes import cli as deployment

    ap = deployment.build_parser()
    ap.prog = "pushkv"
    ap.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's groups keep their lines
    ap.epilog = tools_help() + "\n\npushkv COMMAND --help: that command's options"
    ap._positionals.title = "deployment commands"
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    sub.metavar = "COMMAND"
    for name in TOOLS:  # parsed (and named in errors) like the deployment commands; listed in the epilog
        sub.add_parser(name, add_help=False)
    return ap


def tool(name: str) -> Callable[[list[str]], Optional[int]]:
    module, function, _ = TOOLS[name]
    return getattr(importlib.import_module(module), function)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # (a pipe's output is buffered: written here, inside the try, not at the interpreter's exit)
        return rc
    except BrokenPipeError:
        # the reader went first (`pushkv status | head`): stop quietly, as a shell tool does, not with a traceback;
        # stdout goes to /dev/null so the interpreter's own flush at exit does not fail on the pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a writer whose reader left


def _main(argv: Optional[list[str]]) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        sys.argv = [f"pushkv {argv[0]}", *argv[1:]]  # argparse names the tool in its usage line
        try:
            return tool(argv[0])(argv[1:]) or 0
        except ModuleNotFoundError as e:  # an optional dependency, imported where the tool needs it
            top = (e.name or "").split(".")[0]
            if top not in extras.EXTRA_OF:
                raise
            print(extras.missing(top, f"pushkv {argv[0]}"), file=sys.stderr)
            return 2
    if not argv or argv[0] not in ("up", "status", "stop"):
        build_parser().parse_args(argv)  # prints help, or names the unknown command, and exits
    from processes import cli as deployment

    return deployment.main(argv)


def demo() -> int:
    """Console script ``pushkv-demo`` (the README's first command): ``pushkv demo``."""
    return main(["demo", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
