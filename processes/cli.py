"""``pushkv`` command line: ``up`` a deployment, ``status``, ``stop``.

``up`` plans the deployment, runs the supervisor in this process and prints
the router URL and ``READY`` on stdout once every child is ready (children's
output goes to stderr). ``status`` and ``stop`` find running deployments
through the registry directory ($PUSHKV_REGISTRY_DIR, default per user:
$XDG_RUNTIME_DIR/pushkv-deployments or /tmp/pushkv-$UID) and talk to each supervisor's control socket
(``pushkv/supervisor/deployments.py``). Here: the parser, and each command called with what it parsed
(the flags -> config mapping is ``pushkv/config_flags.py``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from typing import Optional

import msgspec
from setproctitle import setproctitle

from pushkv import envs, log_config, up_help, vllm_serve
from pushkv.config import PRESETS, TRACE_AUTO, DeploymentConfig
from pushkv.config_flags import GEOMETRY, deprecations, unused_by_mode, user_config, weights_note
from pushkv.cuda_driver import memory_info
from pushkv.kinds import (
    Engine,
    HostRole,
    KVVerify,
    LinkOrder,
    MaxLoraRank,
    Mode,
    PullRead,
    PushStream,
    RandomInit,
    ReasoningParser,
    Staging,
    Switch,
    ToolCallParser,
)
from pushkv.security import API_KEY_ENV, check_secret_file, is_network
from pushkv.supervisor import deployments, registry
from pushkv.supervisor.kv_sizing import Sizing, pool_note, size_pools
from pushkv.supervisor.plan import plan_deployment
from pushkv.supervisor.preflight import preflight
from pushkv.supervisor.supervisor import (
    LOAD_TIMEOUT_S,
    ON_CHILD_EXIT,
    PING_INTERVAL_S,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    ArgvHook,
    Supervisor,
)
from pushkv.supervisor.table import HEALTH_TIMEOUT_S, RestartPolicy


# ---------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------
def _json_list(flag: str):
    """An argparse type: a JSON list of strings, as vLLM's CORS flags take them (``'["https://a.example"]'``)."""
    def parse(text: str) -> tuple[str, ...]:
        try:
            got = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not JSON ({e}): give a list, as '[\"*\"]'") from None
        if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
            raise argparse.ArgumentTypeError(f"{flag}: a JSON list of strings, not {text}")
        return tuple(got)

    return parse


