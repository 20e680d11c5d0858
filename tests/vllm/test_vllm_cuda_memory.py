"""Who allocates a GPU KV cache (``cuda_memory``), tested without CUDA: the choice the allocation
hook makes, the config key, the writer's environment, the allocate / describe exchange between
worker and writer, a refusal carried from a real writer process to the worker, and a dead
owner stopping the worker. The GPU half (the bytes, NIXL on the writer's allocation) is the
harness's, on a GPU (``tools/vllm_gpu_harness.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import types

import msgspec
import pytest
import torch
import zmq

from pushkv import messages as m
from pushkv.vllm import cuda_kv, writer_alloc
from pushkv.vllm import params as P
from pushkv.vllm import wire as w
from pushkv.vllm.memory import SharedKVAllocation, claim
from pushkv.vllm.regions import KVMemory, LayerRegion
from pushkv.vllm.worker_side import WorkerSide
from pushkv.vllm.writer_args import WriterArgs, parse

pytestmark = pytest.mark.timeout(120)

I8 = torch.int8


@pytest.mark.parametrize("size, kw, taken, mode, want", [
    ((4096,), {"dtype": I8, "device": "cpu"}, False, "writer", ("memfd", 4096)),
    ((4096,), {"dtype": I8}, False, "vllm", ("memfd", 4096)),  # the CPU: always the memfd
    (((4096,),), {"dtype": I8, "device": "cuda:1"}, False, "writer", ("writer", 4096)),
    ((4096,), {"dtype": I8, "device": torch.device("cuda")}, False, "writer", ("writer", 4096)),
    ((4096,), {"dtype": I8, "device": "cuda:0"}, False, "vllm", ("", 0)),  # vLLM allocates, exported later
    ((4096,), {"dtype": I8, "device": "cuda:0"}, True, "writer", ("", 0)),  # one buffer only
    ((4096,), {"dtype": torch.float32, "device": "cuda:0"}, False, "writer", ("", 0)),
    ((64, 64), {"dtype": I8, "device": "cuda:0"}, False, "writer", ("", 0)),
    ((0,), {"dtype": I8, "device": "cuda:0"}, False, "writer", ("", 0)),
])
def test_the_hook_claims_only_the_kv_buffer_and_names_who_provides_it(size, kw, taken, mode, want):
    assert claim(size, kw, taken, mode) == want


@pytest.mark.parametrize("extra, want", [({}, "writer"), ({"cuda_memory": "writer"}, "writer"),
                                         ({"cuda_memory": "vllm"}, "vllm")])
def test_cuda_memory_defaults_to_the_writer(extra, want):
    assert P.settings("e", 1, extra, env={}).cuda_memory == want


@pytest.mark.parametrize("bad", ["Writer", "cuda", 1, None])
def test_an_unknown_cuda_memory_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match=r"cuda_memory must be one of \['writer', 'vllm'\]"):
        P.settings("e", 1, {"cuda_memory": bad}, env={})


def test_the_writer_allocates_without_the_workers_allocator_configuration():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync",
           "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"}
    assert cuda_kv.writer_env(env) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"}


def test_the_hook_asks_the_writer_for_a_cuda_buffer_and_checks_its_answer():
    asked = []

    def allocator(nbytes, device):
        asked.append((nbytes, device))
        return torch.empty(nbytes, dtype=I8)  # on the CPU: not what was asked (zeros: the hook)

    alloc = SharedKVAllocation("pushkv-test", "writer", allocator)
    with alloc, pytest.raises(RuntimeError, match=r"1024 torch.int8 on cpu; vLLM asked for 1024 int8 on cuda:2"):
        torch.zeros(1024, dtype=I8, device="cuda:2")
    assert asked == [(1024, torch.device("cuda", 2))] and alloc.tensor is None and alloc.dev_id == -1

    alloc = SharedKVAllocation("pushkv-test", "vllm", allocator)  # the fallback: left to torch
    with alloc:
        kv = torch.zeros(1024, dtype=I8, device="meta")  # (no CUDA here: meta stands for a device torch owns)
    assert kv.is_meta and len(asked) == 1 and alloc.tensor is None


def test_a_cuda_cache_that_missed_the_hook_is_refused_with_the_fallback_named():
    ws = WorkerSide(P.Settings("e", 1, "", 0, 1.0, 1.0, 1.0), 0, "prefill")
    with pytest.raises(RuntimeError, match='vLLM allocated its CUDA KV cache outside.*"cuda_memory": "vllm"'):
        ws.register_kv_caches({"layer.0": types.SimpleNamespace(is_cuda=True)})
    assert ws.proc is None and ws.events is None  # nothing started


def _memory() -> KVMemory:
    return KVMemory(4096, 4, (LayerRegion(0, 1024, 1024, 0),), 1)


def _args(d: str, **over) -> WriterArgs:
    a = WriterArgs(role="prefill", engine_id="e", fd=-1, memory="", cmd_endpoint=f"ipc://{d}/cmd",
                   event_endpoint=f"ipc://{d}/ev", handshake_endpoint=f"ipc://{d}/hs", parent_pid=os.getppid(),
                   alloc_bytes=4096, alloc_device=0)
    return WriterArgs(**{**a.__dict__, **over})


def test_the_writer_allocates_answers_and_waits_for_the_description(monkeypatch):
    """The exchange, this test as the worker: KVAllocated with the handle, then DescribeKV fills in
    the writer's arguments."""
    owned = torch.zeros(4096, dtype=I8)
    monkeypatch.setattr(cuda_kv, "allocate_owned", lambda n, dev: (owned, b"handle"))
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="pkvc-") as d:
        ev = ctx.socket(zmq.PULL)
        ev.bind(f"ipc://{d}/ev")
        cmd = ctx.socket(zmq.PUSH)
        cmd.connect(f"ipc://{d}/cmd")
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=writer_alloc.allocate_and_wait(_args(d), ctx, 30)))
        t.start()
        assert ev.poll(30_000)
        got = w.DEC_TO_CONNECTOR.decode(ev.recv())
        assert got == w.KVAllocated(os.getpid(), 0, 4096, b"handle")
        cmd.send(m.encode(w.DescribeKV(msgspec.msgpack.encode(_memory()))))
        t.join(30)
        tensor, args = out["r"]
        assert tensor is owned and msgspec.msgpack.decode(bytes.fromhex(args.memory), type=KVMemory) == _memory()
        for s in (ev, cmd):
            s.close(0)
    ctx.term()


