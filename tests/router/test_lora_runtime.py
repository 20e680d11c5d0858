"""vLLM's runtime LoRA paths as the router serves them (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``):
an unload stops new requests at once but has the instances drop the adapter only once the requests naming it have
ended (a pull-mode request's D leg, or a queued one's legs, leave after the unload); a load of the name meanwhile
replaces its weights; a request whose adapter is unloaded while its body is parsed is a 404, never the base model's;
a missing adapter is vLLM's 404, a path that holds no adapter or cannot be read vLLM's 500, and vLLM's own words
for a name loaded twice or a base model's name."""
from __future__ import annotations

import asyncio
import json

import msgspec

from pushkv import messages as m
from pushkv.config import LoraConfig, LoraModule
from pushkv.router import loras as loras_mod
from tests.router.test_lora_joining import Link, _direct, _loras
from tests.support.router_fakes import Harness, make_cfg, stage, tokens


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_unloaded_adapter_is_dropped_only_once_its_requests_end():
    lo = _loras("a")
    up = [Link("d0")]
    busy = {"a"}

    async def run():
        said = await lo.unload({"lora_name": "a"}, lambda: up, lambda name: name in busy)
        assert said.status == 200 and said.text == "Success: LoRA adapter 'a' removed successfully."
        assert lo.names == ()  # no new request names it from now
        await _settle()
        lo.request_ended()  # another request ended; one through "a" still runs
        await _settle()
        assert up[0].asked == []
        busy.clear()
        lo.request_ended()
        await asyncio.wait_for(asyncio.gather(*lo.unloading.values()), 5)
        assert up[0].asked == [m.UnloadLora("a")] and not lo.unloading

    asyncio.run(run())


def test_a_load_of_a_name_whose_drop_waits_replaces_its_weights(monkeypatch):
    monkeypatch.setattr(loras_mod, "resolve_adapter", lambda name, path, *a: path)
    lo = _loras("a")
    up = [Link("d0")]
    busy = {"a"}

    async def run():
        assert (await lo.unload({"lora_name": "a"}, lambda: up, lambda name: name in busy)).status == 200
        said = await lo.load({"lora_name": "a", "lora_path": "/v2/a"}, ("base",), up, _direct)
        assert said.status == 200, said.text
        # the instances hold it still (its requests run): the new weights replace it there
        assert up[0].asked == [m.LoadLora("a", "/v2/a", replace=True)] and lo.names == ("a",)
        busy.clear()
        lo.request_ended()
        await _settle()
        assert up[0].asked == [m.LoadLora("a", "/v2/a", replace=True)] and not lo.unloading

    asyncio.run(run())


def test_runtime_loads_answer_as_vllms(tmp_path):
    lo = _loras("a")
    up = [Link("d0")]

    async def ask(body):
        said = await lo.load(body, ("base", "a"), up, _direct)
        return said.status, json.loads(said.text)["error"]

    (tmp_path / "empty").mkdir()
    for path in ("/no/such/adapter", str(tmp_path / "empty")):  # vLLM's LoRAAdapterNotFoundError
        status, error = asyncio.run(ask({"lora_name": "x", "lora_path": path}))
        assert status == 404 and error["type"] == "NotFoundError", error
        assert error["message"].startswith(f"Loading lora x failed: No adapter found for {path} (")
    # something there that is no adapter, or cannot be read: vLLM's add_lora fails in the engine, a 500
    (tmp_path / "file").write_text("x")
    (tmp_path / "not_json").mkdir()
    (tmp_path / "not_json" / "adapter_config.json").write_text("{")
    (tmp_path / "unreadable" / "adapter_config.json").mkdir(parents=True)  # read as root too: open() fails
    for path, why in ((tmp_path / "file", "is a file, not an adapter directory"),
                      (tmp_path / "not_json", "adapter_config.json is not JSON"),
                      (tmp_path / "unreadable", "adapter_config.json cannot be read: Is a directory")):
        status, error = asyncio.run(ask({"lora_name": "x", "lora_path": str(path)}))
        assert (status, error["type"], error["code"]) == (500, "InternalServerError", 500), error
        assert error["message"].startswith("Loading lora x failed: ") and why in error["message"], error
    status, error = asyncio.run(ask({"lora_name": "a", "lora_path": "/adapters/a"}))
    assert status == 400 and error["message"] == ("The lora adapter 'a' has already been loaded. If you want to load "
                                                  "the adapter in place, set 'load_inplace' to True.")
    status, error = asyncio.run(ask({"lora_name": "base", "lora_path": "/adapters/a"}))
    assert status == 400 and error["message"] == "The lora adapter 'base' conflicts with a served base model."
    assert up[0].asked == []