class _BriefErrors(argparse.ArgumentParser):
    """A command's parser whose error is one line and a pointer to its help, not the usage of its ~100 flags."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help: its flags)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pushkv", description="pushkv: disaggregated LLM serving with push KV transfer")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_BriefErrors)

    up = sub.add_parser("up", help="start a deployment and supervise it until stopped")
    dep = up.add_argument_group("deployment")
    dep.add_argument("--config", help="JSON or TOML file of DeploymentConfig fields (flags override)")
    dep.add_argument("--mode", choices=typing.get_args(Mode))
    dep.add_argument("--host")
    dep.add_argument("--port", type=int)
    dep.add_argument("--root-path", metavar="PREFIX",
                     help="a proxy serves the API under this prefix, as vLLM's --root-path: every route is served "
                          "under it as well as bare, the API key guarding both (default: none)")
    dep.add_argument("--otlp-traces-endpoint", metavar="URL",
                     help="each finished request's spans (vLLM's llm_request and its attributes, pushkv's phases "
                          "as children) go to this OpenTelemetry collector, as vLLM's flag: over "
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc or http/protobuf; needs pushkv[otlp] "
                          "(default: none)")
    dep.add_argument("--kv-events-config", metavar="JSON",
                     help="each P / D instance publishes its prefix cache's KV events as vLLM's flag does "
                          "('{\"enable_kv_cache_events\": true}': ZeroMQ PUB on tcp://*:5557, each next instance "
                          "on the port after; docs/running.md) (default: none)")
    dep.add_argument("--disable-sliding-window", action="store_true", default=None,
                     help="as vLLM's: every layer attends to the whole context, capped at the model's sliding "
                          "window (default: the checkpoint's window applied)")
    dep.add_argument("--skip-tokenizer-init", action="store_true", default=None,
                     help="the router loads no tokenizer, as vLLM's flag: prompts come as token ids and each "
                          "choice's output is its token_ids, its text empty (default: the model's tokenizer)")
    dep.add_argument("--uds", metavar="PATH",
                     help="the router listens on this Unix domain socket instead of --host/--port, as vLLM's --uds: "
                          "plain HTTP, the file made 0660 and removed at stop (default: TCP)")
    dep.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="each P / D instance serves /metrics (vLLM's vllm:* names) on its own port: the first "
                          "on PORT, the next ones on the ports after it; 0 (default) = a free port each, shown "
                          "by `pushkv status`")
    dep.add_argument("--trace", nargs="?", const=TRACE_AUTO, metavar="ENDPOINT",
                     help="every process mirrors what it sends and receives; taps (pushkv tap) attach at "
                          "ENDPOINT (default: an ipc socket in the run dir, found through the registry)")
    dep.add_argument("--log-level", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    dep.add_argument("--log-config-file", metavar="FILE",
                     help="a JSON logging.config.dictConfig object every process applies in place of pushkv's own "
                          "format and --log-level, as vLLM's flag (VLLM_LOGGING_CONFIG_PATH) (default: none)")
    dep.add_argument("--enable-force-include-usage", action="store_true", default=None,
                     help="every stream carries usage (each chunk's, and the total after the last), as vLLM's flag: "
                          "as if each request asked stream_options include_usage and continuous_usage_stats "
                          "(default: off, as the request asks)")
    dep.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                     help="logprobs write each token as 'token_id:N', as vLLM's flag; a request's own "
                          "return_tokens_as_token_ids wins (default: off, as the request asks)")


    mod = up.add_argument_group("model", "what is served, as vLLM takes it")
    mod.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it: the same as --model (default: --model's)")
    mod.add_argument("--model", metavar="PATH|ORG/NAME|SHAPE",
                     help="a local Hugging Face checkpoint directory, or a Hugging Face repo id (resolved through "
                          "huggingface_hub: from the local cache when HF_HUB_OFFLINE=1), as vLLM takes it; with "
                          f"--load-format dummy also one of the random-weight shapes {', '.join(sorted(PRESETS))}")
    mod.add_argument("--revision", help="--model repo id: the branch, tag or commit (default: main)")
    mod.add_argument("--tokenizer", metavar="PATH|ORG/NAME",
                     help="the tokenizer's directory or repo id (default: --model's)")
    mod.add_argument("--tokenizer-revision", metavar="REV",
                     help="the tokenizer's repo id (--tokenizer, else --model's): the branch, tag or commit, as "
                          "vLLM's (default: main)")
    mod.add_argument("--load-format", choices=("auto", "safetensors", "dummy"),
                     help="auto: --model's safetensors, else its pytorch_model.bin; safetensors: those only; "
                          "dummy: random weights (of --model's shape and tokenizer), said at startup")
    mod.add_argument("--max-model-len", type=vllm_serve.human_int_or_auto, metavar="N",
                     help="longest prompt + output a request may have, as vLLM takes it (2k = 2000, 2K = 2048; "
                          "auto or -1, the default: the model's max_position_embeddings)")
    mod.add_argument("--served-model-name", nargs="+", metavar="NAME",
                     help="the names a request's model field may give, listed by /v1/models (default: the "
                          "--model string, the checkpoint directory's name and its path; a shape: its name); "
                          "another: 404")
    mod.add_argument("--generation-config", metavar="auto|vllm|DIR", default="auto",
                     help="auto: a request's unset temperature, top_p, top_k, min_p, the penalties and "
                          "max_tokens come from the checkpoint's generation_config.json when it has one (as vLLM); "
                          "vllm (or none): pushkv's defaults (greedy); DIR: from DIR/generation_config.json, its "
                          "max_new_tokens a bound on every request and its EOS ids stopped on, as vLLM's. The "
                          "checkpoint's EOS ids are stopped on in every case")
    mod.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                     help="the chat template /v1/chat/completions renders messages with, as vLLM takes it: a "
                          "Jinja file's path or the template itself (default: the checkpoint's chat_template.jinja "
                          "or tokenizer_config.json's, else one 'role: content' line per message)")
    mod.add_argument("--reasoning-parser", choices=tuple(r for r in typing.get_args(ReasoningParser) if r),
                     help="chat choices give the model's thinking (<think> ... </think>) as reasoning_content, apart "
                          "from content, as vLLM's: deepseek_r1 (reasoning up to </think>, opened in the prompt or "
                          "not: DeepSeek-R1, QwQ, Qwen3 Thinking-2507), qwen3 (reasoning where the output opens "
                          "<think>: Qwen3's hybrid models) (default: none, all content)")
    mod.add_argument("--tool-call-parser", choices=tuple(r for r in typing.get_args(ToolCallParser) if r),
                     help="a chat request with tools gets the calls its choices write as tool_calls (finish_reason "
                          "tool_calls), as vLLM's: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes), "
                          "llama3_json (output that is JSON calls: Llama 3.1-3.3), mistral ([TOOL_CALLS] then a JSON "
                          "list or name[ARGS]{...}: Mistral, Mixtral, Devstral), pythonic (output that is a Python "
                          "list of calls: Llama 3.2, Llama 4), qwen3_coder (<tool_call><function=NAME><parameter=K>V"
                          "</parameter></function></tool_call>: Qwen3-Coder, Qwen3.5) (default: none, calls come "
                          "back as text)")
    mod.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="vLLM's switch beside --tool-call-parser: tool_choice auto parses calls (needs it)")
    mod.add_argument("--enable-lora", action="store_true", default=None,
                     help="serve LoRA adapters beside the model, as vLLM's: a request whose model names one runs "
                          "through it (default: off)")
    mod.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                     help="the adapters, as vLLM's: NAME=PATH (a PEFT directory or a Hugging Face repo id) or a "
                          "JSON object {\"name\", \"path\", \"base_model_name\"}; each is listed by /v1/models "
                          "(default: none)")
    mod.add_argument("--max-loras", type=int, metavar="N",
                     help="adapters a step's sequences may run through at most, as vLLM's (default: 1)")
    mod.add_argument("--max-lora-rank", type=int, choices=typing.get_args(MaxLoraRank),
                     help="an adapter of a larger rank is refused; one of vLLM's ranks, as its LoRAConfig takes "
                          "(default: 16)")
    mod.add_argument("--checkpoint", metavar="DIR", help="deprecated: --model DIR")
    for name in GEOMETRY:
        mod.add_argument("--" + name.replace("_", "-"), type=str if name == "dtype" else int,
                         help="auto (default): the checkpoint's (a float32 one: bfloat16 on a GPU, as vLLM's); "
                         "float32|bfloat16|float16 (vLLM's float and half too)"
                         if name == "dtype" else None)
    mod.add_argument("--engine", choices=typing.get_args(Engine),
                     help="auto: batched (Triton paged attention, CUDA graphs) on CUDA, per-seq on CPU")
    mod.add_argument("--batch-invariant", choices=("on", "off"),
                     help="on: each sequence runs alone, so tokens never depend on the batch (exact equality tests)")
    mod.add_argument("--random-init", choices=typing.get_args(RandomInit), help="where random weights are drawn")

    par = up.add_argument_group("parallelism", "TP ranks, instances and the devices they run on")
    par.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                     help="tensor-parallel ranks of every instance (P, D and local)")
    par.add_argument("--prefill-tp", type=int, help="P's TP size (overrides -tp)")
    par.add_argument("--decode-tp", type=int, help="D's TP size (overrides -tp)")
    par.add_argument("--tp", type=int, help="deprecated: -tp/--tensor-parallel-size")
    par.add_argument("--prefill-instances", type=int, metavar="N",
                     help="P instances on this host, each with its own scheduler, workers, writers and devices")
    par.add_argument("--decode-instances", type=int, metavar="M", help="D instances on this host")
    par.add_argument("--device", help="cpu | cuda[:N] for every instance (KV pool and model)")
    par.add_argument("--prefill-device", help="cpu | cuda[:N] (overrides --device for P)")
    par.add_argument("--decode-device", help="cpu | cuda[:N] (overrides --device for D)")

    mem = up.add_argument_group("memory", "the KV pool and what a step may hold")
    mem.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                     help="the fraction of each GPU's memory the instances may use (ranks on one GPU share it): "
                          "a CUDA instance's KV pool is what it leaves after the weights and activations, and "
                          "the GPU must have that much free; refused when no instance is on CUDA")
    mem.add_argument("--num-blocks", type=int,
                     help="KV blocks in each rank's pool: the count, overriding --gpu-memory-utilization "
                          "(vLLM's --num-gpu-blocks-override)")
    mem.add_argument("--block-size", type=int,
                     help="every instance's block size (--prefill-block-size and --decode-block-size win)")
    mem.add_argument("--prefill-block-size", type=int)
    mem.add_argument("--decode-block-size", type=int)
    mem.add_argument("--max-num-seqs", type=int, help="sequences per step, every instance")
    mem.add_argument("--max-batch-tokens", type=vllm_serve.human_int, help="tokens per step, every instance")
    mem.add_argument("--prefill-chunk", type=int,
                     help="prefill a longer prompt in chunks of at most this many tokens a step, mixed with decodes "
                          "(0: never)")
    mem.add_argument("--no-prefix-cache", action="store_true",
                     help="every instance computes every prompt whole and forgets a request's blocks when it ends "
                          "(default: full prompt blocks are cached by a hash of their tokens and reused)")

    tra = up.add_argument_group("transfer", "how the KV moves from P to D")
    tra.add_argument("--push-stream", choices=typing.get_args(PushStream),
                     help="push: WRITE after the whole prefill (off), each chunk's blocks as its step ends (chunk), "
                          "or each layer group's as the worker marks it stored (layer, the default)")
    tra.add_argument("--push-stream-groups", type=int, metavar="N",
                     help="--push-stream layer: layer groups per pool, each WRITTEN as it is stored (default 4)")
    tra.add_argument("--pull-read", choices=typing.get_args(PullRead),
                     help="pull: READ inside D's step, READ on D's writer, or D registers after the relay and P WRITEs")
    tra.add_argument("--kv-verify", choices=typing.get_args(KVVerify),
                     help="D checks the KV it received against P's checksums before the first decode step: "
                          "off, a sample of blocks (first, last and a few more), or every block; a mismatch "
                          "fails the request (502); default sample")
    tra.add_argument("--writer-post-thread", choices=typing.get_args(Switch),
                     help="P's writers post WRITEs from a second NIXL agent on its own thread, so a post that "
                          "blocks for the whole transfer (UCX over TCP) leaves the loop reading notifications; "
                          "auto (default) = on when UCX_TLS limits UCX to TCP for the network")
    tra.add_argument("--link-window", type=int, metavar="N",
                     help="WRITEs P keeps on the link to each D rank at a time (the rest queue), and READs D "
                          "keeps on the link from each P instance (pull): overlapping transfers share a slow link "
                          "badly; 0 (default) = auto: when UCX_TLS limits UCX to TCP, 1 WRITE and 2 pull READs, "
                          "else no queue")
    tra.add_argument("--link-window-mib", type=int, metavar="MIB",
                     help="and at most this many MiB of them (an idle link still takes one larger); 0 = no bound")
    tra.add_argument("--link-order", choices=typing.get_args(LinkOrder),
                     help="which queued WRITE goes next on a link: arrival (default: requests in the order they "
                          "reached the link, a request's last WRITE before every part), shortest (fewest bytes "
                          "left of its request), deadline (oldest "
                          "transfer first)")
    tra.add_argument("--staging", choices=typing.get_args(Staging),
                     help="who stages GPU KV through host memory for a transport that cannot reach GPU memory "
                          "(UCX over TCP): transport (UCX's cuda_copy, a fragment at a time), pushkv (a pinned host "
                          "staging area, copied on a copy stream around each WRITE); auto (default) = pushkv "
                          "for push on GPU pools when UCX_TLS limits UCX to TCP, else transport")
    tra.add_argument("--staging-mib", type=int, metavar="MIB",
                     help="--staging pushkv: each writer's pinned host staging area; a transfer waits for room in "
                          "it and one larger fails (D holds each registered prompt's blocks, P each queued WRITE's "
                          "layer groups); 0 (default) = auto: 1/16 of the host's memory, at most the pool")
    tra.add_argument("--writer-warm", choices=typing.get_args(Switch),
                     help="writers spin (a core each) while a transfer with them is expected, so its post and "
                          "completion skip the wake-up from idle; auto (default) = on for CUDA instances")

    rou = up.add_argument_group("routing", "the router's admission and placement")
    rou.add_argument("--router-queue", type=int, metavar="N",
                     help="requests that may wait at the router for a D that can hold them; past it: 429")
    rou.add_argument("--max-in-flight", type=int, metavar="N",
                     help="choices the router serves at once, queued ones included (default 1024); past it: "
                          "429 with Retry-After")
    rou.add_argument("--max-connections", type=int, metavar="N",
                     help="HTTP connections the router holds at once (default 4096, and at most its open-file "
                          "limit less 256); past it: 503 with Retry-After, closed unread")
    rou.add_argument("--push-pin-fraction", type=float, metavar="F",
                     help="push: at most this fraction of a D's blocks reserved early and still waiting for KV; "
                          "past it a request falls back to late allocation (D allocates after P); in [0, 1]")
    rou.add_argument("--conditional-disagg", action="store_true",
                     help="per request, D may prefill it itself (no KV moves) when the router's cost model, "
                          "learned from this deployment's timings, prices that below P's prefill and the handoff")

    sec = up.add_argument_group("security")
    sec.add_argument("--secret-file", metavar="FILE",
                     help="shared secret every host holds; every ZMQ socket on a tcp:// endpoint then uses CURVE "
                          "with keys derived from it, and peers without it are refused (make one, mode 0600: "
                          "umask 077; openssl rand -hex 32 > FILE)")
    sec.add_argument("--insecure", action="store_true",
                     help="with --role: start without --secret-file (plain ZMQ on the network: anyone who reaches "
                          "this host can send requests straight to its schedulers and writers); with --trace "
                          "tcp://...: publish the trace plain; warns at every start")
    sec.add_argument("--api-key", default=envs.PUSHKV_API_KEY or None,
                     help=f"the router answers /v1/* only with 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    sec.add_argument("--ssl-keyfile", metavar="FILE",
                     help="the router serves HTTPS with this private key (PEM) and --ssl-certfile, as vLLM's "
                          "(default: plain HTTP)")
    sec.add_argument("--ssl-certfile", metavar="FILE",
                     help="the router's certificate chain (PEM), with --ssl-keyfile (default: plain HTTP)")
    sec.add_argument("--ssl-ca-certs", metavar="FILE",
                     help="CA certificates (PEM) the router checks client certificates against (--ssl-cert-reqs; "
                          "default: none)")
    sec.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), metavar="N",
                     help="client certificates: 0 not asked (default), 1 checked when given, 2 required, as "
                          "Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED and vLLM's flag")
    sec.add_argument("--enable-ssl-refresh", action="store_true", default=None,
                     help="as vLLM's: the router takes the key, certificate and CA files again when they change "
                          "on disk, for the connections after (default: read once, at start)")
    sec.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), metavar="JSON",
                     help='origins a browser page may call the router from, a JSON list (default: ["*"], every one, '
                          "as vLLM's)")
    sec.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), metavar="JSON",
                     help='methods a cross-origin request may use, a JSON list (default: ["*"])')
    sec.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), metavar="JSON",
                     help='headers a cross-origin request may send, a JSON list (default: ["*"])')
    sec.add_argument("--allow-credentials", action="store_true",
                     help="cross-origin requests may carry credentials (cookies, TLS client certificates; default: "
                          "not), as vLLM's")
    sec.add_argument("--metrics-auth", action="store_true",
                     help="/metrics (the router's and every instance's) needs the --api-key too; default off: "
                          "open to scrapers, as vLLM's")

    hos = up.add_argument_group(
        "hosts", "one `pushkv up --role ...` per host, every host given the same --mode, model, geometry "
        "(--model/--checkpoint and overrides, --dtype, --seed) and instance shape (--prefill-tp/--decode-tp, "
        "block sizes); the router finds P and D instances through etcd")
    hos.add_argument("--role", choices=tuple(r for r in typing.get_args(HostRole) if r),  # "": no --role
                     help="run only this part here: the router, or this host's P (--prefill-instances) or D "
                          "(--decode-instances) instances; without --role, the whole deployment runs here")
    hos.add_argument("--registry", metavar="etcd://[USER:PASS@]HOST:PORT[/PREFIX]",
                     help="etcd every host registers in (etcds:// for TLS; ?password_file=FILE keeps the password "
                          "off the command line)")
    hos.add_argument("--advertise", metavar="ADDR",
                     help="this host's address the other hosts reach: its schedulers' and writers' tcp:// "
                          "endpoints bind on it (the router's HTTP port too, unless --host)")
    hos.add_argument("--registry-ttl", type=int, metavar="SECONDS",
                     help="lease TTL (default 5): a host that dies or is cut off leaves the registry, and its "
                          "requests fail, within this (plus TTL/3)")

    vll = up.add_argument_group(
        "vllm serve", "vLLM's spellings: the same setting (same), taken where the value is what pushkv does (when), "
        "taken and said to have no effect (no effect), or refused by name with what to do instead (refused); "
        "--config also takes vLLM's YAML file of these flags")
    vllm_serve.add_flags(vll)

    sup = up.add_argument_group("supervision", "start stages, restarts and stop")
    sup.add_argument("--on-child-exit", choices=ON_CHILD_EXIT, default="restart")
    sup.add_argument("--max-restarts", type=int, default=5, help="per child, within --restart-window")
    sup.add_argument("--restart-window", type=float, default=60.0, metavar="SECONDS")
    sup.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, metavar="SECONDS",
                     help="seconds each start stage has to become ready (writers, then schedulers, then the "
                          "router); the workers' stage has --load-timeout")
    sup.add_argument("--load-timeout", type=float, default=LOAD_TIMEOUT_S, metavar="SECONDS",
                     help="seconds the workers' stage has to load the weights and warm the engine (vLLM waits "
                          "600 s for its engine); each worker logs its progress in GiB and seconds")
    sup.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S, metavar="SECONDS")
    sup.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                     help="as vLLM's: at stop (SIGTERM, SIGINT, pushkv stop) the router refuses new requests (503) "
                          "and the requests in flight have this long to finish before they end with 503 'router "
                          "shutting down' and the processes stop; on a P or D host of several (--role), its "
                          "instances are marked draining in the registry (the routers choose them for no new "
                          "request) and serve their requests in flight for up to this long, then leave it and "
                          "stop; a second signal stops at once; 0 (default): they end at once")
    sup.add_argument("--ping-interval", type=float, default=PING_INTERVAL_S, metavar="SECONDS",
                     help="health pings to every child; also the supervisor heartbeat event")
    st = sub.add_parser("status", help="show running deployments and their processes")
    st.add_argument("id", nargs="?", help="deployment id (default: all)")
    st.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("stop", help="stop a deployment (the only one when no id is given)")
    sp.add_argument("id", nargs="?")
    sp.add_argument("--all", action="store_true", help="stop every running deployment")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="how long to wait for the supervisor to exit, on top of the deployment's --shutdown-timeout")
    up_help.annotate(up)  # every flag of up: a help line and its default
    return ap


# ---------------------------------------------------------------------------
# config: the user's (pushkv.config_flags), then the planned one (plan_deployment)
# ---------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    """The user's config that ``pushkv up``'s parsed flags (and ``--config`` file) say."""
    return user_config(vars(args))


# ---------------------------------------------------------------------------
# subcommands
# ---------------------------------------------------------------------------
def insecure_warning(role: str, address: str) -> str:
    return (f"pushkv up: WARNING --insecure: {role} host without --secret-file: its ZMQ sockets on {address} take "
            "plain, unauthenticated peers")


def warn_insecure_first(args: argparse.Namespace) -> bool:
    """``--insecure`` said from the flags alone, before any check can fail (so a start refused later
    still said it); True when said. A ``--config`` file may name the role or a secret: then the
    warning waits for the planned config."""
    if not getattr(args, "insecure", False) or not args.role or args.secret_file or getattr(args, "config", None):
        return False
    print(insecure_warning(args.role, args.advertise or args.host or "127.0.0.1"), file=sys.stderr, flush=True)
    return True


def cmd_up(args: argparse.Namespace, child_argv: Optional[ArgvHook] = None) -> int:
    warned = warn_insecure_first(args)
    for line in deprecations(vars(args)):
        print(f"pushkv up: {line}", file=sys.stderr)
    try:
        cfg = plan_deployment(config_from_args(args))
        if cfg.secret_file:
            check_secret_file(cfg.secret_file)  # refuse a missing, short or open secret before anything starts
    except (OSError, ValueError, msgspec.ValidationError) as e:
        print(f"pushkv up: bad configuration: {e}", file=sys.stderr)
        return 2
    for line in unused_by_mode(vars(args), cfg.mode):
        print(f"pushkv up: {line}", file=sys.stderr)
    for line in vllm_serve.apply(vars(args), cfg.prefill.max_batch_tokens)[1]:  # taken, and of no effect here
        print(f"pushkv up: {line}", file=sys.stderr)
    if cfg.metrics_auth and not args.api_key:
        print("pushkv up: --metrics-auth puts /metrics behind the API key: give --api-key (or "
              f"${API_KEY_ENV}) too", file=sys.stderr)
        return 2
    if cfg.host_role and not cfg.secret_file and not getattr(args, "insecure", False):
        print(f"pushkv up: --role {cfg.host_role} binds its schedulers and writers on the network; give every host "
              "the same --secret-file (make one, mode 0600: umask 077; openssl rand -hex 32 > FILE), or --insecure "
              "to run without one",
              file=sys.stderr)
        return 2
    if cfg.host_role and not cfg.secret_file and not warned:  # --insecure with the role or secret in --config
        print(insecure_warning(cfg.host_role, cfg.advertise or cfg.host), file=sys.stderr)
    # every message mirrored: prompts' token ids, and the writers' Hello, whose NIXL metadata lets a peer READ or
    # WRITE the pools; on TCP, every user of this host (and on another address, every host) could subscribe to the
    # taps' end, or publish into (and read the traffic to) the processes' end; either may come from --trace or from
    # a --config file (trace_tap_endpoint, trace_endpoint)
    for spelt, endpoint in (("--trace", cfg.trace_tap_endpoint), ("trace_endpoint", cfg.trace_endpoint)):
        if not endpoint or not is_network(endpoint) or cfg.secret_file:
            continue
        if not getattr(args, "insecure", False):
            print(f"pushkv up: {spelt} {endpoint} publishes every message (prompts' token ids, the "
                  "writers' NIXL metadata) to whoever connects: give --secret-file (then pushkv tap --secret-file "
                  "attaches), --trace without an endpoint (a socket in the 0700 run dir), or --insecure to publish "
                  "it plain", file=sys.stderr)
            return 2
        print(f"pushkv up: WARNING --insecure: {spelt} {endpoint} publishes every message plain, to "
              "whoever connects", file=sys.stderr)
    # a taken port, a missing GPU, a model that does not fit, NIXL that does not import: before any
    # child (children a caller brings, child_argv, are not pushkv's writers: they need no NIXL)
    sized: list[Sizing] = []

    def size() -> list[str]:  # vLLM's --gpu-memory-utilization; a model that does not fit is refused
        sized.append(size_pools(cfg, memory_info))
        return sized[0].problems

    problems = preflight(cfg, writers=child_argv is None, then=size)
    if problems:
        for line in problems:
            print(f"pushkv up: {line}", file=sys.stderr)
        return 2
    try:  # a registry directory someone else planted is refused before it is read or written
        registry.checked_dir(create=True)
    except (registry.RegistryError, OSError) as e:
        print(f"pushkv up: {e}", file=sys.stderr)
        return 2
    (sizing,) = sized
    print(f"pushkv up: {weights_note(cfg.model)}", file=sys.stderr)
    for inst in sizing.cfg.instances():
        print(f"pushkv up: {pool_note(sizing.cfg, inst, inst.name in sizing.sized)}", file=sys.stderr)
    cfg = sizing.cfg
    deployments.sweep_residue()
    announcer = None
    if cfg.host_role in ("prefill", "decode", "router"):  # the registry, tried as this host will use it
        from pushkv.discovery.etcd import EtcdAnnouncer, EtcdError, SyncGateway, check_readable, target_of

        try:
            if cfg.host_role == "router":  # it reads the instances: with what credentials and grants it has
                gw = SyncGateway(target_of(cfg.registry))
                try:
                    check_readable(gw, gw.t)
                finally:
                    gw.drop()
            else:  # this host's instances go into it
                announcer = EtcdAnnouncer(cfg.registry, ttl_s=cfg.registry_ttl_s, rejoin=False)
                announcer.connect()  # bad credentials, grants or no etcd: fail now, before anything starts
        except (EtcdError, ValueError) as e:
            print(f"pushkv up: registry {cfg.registry.split('@')[-1]}: {e}", file=sys.stderr)
            return 2
    if args.api_key:  # to the router through its environment: never in config.json on disk
        os.environ[API_KEY_ENV] = args.api_key
    if cfg.log_config:  # --log-config-file: here first, so a config dictConfig refuses stops before any child starts
        try:
            log_config.apply(cfg.log_config)
        except ValueError as e:
            print(f"pushkv up: {e}", file=sys.stderr)
            return 2
    else:
        logging.basicConfig(
            level=getattr(logging, cfg.log_level.upper(), logging.INFO), stream=sys.stderr,
            format="%(asctime)s %(levelname)s supervisor %(name)s: %(message)s",
        )
    setproctitle(f"pushkv supervisor {cfg.deployment_id}")
    sup = Supervisor(
        cfg, child_argv=child_argv, on_child_exit=args.on_child_exit,
        restart_policy=RestartPolicy(args.max_restarts, args.restart_window),
        startup_timeout_s=args.startup_timeout, load_timeout_s=args.load_timeout, stop_timeout_s=args.stop_timeout,
        ping_interval_s=args.ping_interval, health_timeout_s=max(HEALTH_TIMEOUT_S, 5 * args.ping_interval),
        announcer=announcer,
    )
    try:
        return sup.serve()
    except Exception as e:
        logging.getLogger("pushkv.cli").exception("supervisor failed")
        print(f"pushkv up: {e}", file=sys.stderr)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    return deployments.status(args.id, args.json)


def cmd_stop(args: argparse.Namespace) -> int:
    return deployments.stop(args.id, args.all, args.timeout)


def main(argv: Optional[list[str]] = None, *, child_argv: Optional[ArgvHook] = None) -> int:
    """``pushkv up|status|stop`` (the console script ``pushkv`` is tools/cli.py, which hands these here).
    ``child_argv`` lets tests run fake children."""
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        raw = vllm_serve.expand_config(raw)  # vLLM's --config YAML: its flags, the command line's winning
    except (OSError, ValueError) as e:
        print(f"pushkv up: bad configuration: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(raw)
    if unknown:
        hint = (" (pushkv up takes vllm serve's common flags under their names, each the same setting, taken, or "
                "refused with what to do instead: the 'vllm serve' group of pushkv up --help)"
                if args.cmd == "up" else "")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.cmd == "up":
        return cmd_up(args, child_argv)
    if args.cmd == "status":
        return cmd_status(args)
    return cmd_stop(args)


if __name__ == "__main__":
    sys.exit(main())