def test_the_writer_gives_up_when_the_worker_is_gone():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://describe")
    with pytest.raises(RuntimeError, match="is gone before describing its KV cache"):
        writer_alloc.wait_description(sock, os.getppid() + 1, 30)
    with pytest.raises(writer_alloc.DescribeTimeout, match="did not describe its KV cache within 0s"):
        writer_alloc.wait_description(sock, os.getppid(), 0)
    sock.close(0)
    ctx.term()


def test_writer_args_carry_the_allocation():
    a = _args("/tmp", alloc_bytes=1 << 30, alloc_device=3)
    assert parse(a.argv()[3:]) == a


def test_a_writer_that_cannot_allocate_tells_the_worker_why(tmp_path, monkeypatch):
    """A real writer process asked for a CUDA cache where there is none: the worker's hook raises
    with the writer's reason, and nothing is left running."""
    if torch.cuda.is_available():
        pytest.skip("this checks the refusal where CUDA is missing")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    ws = WorkerSide(P.Settings(f"t{os.getpid()}", 1, "", 0, 1.0, 1.0, 1.0), 0, "prefill")
    try:
        with ws.alloc, pytest.raises(RuntimeError, match="could not allocate .* sees no CUDA device 0"):
            torch.zeros(1 << 20, dtype=I8, device="cuda:0")
        assert ws.proc is not None and ws.proc.wait(30) != 0 and not ws.writer_owns_kv
    finally:
        ws.shutdown()


def test_the_death_of_the_writer_that_owns_the_cache_stops_the_worker(tmp_path, monkeypatch):
    """No second writer (it could not have the memory): the next step raises with the reason."""
    ws = WorkerSide(P.Settings("e", 1, "", 0, 1.0, 1.0, 1.0), 0, "prefill")
    ws.writer_owns_kv = True
    ws.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    ws._supervise()  # returns: the owner is not replaced
    assert ws.restarts == 0
    with pytest.raises(RuntimeError, match=r"died with status 3; it had allocated vLLM's KV cache"):
        ws.transfer_results()


def test_a_writer_of_gpu_memory_polls_hot_while_kv_is_expected_and_one_of_host_memory_does_not():
    """D's writer on a GPU spins while a registered transfer's parts are coming (a 1 ms poll is a
    tenth of a layer group's WRITE there); on the CPU it sleeps between polls, as pushkv's writers."""
    from pushkv.vllm.writer import VllmWriter

    mem = msgspec.msgpack.encode(_memory()).hex()
    with tempfile.TemporaryDirectory(prefix="pkvc-") as d:
        gpu = VllmWriter(_args(d, role="decode", memory=mem))
        host = VllmWriter(_args(d, role="decode", memory=mem, alloc_device=-1, alloc_bytes=0, fd=7))
        for wr in (gpu, host):
            wr.warmup.warm_for("t1", 1e18)
        assert gpu.warmup.warm == {"t1": 1e18} and host.warmup.warm == {}
        gpu.warmup.cool("t1")
        assert gpu.warmup.warm == {}
        for wr in (gpu, host):
            wr.close_sockets()
