"""An instance that joins after LoRA adapters were loaded or unloaded at runtime (restarted by its supervisor, or a
new one through the registry) starts with the launch's adapters: the router tells it what changed before it is
chosen (``Loras.catch_up``, ``Loras.bring_in``, ``Balancer.add(joining=True)`` / ``ready``), and a load it does not
take keeps it out. A runtime load or unload asks the instances up only."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from pushkv import messages as m
from pushkv.config import PRESETS, DeploymentConfig, LoraConfig, LoraModule
from pushkv.router import loras as loras_mod
from pushkv.router.balance import Balancer, Refused
from pushkv.router.loras import Loras
from tests.router.test_router_policy import Run, rec


class Link:
    """A scheduler link that answers each LoRA change as told (``fail``: names whose load it refuses)."""

    def __init__(self, engine_id: str, fail=(), silent=False):
        self.engine_id, self.fail, self.silent, self.asked = engine_id, set(fail), silent, []

    async def change_lora(self, msg, timeout_s):
        self.asked.append(msg)
        if self.silent:
            return None
        error = f"cannot load {msg.name}" if isinstance(msg, m.LoadLora) and msg.name in self.fail else ""
        return m.LoraChanged(msg.name, error)


def _loras(*launch: str) -> Loras:
    lora = LoraConfig(True, tuple(LoraModule(n, f"/adapters/{n}") for n in launch), 2, 16)
    cfg = DeploymentConfig(model=msgspec.structs.replace(PRESETS["tiny"], lora=lora))
    return Loras(cfg, lambda: None)


def _changed(lo: Loras, monkeypatch, *, load=(), replace=(), unload=()):
    """Runtime loads, in-place replacements and unloads through Loras' own paths, every instance taking them."""
    monkeypatch.setattr(loras_mod, "resolve_adapter", lambda name, path, *a: path)
    up = [Link("d0")]

    async def run():
        for n in load:
            assert (await lo.load({"lora_name": n, "lora_path": f"/new/{n}"}, ("base",), up, _direct)).status == 200
        for n in replace:
            body = {"lora_name": n, "lora_path": f"/new/{n}", "load_inplace": True}
            assert (await lo.load(body, ("base",), up, _direct)).status == 200
        for n in unload:
            assert (await lo.unload({"lora_name": n}, lambda: up, lambda name: False)).status == 200
            await asyncio.gather(*lo.unloading.values())  # no request names it: dropped at once

    asyncio.run(run())


async def _direct(fn, *args):
    return fn(*args)


def test_nothing_changed_since_the_launch_means_nothing_to_catch_up():
    assert _loras("a", "b").catch_up() == []


def test_a_joining_instance_is_told_each_adapter_loaded_replaced_or_unloaded_since_the_launch(monkeypatch):
    lo = _loras("a", "b", "c")
    _changed(lo, monkeypatch, load=("x",), replace=("b",), unload=("c",))
    assert lo.catch_up() == [m.LoadLora("b", "/new/b", replace=True), m.LoadLora("x", "/new/x", replace=True),
                             m.UnloadLora("c")]
    # one loaded at runtime then unloaded is nothing to a joining instance; one unloaded then loaded again is new
    _changed(lo, monkeypatch, unload=("x",), load=("c",))
    assert lo.catch_up() == [m.LoadLora("b", "/new/b", replace=True), m.LoadLora("c", "/new/c", replace=True)]


def _joining_balancer() -> Balancer:
    b = Balancer("push", 1.0, 2)
    b.add(rec("p0", "prefill"), lambda r: object())
    b.add(rec("d0", "decode", 20), lambda r: object(), joining=True)
    return b


def test_a_joining_instance_is_chosen_only_once_it_took_every_change(monkeypatch):
    lo = _loras("a")
    _changed(lo, monkeypatch, load=("x",))
    b = _joining_balancer()
    assert b.live("decode") == []
    with pytest.raises(Refused, match="no live decode instance"):  # linked, not chosen: as if it were down
        b.request(Run("t0"))
    link = Link("d0")
    join = b.joining["d0"]
    assert asyncio.run(lo.bring_in("d0", link, lambda: b.ready("d0", join), lambda: b.joining.get("d0") == join)) == ""
    assert link.asked == [m.LoadLora("x", "/new/x", replace=True)]
    assert b.live("decode") == ["d0"] and b.request(Run("t1")).decode == "d0"


def test_an_instance_that_does_not_take_a_load_is_not_chosen(monkeypatch):
    lo = _loras("a")
    _changed(lo, monkeypatch, load=("x", "y"))
    for link, why in ((Link("d0", fail={"x"}), "LoRA adapter 'x' did not load: cannot load x"),
                      (Link("d0", silent=True), "LoRA adapter 'x' did not load: no answer")):
        b = _joining_balancer()
        join = b.joining["d0"]
        said = asyncio.run(lo.bring_in("d0", link, lambda: b.ready("d0", join), lambda: b.joining.get("d0") == join))
        assert said == why and b.live("decode") == []
        assert [msg.name for msg in link.asked] == ["x"]  # it stopped at the first


def test_a_join_that_went_down_or_joined_again_meanwhile_is_not_made_up():
    b = _joining_balancer()
    first = b.joining["d0"]
    b.down("d0")
    assert not b.ready("d0", first) and b.live("decode") == []
    b.add(rec("d0", "decode", 20), lambda r: object(), joining=True)  # back, joining again
    assert not b.ready("d0", first) and b.live("decode") == []  # the first join's end is not the second's
    assert b.ready("d0", b.joining["d0"]) and b.live("decode") == ["d0"]
    b.add(rec("d1", "decode", 20), lambda r: object())  # no change to catch up: up at once
    assert b.live("decode") == ["d0", "d1"] and not b.joining


def test_a_join_that_goes_down_midway_asks_nothing_more_and_is_not_made_up(monkeypatch):
    lo = _loras("a")
    _changed(lo, monkeypatch, load=("x", "y"))
    b = _joining_balancer()
    join = b.joining["d0"]

    class DiesAfterOne(Link):
        async def change_lora(self, msg, timeout_s):
            answer = await super().change_lora(msg, timeout_s)
            b.down("d0")  # its supervisor reports it down while it loads the first
            return answer

    link = DiesAfterOne("d0")
    assert asyncio.run(lo.bring_in("d0", link, lambda: b.ready("d0", join), lambda: b.joining.get("d0") == join)) == ""
    assert [msg.name for msg in link.asked] == ["x"] and b.live("decode") == []
