"""The LoRA adapters the router serves by name: the launch's (``--lora-modules``) and those loaded since through vLLM's
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (served only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, as vLLM's, and ``--enable-lora``).

A load is checked here first (the path resolved, the adapter's files read against the model: ``lora_files``), then
asked of every instance's scheduler (``LoadLora``), which has each worker rank load it; the name is served once every
instance answered that it holds it. An instance that fails or does not answer fails the load, and the instances that
took it drop it again. An unload takes the name away from every instance at once; requests already running through
it finish: the instances are told to drop it only once none of the router's requests names it (a pull-mode or
late-allocated request's D leg leaves after its prefill, and a queued one's legs once it is placed; vLLM's unload
never touches a request it accepted), and a load of the name meanwhile replaces its weights. Only the instances up
are asked; one that joins later (restarted by its supervisor, or a new one through
the registry) starts with the launch's adapters, so before it is chosen it is told what changed since (``bring_in``:
the adapters loaded or replaced since loaded on it, those unloaded since dropped).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from aiohttp import web

from pushkv import messages as m
from pushkv.config import DeploymentConfig, LoraModule
from pushkv.model.lora_files import AdapterNotFound, resolve_adapter
from pushkv.router import api

log = logging.getLogger(__name__)

LORA_TIMEOUT_S = 120.0  # how long each instance may take to load an adapter on every rank


class Loras:
    def __init__(self, cfg: DeploymentConfig, on_change: Callable[[], None]):
        self.cfg = cfg
        self.modules: dict[str, LoraModule] = {mod.name: mod for mod in cfg.model.lora.modules}
        self.launch = frozenset(self.modules)  # the names every instance starts with
        self.since: set[str] = set()  # names held loaded (or replaced) at runtime: not the launch's weights
        self.dropping: dict[str, LoraModule] = {}  # unloaded, not yet dropped (its requests run): the instances hold it
        self.on_change = on_change  # the served names changed
        self._lock: Optional[asyncio.Lock] = None  # one load or unload at a time (made on the loop)
        self.unloading: dict[str, asyncio.Task] = {}  # names unloaded whose requests still run: the drop waits
        self._ended: Optional[asyncio.Event] = None  # set as a request ends: the drops waiting look again
        self.loads: dict[str, int] = {}  # name -> its runtime loads (replacements included), for ``root``
        self._drop_args: tuple = ()  # the last unload's (links, in_use), for a drop a failed load hands back

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.modules)

    def of(self, model: str) -> str:
        """The adapter a request's ``model`` names ("": the base model)."""
        return model if model in self.modules else ""

    def root(self, name: str) -> str:
        """What the router's prefix index roots a request's chain on for adapter ``name``: its name, and how many
        times it was loaded since the launch, a failed replacement that some instance took and undid among them (as
        the schedulers root theirs on the weights' id, a new one at each load), so the blocks of
        weights replaced or unloaded are not predicted for the new ones (the count first: unambiguous whatever the
        name holds)."""
        return f"{self.loads.get(name, 0)}:{name}" if name else ""

    def cards(self, created: int, max_model_len: int, base: str) -> list[dict]:
        """/v1/models' entries, as vLLM lists an adapter: its path, and the model it adapts."""
        return [{"id": mod.name, "object": "model", "created": created, "owned_by": "pushkv",
                 "root": mod.given or mod.path,
                 "parent": mod.base_model_name or base, "max_model_len": max_model_len}
                for mod in self.modules.values()]

    def _refusal(self, name: str, served: tuple[str, ...], replace: bool) -> str:
        if not self.cfg.model.lora.enabled:
            return "LoRA is off: start pushkv up with --enable-lora"
        if name in served and name not in self.modules:
            return f"The lora adapter '{name}' conflicts with a served base model."
        if name in self.modules and not replace:
            return (f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True.")
        return ""

    async def load(self, body: dict, served: tuple[str, ...], links: list, off_loop) -> web.Response:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        replace = bool(body.get("load_inplace"))
        async with self._locked():
            why = self._refusal(name, served, replace)
            if why:
                return _error(400, why)
            try:
                local = await off_loop(resolve_adapter, name, path, self.cfg.model, self.cfg.model.lora.max_rank, None,
                                       "lora_path")
            except AdapterNotFound as e:  # vLLM's LoRAAdapterNotFoundError: a 404
                return _error(404, f"Loading lora {name} failed: No adapter found for {path} ({e})", "NotFoundError")
            except (ValueError, OSError) as e:  # vLLM's: any other failure of the engine's add_lora is a 500
                return _error(500, f"Loading lora {name} failed: {e}", "InternalServerError")
            held = name in self.unloading  # unloaded, its requests still running: the instances hold it yet
            if held:
                self.unloading.pop(name).cancel()
                was = self.dropping.pop(name)
            answers = await _ask(links, m.LoadLora(name, local, replace=replace or held))
            failed = _failures(links, answers)
            if failed:
                took = [lk for lk, a in zip(links, answers) if a is not None and not a.error]
                old = self.modules.get(name)
                if held:  # still unloaded: dropped once its requests end
                    self.dropping[name] = was
                    self.unloading[name] = asyncio.ensure_future(self._drop(name, *self._drop_args))
                elif old is None:  # a name not served (load_inplace or not): the instances that took it drop it
                    await _ask(took, m.UnloadLora(name))
                else:  # a replacement: the instances that took it go back to the weights still served
                    undone = _failures(took, await _ask(took, m.LoadLora(name, old.path, replace=True)))
                    if took:  # under a weights' id of their own: the blocks they cached of the name are never hit
                        self.loads[name] = self.loads.get(name, 0) + 1
                    if undone:
                        log.warning("LoRA adapter %s: its weights from %s not restored on %s", name, old.path, undone)
                answered = all(a is not None for a in answers)  # vLLM's add_lora failing: a 500
                return _error(500 if answered else 503, f"LoRA adapter {name!r} did not load: {failed}",
                              "InternalServerError" if answered else "ServiceUnavailableError")
            self.modules[name] = LoraModule(name, local, given=path)
            self.loads[name] = self.loads.get(name, 0) + 1
            self.since.add(name)
            self.on_change()
        log.info("LoRA adapter %s loaded from %s on %d instances", name, local, len(links))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: dict, links: Callable[[], list], in_use: Callable[[str], bool]) -> web.Response:
        """Serve the name no more from now; the instances (``links()`` then) drop it once ``in_use`` says that no
        request of the router's names it (``request_ended`` has it look again)."""
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error(400, "'lora_name' must be provided.")
        async with self._locked():
            if name not in self.modules:
                return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            self.dropping[name] = self.modules.pop(name)  # no new request names it from now
            self.on_change()
            self._drop_args = (links, in_use)
            self.unloading[name] = asyncio.ensure_future(self._drop(name, links, in_use))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def request_ended(self) -> None:
        """A request ended: the drops waiting for their adapter's requests look again."""
        if self._ended is not None:
            self._ended.set()

    async def _drop(self, name: str, links: Callable[[], list], in_use: Callable[[str], bool]) -> None:
        """Have the instances drop an unloaded adapter once none of the router's requests names it."""
        if self._ended is None:
            self._ended = asyncio.Event()
        while True:
            self._ended.clear()
            if not in_use(name):
                break
            await self._ended.wait()
        async with self._locked():
            if self.unloading.get(name) is not asyncio.current_task():
                return  # a load of the name took it over meanwhile
            del self.unloading[name]
            del self.dropping[name]
            self.since.discard(name)
            up = links()
            answers = await _ask(up, m.UnloadLora(name))
        silent = [lk.engine_id for lk, a in zip(up, answers) if a is None]
        if silent:
            log.warning("LoRA adapter %s: no answer to its unload from %s", name, silent)

    def close(self) -> None:
        """The router stops: the drops still waiting are dropped (the instances stop too)."""
        for task in self.unloading.values():
            task.cancel()
        self.unloading.clear()

    def catch_up(self) -> list[Any]:
        """What an instance that joins now must be told to hold what the others hold now: it starts with the launch's
        adapters, so each loaded or replaced since is loaded on it (in place of the launch's weights of that name),
        and each of the launch's unloaded since is dropped; one unloaded whose requests still run is held until the
        instances up drop it, the joined one with them (a request of it may still be placed there)."""
        held = {**self.dropping, **self.modules}
        msgs: list[Any] = [m.LoadLora(name, held[name].path, replace=True) for name in sorted(self.since)]
        return msgs + [m.UnloadLora(name) for name in sorted(self.launch - set(held))]

    async def bring_in(self, engine_id: str, link, ready: Callable[[], bool], joining: Callable[[], bool]) -> str:
        """Tell a joining instance ``catch_up``'s changes, then call ``ready`` (it is chosen from then), under the
        lock of loads and unloads, so none is missed in between; on a load it did not take, the reason, and
        ``ready`` is not called (its requests through that adapter would fail). ``joining`` is asked before each
        change: False (it went down, or joined again, meanwhile) ends this join at once, so a dead instance holds
        the lock no longer than the one change already asked of it."""
        async with self._locked():
            for msg in self.catch_up():
                if not joining():
                    return ""
                (answer,) = await _ask([link], msg)
                if isinstance(msg, m.LoadLora) and (answer is None or answer.error):
                    return f"LoRA adapter {msg.name!r} did not load: {'no answer' if answer is None else answer.error}"
            if ready():
                log.info("instance %s took the LoRA adapters loaded since the launch", engine_id)
        return ""

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock


async def _ask(links: list, msg: Any) -> list[Optional[m.LoraChanged]]:
    return list(await asyncio.gather(*(lk.change_lora(msg, LORA_TIMEOUT_S) for lk in links)))


def _failures(links: list, answers: list[Optional[m.LoraChanged]]) -> str:
    return "; ".join(f"{lk.engine_id}: {'no answer' if a is None else a.error}"
                     for lk, a in zip(links, answers) if a is None or a.error)


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    return web.json_response(api.error_body(message, type_, status), status=status)
