"""The closed sets of names a deployment is made of (a mode, a role, a switch), as ``Literal``
aliases: the config's fields and the messages' use them, msgspec refuses any other value when
either is decoded, and mypy any comparison with a value a field cannot hold. Imports nothing of
pushkv, so both the config and the wire schema sit above it."""
from __future__ import annotations

from typing import Literal

Mode = Literal["push", "pull", "local"]
Role = Literal["prefill", "decode", "local"]  # an instance's, and the leg of a request it serves
HostRole = Literal["", "router", "prefill", "decode"]  # "": the whole deployment on this host
PullRead = Literal["inline", "background", "write"]
PushStream = Literal["off", "chunk", "layer"]
Direction = Literal["write", "read"]  # how P's KV reaches D: P WRITEs into D's blocks, or D READs P's
# what P's writers tell of a transfer's stream (KVSent.stream): "" none asked for, "fallback" asked
# for but off (the deployment's TransferPlan.fallback says why)
StreamSent = Literal["", "chunk", "layer", "fallback"]
# how a P transfer met its D side: which half came first (push), D's READ (pull), a rank with
# nothing to write (replica); "": not known (no KVSent)
Rendezvous = Literal["", "registration_first", "prefill_first", "pull", "replica"]
FinishReason = Literal["", "length", "stop"]  # why a leg's last token ended it; "": not finished
PoolKind = Literal["shm", "cuda_ipc"]  # how a worker maps its writer's pool: a /dev/shm file or CUDA IPC
KVVerify = Literal["off", "sample", "full"]
Switch = Literal["auto", "on", "off"]  # "auto": the code decides (see each field)
Engine = Literal["auto", "batched", "per-seq"]
RandomInit = Literal["cpu", "device"]
LinkOrder = Literal["arrival", "shortest", "deadline"]  # which queued WRITE goes next on a link
Staging = Literal["auto", "transport", "pushkv"]  # who stages a GPU pool's KV through host memory (writer/staging.py)
# RoPE frequency schemes built (pushkv/model/rope.py)
RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]
RouterScoring = Literal["softmax", "sigmoid"]  # how an MoE router turns its logits into expert scores
# tool calls out of a chat choice (router/tool_calls.py); "": none
ToolCallParser = Literal["", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
ReasoningParser = Literal["", "deepseek_r1", "qwen3"]  # a chat choice's thinking apart (router/reasoning.py); "": none
GroupScore = Literal["max", "top2"]  # a group of experts' score, where the router picks groups first
# the ranks --max-lora-rank takes, as vLLM 0.32's LoRAConfig (MaxLoRARanks): an adapter of a rank up to it is served
MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