def _lora_cfg(tmp_path):
    cfg = make_cfg(tmp_path, "local")
    lora = LoraConfig(True, (LoraModule("a", "/adapters/a"),), 1, 16)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, lora=lora))


class Spans(list):
    """A stand-in OTLP exporter: the spans of each request, as the router emits them."""

    def emit(self, request_spans, headers):
        self.append(request_spans)

    def close(self):
        pass


def test_the_router_drops_an_unloaded_adapter_after_its_last_request(tmp_path, monkeypatch):
    """Through the router: a request through "a" runs while "a" is unloaded; the instance is told to drop it only
    once that request has ended."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    gate = __import__("threading").Event()

    def held(g):
        return [(gate, tokens(g, [72], True, "length", (stage("scheduled"), stage("finished"))))]

    spans = Spans()

    async def body():
        async with Harness(_lora_cfg(tmp_path), {"local": held}) as h:
            h.router.otlp = spans
            running = asyncio.ensure_future(h.http.post("/v1/completions", json={
                "prompt": "Hey", "max_tokens": 1, "model": "a"}))
            await h.wait(lambda e: any(isinstance(x, m.Generate) for _, _, x in e))
            assert h.log.received("local", m.Generate)[0].lora == "a"
            said = await h.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            assert said.status == 200
            late = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 1, "model": "a"})
            assert late.status == 404  # no new request names it
            await asyncio.sleep(0.2)
            assert not h.log.received("local", m.UnloadLora)  # its request still runs through it
            gate.set()
            assert (await running).status == 200
            await h.wait(lambda e: any(isinstance(x, m.UnloadLora) for _, _, x in e))
            assert h.log.received("local", m.UnloadLora) == [m.UnloadLora("a")]
            # its OTLP span names the adapter it ran through, though no longer served (it named the base model)
            assert [s[0].attributes["gen_ai.response.model"] for s in spans] == ["a"]

    asyncio.run(asyncio.wait_for(body(), 25))


def test_a_request_whose_adapter_is_unloaded_while_it_is_parsed_is_a_404(tmp_path):
    """Its body named a served adapter; the adapter went while the body was parsed (off the loop): a 404, as for
    any model not served, not a run of the base model under the adapter's name."""
    async def body():
        async with Harness(_lora_cfg(tmp_path), {"local": lambda g: [(None, tokens(g, [72], True, "length"))]}) as h:
            router = h.router
            off_loop = router._off_loop

            async def parse_then_unload(fn, *args):
                out = await off_loop(fn, *args)
                del router.loras.modules["a"]  # the unload's first step, as it lands between the two
                router.loras.on_change()
                return out

            router._off_loop = parse_then_unload
            r = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 1, "model": "a"})
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            assert not h.log.received("local", m.Generate)

    asyncio.run(asyncio.wait_for(body(), 25))


