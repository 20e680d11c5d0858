"""LoRA adapters served through P/D push, as vLLM serves them (``--enable-lora --lora-modules NAME=PATH``, and
``/v1/load_lora_adapter`` at runtime): P at TP 2 and D at TP 1 give PEFT's float32 greedy tokens for each adapter
and for the base model, requests of different adapters at once under ``--max-loras 1`` included; /v1/models lists
the adapters as vLLM does; an adapter's prompt never takes the base model's cached blocks; a model that is not
served is a 404; an adapter unloaded is no longer served; an instance restarted after a runtime load serves that
adapter too."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from pushkv.supervisor.commands import ask as ask_supervisor
from tests.faults.test_faults import Events, wait_serving
from tests.model.test_hf_reference import FLOAT32, save_hf_checkpoint
from tests.support.deploy import deployment
from tests.support.lora_adapters import ADAPTERS, NEW_TOKENS, peft_reference, save_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

# 40 tokens: two full blocks of 16 the prefix cache indexes
PROMPT = [2] + [(7 * i) % 250 + 4 for i in range(39)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_e2e")
    base = save_hf_checkpoint(str(root / "base"), "llama", seed=5)
    paths = {n: save_adapter(base, str(root / n), seed=10 + i, **f) for i, (n, f) in enumerate(ADAPTERS.items())}
    want = {n: peft_reference(base, paths.get(n), [PROMPT])[0] for n in [None, *ADAPTERS]}
    return base, paths, want


def _text(dep, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(dep.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _restart(dep, role: str) -> None:
    """Kill ``role``'s worker; return once its supervisor has restarted the instance."""
    ev = Events(dep.cfg.events_endpoint)
    try:
        status = ask_supervisor(dep.cfg.control_endpoint, "status")
        os.kill(next(p.pid for p in status.processes if p.name == f"{role}-worker-0"), signal.SIGKILL)
        ev.wait(lambda e: e.kind == "instance" and e.name == f"{role}.instance" and e.event == "ready", 120)
    finally:
        ev.close()


def test_local_mode_restarted_takes_the_adapters_loaded_at_runtime(tmp_path, llama, monkeypatch):
    """Local mode (one instance, no balancer): its instance, restarted after a fault, serves an adapter loaded at
    runtime again, and no longer one unloaded at runtime."""
    base, paths, want = llama
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with deployment(tmp_path, "--mode", "local", "--model", base, "--served-model-name", "base", "--num-blocks", "64",
                    "--enable-lora", "--lora-modules", f"all={paths['all']}", *FLOAT32) as dep:
        assert _text(dep, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": paths["qv"]})[0] == 200
        assert _text(dep, "/v1/unload_lora_adapter", {"lora_name": "all"})[0] == 200
        _restart(dep, "local")
        end = time.monotonic() + 60
        while True:  # the router has the restarted instance load it as soon as it hears it is back
            status, body = dep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "model": "qv",
                                                        "temperature": 0})
            if status == 200 or time.monotonic() > end:
                break
            time.sleep(0.1)  # polling a remote state: the catch-up's load on the worker
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want["qv"]
        status, body = dep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "model": "all"})
        assert status == 404 and body["error"]["code"] == "model_not_found"


def test_push_serves_each_adapter_as_peft_does(tmp_path, llama, monkeypatch):
    base, paths, want = llama
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with deployment(tmp_path, "--mode", "push", "--model", base, "--served-model-name", "base", "--num-blocks", "64",
                    "--prefill-tp", "2", "--decode-tp", "1", "--enable-lora", "--lora-modules", f"all={paths['all']}",
                    "--max-loras", "1", *FLOAT32) as dep:
        # the second adapter loaded at runtime, on every rank of P and D
        assert _text(dep, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": paths["qv"]}) == (
            200, "Success: LoRA adapter 'qv' added successfully.")
        status, said = _text(dep, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": paths["qv"]})
        assert status == 400 and "has already been loaded" in said
        status, said = _text(dep, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert status == 404 and "No adapter found for" in said and "no such directory" in said  # vLLM's 404
        with urllib.request.urlopen(dep.url + "/v1/models", timeout=30) as r:
            models = json.loads(r.read())
        cards = {c["id"]: c for c in models["data"]}
        assert set(cards) == {"base", *ADAPTERS}
        assert {n: (cards[n]["root"], cards[n]["parent"]) for n in ADAPTERS} == {n: (p, "base")
                                                                                 for n, p in paths.items()}
        # the base model first: its prompt blocks are cached; the adapters' prompts must not take them
        first = dep.complete(PROMPT, NEW_TOKENS, model="base")
        assert first["choices"][0]["token_ids"] == want[None]
        assert want["all"] != want[None] and want["qv"] != want[None]  # each adapter changes the tokens
        got: dict = {}

        def ask(name):
            got[name] = dep.complete(PROMPT, NEW_TOKENS, model=name)

        threads = [threading.Thread(target=ask, args=(n,)) for n in ADAPTERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for n in ADAPTERS:
            assert got[n]["choices"][0]["token_ids"] == want[n], n
            assert got[n]["model"] == n
            assert got[n]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, n
        again = dep.complete(PROMPT, NEW_TOKENS, model="all")  # its own cached blocks are found
        assert again["choices"][0]["token_ids"] == want["all"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        # D's worker dies; its supervisor restarts the instance, which starts with the launch's adapter only: the
        # router has it load the one loaded since before it is chosen again
        _restart(dep, "decode")
        wait_serving(dep)
        for n in ADAPTERS:
            assert dep.complete(PROMPT, NEW_TOKENS, model=n)["choices"][0]["token_ids"] == want[n], n
        status, body = dep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "model": "nope"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert _text(dep, "/v1/unload_lora_adapter", {"lora_name": "qv"}) == (
            200, "Success: LoRA adapter 'qv' removed successfully.")
        status, body = dep.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "model": "qv"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert _text(dep, "/v1/unload_lora_adapter", {"lora_name": "qv"})[0] == 404
        # loaded again, in a new slot: its own tokens, none of its old cached blocks
        assert _text(dep, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": paths["qv"]})[0] == 200
        again = dep.complete(PROMPT, NEW_TOKENS, model="qv")
        assert again["choices"][0]["token_ids"] == want["qv"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_pull_serves_each_adapter_as_peft_does(tmp_path, llama):
    """Pull mode (D reads P's KV once P is done), the adapters given in both of vLLM's spellings: each adapter's
    tokens are PEFT's, its prompt never takes another adapter's cached blocks, and /v1/models names each path as
    given."""
    base, paths, want = llama
    qv = json.dumps({"name": "qv", "path": paths["qv"], "base_model_name": "base"})
    with deployment(tmp_path, "--mode", "pull", "--model", base, "--served-model-name", "base", "--num-blocks", "64",
                    "--enable-lora", "--lora-modules", f"all={paths['all']}", qv, "--max-loras", "2",
                    *FLOAT32) as dep:
        with urllib.request.urlopen(dep.url + "/v1/models", timeout=30) as r:
            cards = {c["id"]: c for c in json.loads(r.read())["data"]}
        assert {n: (cards[n]["root"], cards[n]["parent"]) for n in ADAPTERS} == {n: (p, "base")
                                                                                 for n, p in paths.items()}
        for n in ("all", "qv", None, "all"):
            got = dep.complete(PROMPT, NEW_TOKENS, model=n or "base")
            assert got["choices"][0]["token_ids"] == want[n], n
        # the second "all" found its own blocks; "qv" and the base model found none of the first "all"'s
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
