"""The LoRA adapters one instance serves, by name and slot, as they change at runtime (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``). Pure: the core's ``on_LoadLora``, ``on_UnloadLora`` and
``on_LoraChanged`` call ``load``, ``unload`` and ``answered``, and ``_release`` calls ``sweep``.

A slot is a place in the workers' adapter table (``SeqWork.lora``); the launch's adapters take 1, 2... in the order
of ``--lora-modules``, and an adapter loaded later the lowest slot free (one freed by the workers), else the next.
So the workers' bank, which computes over every slot it has, stays as wide as the adapters held at once, however
often adapters are loaded, replaced or unloaded. A load is served once every worker rank has the adapter in its
slot; a replaced or unloaded adapter's slot is retired: new requests no longer reach it, and the workers free it
once no request holds it. Each load also takes an id never used again (``ids``: the launch's are their slots): a
prompt's cached blocks chain from its adapter's name and id (``prefix_key``), so the blocks of replaced weights are
never taken for the new ones, even in the same slot, and KV events' ``lora_id`` is that id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pushkv import messages as m
from pushkv.config import LoraConfig
from pushkv.scheduler.metrics import LoraSnapshot
from pushkv.scheduler.outbox import Peer

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore


@dataclass
class _Loading:
    name: str
    asker: Peer
    replace: bool
    lora_id: int  # the id this load's weights take (never used again)
    errors: dict[int, str] = field(default_factory=dict)  # worker rank -> "" (loaded) or why not


class LoraTable:
    def __init__(self, cfg: LoraConfig):
        self.enabled = cfg.enabled
        self.max_loras = cfg.max_loras
        self.slots = {mod.name: i for i, mod in enumerate(cfg.modules, 1)}
        self.ids = dict(self.slots)  # name -> the id of the weights it serves now (prefix_key, KV events)
        self.next_slot = len(cfg.modules) + 1  # past every slot ever used
        self.next_id = self.next_slot
        self.free: set[int] = set()  # slots below next_slot the workers have freed
        self.loading: dict[int, _Loading] = {}
        self.retired: dict[int, str] = {}

    def take_slot(self) -> int:
        """The lowest slot free, else the next one."""
        if self.free:
            slot = min(self.free)
            self.free.discard(slot)
            return slot
        self.next_slot += 1
        return self.next_slot - 1

    def lora_id(self, name: str) -> int:
        """The id of the weights a request's adapter names now: 0 for none (or one not served)."""
        return self.ids.get(name, 0) if name else 0

    def slot(self, name: str) -> int:
        """The slot of the adapter a request names: 0 for none (""), -1 for one not served."""
        return self.slots.get(name, -1) if name else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slots)

    @property
    def batch_bound(self) -> int:
        """--max-loras for build_batch; 0: no adapters, no bound."""
        return self.max_loras if self.enabled else 0


def snapshot(core: "SchedulerCore") -> Optional[LoraSnapshot]:
    """What /metrics says of the adapters (vLLM's vllm:lora_requests_info), None with LoRA off: the adapters of the
    requests running and of those waiting, each once, in the order their requests came."""
    t = core.lora
    if not t.enabled:
        return None
    running: dict[str, None] = {}
    waiting: dict[str, None] = {}
    now = {r.key for r in core.running_now()}  # (vllm:num_requests_running's: D's past --max-num-seqs wait)
    for r in core.reqs.values():
        if r.lora:
            (running if r.key in now else waiting)[r.lora] = None
    return LoraSnapshot(t.max_loras, ",".join(running), ",".join(waiting), core.wall)


def prefix_key(name: str, lora_id: int) -> str:
    """What a request's prompt chain is rooted on besides its salt: its adapter's name and weights' id ("": none)."""
    return f"{lora_id}:{name}" if name else ""


def load(core: "SchedulerCore", msg: m.LoadLora, frm: Peer) -> None:
    t = core.lora
    why = ("LoRA is off on this instance: start it with --enable-lora" if not t.enabled
           else f"the LoRA adapter {msg.name!r} is being loaded" if any(l.name == msg.name for l in t.loading.values())
           else f"the LoRA adapter {msg.name!r} has already been loaded" if msg.name in t.slots and not msg.replace
           else "")
    if why:
        core._send(frm, m.LoraChanged(msg.name, why, adapters=t.names))
        return
    slot = t.take_slot()
    t.loading[slot] = _Loading(msg.name, frm, msg.replace, t.next_id)
    t.next_id += 1
    core._to_workers(m.LoadLora(msg.name, msg.path, slot))


def unload(core: "SchedulerCore", msg: m.UnloadLora, frm: Peer) -> None:
    t = core.lora
    if msg.name not in t.slots:
        core._send(frm, m.LoraChanged(msg.name, f"the LoRA adapter {msg.name!r} cannot be found", adapters=t.names))
        return
    t.ids.pop(msg.name, None)
    _retire(core, t.slots.pop(msg.name), msg.name)
    core._send(frm, m.LoraChanged(msg.name, adapters=t.names))


def answered(core: "SchedulerCore", msg: m.LoraChanged, frm: Peer) -> None:
    """A worker rank's answer: a load is decided once every rank answered (an unload's answers need none)."""
    t = core.lora
    pending = t.loading.get(msg.slot)
    if pending is None:
        return
    pending.errors[frm.rank] = msg.error
    if len(pending.errors) < len(core.workers):
        return
    del t.loading[msg.slot]
    failed = sorted((rank, why) for rank, why in pending.errors.items() if why)
    if failed:
        core._to_workers(m.UnloadLora(pending.name, msg.slot))  # the ranks that took it free it; then it is free
        t.free.add(msg.slot)
        core._send(pending.asker, m.LoraChanged(pending.name, "; ".join(f"rank {r}: {w}" for r, w in failed),
                                                adapters=t.names))
        return
    old = t.slots.get(pending.name)
    t.slots[pending.name] = msg.slot
    t.ids[pending.name] = pending.lora_id
    core.counters["lora_loaded"] += 1
    if old is not None:
        _retire(core, old, pending.name)
    core._send(pending.asker, m.LoraChanged(pending.name, slot=msg.slot, adapters=t.names))


def _retire(core: "SchedulerCore", slot: int, name: str) -> None:
    core.lora.retired[slot] = name
    sweep(core)


def sweep(core: "SchedulerCore") -> None:
    """Free on the workers each retired slot that no request holds any more."""
    t = core.lora
    if not t.retired:
        return
    held = {r.lora_slot for r in core.reqs.values()}
    for slot in [s for s in t.retired if s not in held]:
        core._to_workers(m.UnloadLora(t.retired.pop(slot), slot))  # the workers free it before any later load
        t.free.add(slot)
        core.counters["lora_unloaded"] += 1