def test_a_load_that_fails_somewhere_leaves_every_instance_as_it_was(monkeypatch):
    """A load_inplace of a name not served that one instance refuses: the others drop it again (they kept it, so a
    later load of the name failed there as 'already loaded'); a replacement one refuses: the others go back to the
    weights still served, under a weights' id of their own (the blocks they cached of it are never hit again: the
    router's index roots the name anew, as for a replacement)."""
    monkeypatch.setattr(loras_mod, "resolve_adapter", lambda name, path, *a: path)
    lo = _loras("a")
    root = lo.root("a")

    async def run():
        for name in ("x", "a"):
            took, refused = Link("d0"), Link("d1", fail={name})
            body = {"lora_name": name, "lora_path": f"/v2/{name}", "load_inplace": True}
            said = await lo.load(body, ("base",), [took, refused], _direct)
            assert said.status == 500 and f"d1: cannot load {name}" in said.text  # vLLM's add_lora failing
            assert json.loads(said.text)["error"]["type"] == "InternalServerError"
            back = m.UnloadLora("x") if name == "x" else m.LoadLora("a", "/adapters/a", replace=True)
            assert took.asked == [m.LoadLora(name, f"/v2/{name}", replace=True), back], name
            assert refused.asked == [m.LoadLora(name, f"/v2/{name}", replace=True)]
        assert lo.names == ("a",) and lo.modules["a"].path == "/adapters/a"
        assert lo.root("a") != root

    asyncio.run(run())


def test_the_routers_prefix_index_does_not_predict_replaced_weights_blocks(monkeypatch):
    """The schedulers root an adapter's cached blocks on its weights' id, so after a replacement (or an unload and a
    load) its prompts find none of the old blocks; the router's index rooted them on the name alone and went on
    predicting hits (and placing by them) that never came."""
    from pushkv.router.balance import Balancer
    from tests.router.test_router_policy import ChatRun, rec

    monkeypatch.setattr(loras_mod, "resolve_adapter", lambda name, path, *a: path)
    lo = _loras("a")
    b = Balancer("push", 1.0, 4, prefix_cache=True, conditional=False)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 200), lambda r: object())

    def run(tid):
        r = ChatRun(tid, range(100))
        r.lora, r.lora_root = "a", lo.root("a")
        return r

    first = run("t1")
    b.request(first)
    b.prefill_done(first)
    assert b.ask(run("t2")).hits["p0"] == 96  # the same weights: its blocks are there
    assert lo.root("a") == "0:a" and lo.root("") == ""
    said = asyncio.run(lo.load({"lora_name": "a", "lora_path": "/v2/a", "load_inplace": True}, ("base",),
                               [Link("d0")], _direct))
    assert said.status == 200
    assert "p0" not in b.ask(run("t3")).hits  # new weights: none of the old blocks
    assert lo.root("a") == "1:a" != _loras("1:a").root("1:a")  # whatever the names, one root each


def test_an_instance_that_joins_while_an_unloaded_adapters_requests_run_holds_it_till_they_end(monkeypatch):
    """An instance that joins (restarted, or new through the registry) while an unloaded adapter's requests still
    run holds it as the others do, and drops it with them: a pull-mode D leg of such a request may be placed there.
    It was told to drop a launch adapter at once, and never loaded one loaded at runtime (a 404 for that leg)."""
    from tests.router.test_lora_joining import _changed

    lo = _loras("a")
    _changed(lo, monkeypatch, load=("x",))
    up = [Link("d0")]
    busy = {"a", "x"}

    async def run():
        for name in ("a", "x"):
            assert (await lo.unload({"lora_name": name}, lambda: up, lambda n: n in busy)).status == 200
        assert lo.names == () and lo.catch_up() == [m.LoadLora("x", "/new/x", replace=True)]
        joined = Link("d1")
        up.append(joined)  # it took the catch-up and is up
        busy.clear()
        lo.request_ended()
        await asyncio.wait_for(asyncio.gather(*lo.unloading.values()), 5)
        assert sorted(msg.name for msg in joined.asked) == ["a", "x"]  # dropped with the others
        assert all(isinstance(msg, m.UnloadLora) for msg in joined.asked)
        assert lo.catch_up() == [m.UnloadLora("a")]

    asyncio.run(run())
