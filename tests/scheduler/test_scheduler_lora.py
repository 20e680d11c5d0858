"""LoRA in the scheduler, by plain calls: a request's adapter becomes its sequences' slot, an adapter not served is
refused before anything is held, a step holds at most --max-loras adapters and none starves, and a prompt's cached
blocks are shared only through the same adapter (and salt)."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, LoraConfig, LoraModule, preset
from pushkv.protocol.prefix_cache import ROOT_HASH, root_of
from pushkv.scheduler.outbox import Peer
from pushkv.scheduler.requests import Request, State, build_batch
from tests.scheduler.test_scheduler_prefix import generate, idle, prompt, run_all, run_step
from tests.scheduler.test_scheduler_roles import ROUTER, deliver, wired

LORA = LoraConfig(True, (LoraModule("a", "/adapters/a"), LoraModule("b", "/adapters/b")), max_loras=1)


def make(max_loras=1, num_blocks=16):
    inst = InstanceConfig(role="local", engine_id="local-engine", num_blocks=num_blocks,
                          worker_endpoints=("w0",), writer_endpoints=("x0",))
    model = preset("tiny", lora=LoraConfig(True, LORA.modules, max_loras=max_loras))
    return wired(DeploymentConfig(mode="local", model=model, local=inst), inst)


def test_an_adapter_not_served_is_refused_and_holds_nothing():
    s, wire = make()
    generate(s, "x", prompt(20), lora="c")
    (fail,) = [msg for _, msg in wire.sent if isinstance(msg, m.RequestFailed)]
    assert fail.status == 404 and "LoRA adapter 'c' is not served here (adapters: ['a', 'b'])" in fail.reason
    assert idle(s) and not wire.take("worker")


def _steps(s, wire) -> list:
    steps = []
    while wire.sent and any(isinstance(x, m.ExecuteStep) for _, x in wire.sent):
        steps.append(run_step(s, wire))
    return steps


def test_each_request_runs_through_its_adapters_slot():
    s, wire = make(max_loras=2)
    for tid, name in (("x", ""), ("y", "a"), ("z", "b")):
        generate(s, tid, prompt(20, first=len(tid)), lora=name, max_tokens=2)
    slots = {s.by_tid[tid].seq_id: slot for tid, slot in (("x", 0), ("y", 1), ("z", 2))}
    steps = _steps(s, wire)
    assert all(w.lora == slots[w.seq_id] for step in steps for w in step)
    assert sorted(w.seq_id for step in steps for w in step) == sorted(2 * list(slots))  # a prefill and a decode each
    assert idle(s)


def test_a_step_holds_at_most_max_loras_adapters_and_each_request_ends():
    """--max-loras 1: b's prompt waits while a's request runs; the base model's requests are never held back."""
    s, wire = make(max_loras=1)
    generate(s, "a1", prompt(20), lora="a", max_tokens=3)
    generate(s, "b1", prompt(20, 5), lora="b", max_tokens=3)
    generate(s, "base", prompt(20, 9), max_tokens=3)
    steps = _steps(s, wire)
    assert all(len({w.lora for w in step if w.lora}) <= 1 for step in steps)
    first_b = next(i for i, step in enumerate(steps) if any(w.lora == 2 for w in step))
    last_a = max(i for i, step in enumerate(steps) if any(w.lora == 1 for w in step))
    assert first_b > last_a  # b waited for a's request to end
    assert any(w.lora == 0 for w in steps[1]) and any(w.lora == 1 for w in steps[1])  # the base ran beside a
    done = {msg.transfer_id for _, msg in wire.sent if isinstance(msg, m.TokensGenerated) and msg.finished}
    assert done == {"a1", "b1", "base"} and idle(s)


def _running(tid: str, slot: int, last: float) -> Request:
    r = Request(tid, 0, "decode", (1, 2, 3), 8, b"r", seq_id=len(tid), state=State.RUNNING, blocks=[0],
                output=[4], lora=str(slot), lora_slot=slot)
    r.last_token_at = last
    return r


def test_running_requests_of_more_adapters_than_a_step_holds_take_turns():
    """D's requests arrive with their KV, whatever adapters they run through: when they name more than --max-loras,
    the ones that have waited longest for a token go first, so each adapter's turn comes."""
    running = [_running("a", 1, 5.0), _running("b", 2, 1.0), _running("c", 0, 9.0), _running("d", 1, 2.0)]
    batch = build_batch([], running, 8, 64, max_loras=1)
    assert [(r.transfer_id, w.lora) for r, w in batch] == [("b", 2), ("c", 0)]
    running[1].last_token_at = 10.0  # b has had its token: a's turn
    assert [r.transfer_id for r, _ in build_batch([], running, 8, 64, max_loras=1)] == ["d", "a", "c"]
    assert len(build_batch([], running, 8, 64, max_loras=2)) == 4


@pytest.mark.parametrize("first, second, hit", [
    (("", "a"), ("", "a"), 32), (("", ""), ("", "a"), 0), (("", "a"), ("", "b"), 0), (("", "a"), ("", ""), 0),
    (("t", "a"), ("t", "a"), 32), (("t", "a"), ("", "a"), 0),
])
def test_cached_blocks_are_shared_only_through_the_same_adapter_and_salt(first, second, hit):
    s, wire = make()
    generate(s, "one", prompt(40), cache_salt=first[0], lora=first[1])
    run_all(s, wire)
    generate(s, "two", prompt(40), cache_salt=second[0], lora=second[1])
    (w,) = run_step(s, wire)
    assert (w.start_pos, s.counters["prefix_hit_tokens"]) == (hit, hit)
    run_all(s, wire)
    assert idle(s)


def test_an_adapters_root_is_its_own_and_no_salt_spells_it():
    roots = {root_of(), root_of("a"), root_of("", "a"), root_of("", "b"), root_of("t", "a"), root_of("a", "t")}
    assert len(roots) == 6 and ROOT_HASH in roots
    assert root_of("\0lora\0a") not in roots  # a salt spelling an adapter's name is a salt


def make_tp(tp=2, **kw):
    inst = InstanceConfig(role="local", engine_id="local-engine", num_blocks=16, tp=tp,
                          worker_endpoints=tuple(f"w{r}" for r in range(tp)),
                          writer_endpoints=tuple(f"x{r}" for r in range(tp)))
    return wired(DeploymentConfig(mode="local", model=preset("tiny", lora=LoraConfig(True, LORA.modules, **kw)),
                                  local=inst), inst)


def _answer_workers(s, wire, error=""):
    """Each worker rank answers the LoadLora it was sent (rank 1 with ``error``), as a worker does (an unload it
    does not answer)."""
    asked = [(peer, msg) for peer, msg in wire.sent if peer.startswith("worker")]
    wire.take("worker")
    for peer, msg in asked:
        rank = int(peer.split("-")[1])
        if isinstance(msg, m.LoadLora):
            deliver(s, Peer("worker", rank), m.LoraChanged(msg.name, error if rank == 1 else "", msg.slot))
    return [msg for _, msg in asked]


def _router_said(wire) -> list:
    return [msg for msg in wire.take("router") if isinstance(msg, m.LoraChanged)]


def test_an_adapter_loaded_at_runtime_takes_the_next_slot_once_every_rank_has_it():
    s, wire = make_tp()
    deliver(s, ROUTER, m.LoadLora("c", "/adapters/c"))
    asked = _answer_workers(s, wire)
    assert asked == [m.LoadLora("c", "/adapters/c", 3)] * 2  # one to each rank, the slot after the launch's
    (said,) = _router_said(wire)
    assert (said.error, said.slot, said.adapters) == ("", 3, ("a", "b", "c"))
    generate(s, "x", prompt(20), lora="c")
    assert [w.lora for w in run_step(s, wire)] == [3]
    run_all(s, wire)
    deliver(s, ROUTER, m.LoadLora("c", "/adapters/c"))  # twice: refused, nothing asked of the workers
    (said,) = _router_said(wire)
    assert "has already been loaded" in said.error and not wire.take("worker")


def test_a_load_one_rank_fails_is_undone_on_every_rank():
    s, wire = make_tp()
    deliver(s, ROUTER, m.LoadLora("c", "/adapters/c"))
    _answer_workers(s, wire, error="OSError: no such file")
    assert wire.take("worker") == [m.UnloadLora("c", 3)] * 2
    (said,) = _router_said(wire)
    assert said.error == "rank 1: OSError: no such file" and said.adapters == ("a", "b")
    generate(s, "x", prompt(20), lora="c")
    assert any(isinstance(msg, m.RequestFailed) and msg.status == 404 for msg in wire.take("router"))


def test_an_unloaded_adapter_is_refused_at_once_and_freed_once_its_requests_end():
    s, wire = make_tp()
    generate(s, "x", prompt(20), lora="a", max_tokens=3)
    run_step(s, wire)  # its prefill: it holds slot 1
    deliver(s, ROUTER, m.UnloadLora("a"))
    (said,) = _router_said(wire)
    assert (said.error, said.adapters) == ("", ("b",))
    assert not [msg for p, msg in wire.sent if isinstance(msg, m.UnloadLora)]  # x still holds its slot
    generate(s, "y", prompt(20, 3), lora="a")
    assert any(isinstance(msg, m.RequestFailed) and msg.status == 404 for msg in wire.take("router"))
    seqs = run_all(s, wire)  # x runs to its end through slot 1 still
    assert seqs and all(w.lora == 1 for w in seqs)
    assert [msg for p, msg in wire.sent if isinstance(msg, m.UnloadLora)] == [m.UnloadLora("a", 1)] * 2
    deliver(s, ROUTER, m.UnloadLora("a"))
    (said,) = _router_said(wire)
    assert "cannot be found" in said.error


def test_a_replaced_adapter_takes_a_new_slot_and_a_prefix_chain_of_its_own():
    s, wire = make_tp()
    generate(s, "x", prompt(40), lora="a")
    run_all(s, wire)
    deliver(s, ROUTER, m.LoadLora("a", "/adapters/a2", replace=True))
    _answer_workers(s, wire)
    (said,) = _router_said(wire)
    assert (said.error, said.slot) == ("", 3)
    assert [msg for p, msg in wire.sent if isinstance(msg, m.UnloadLora)] == [m.UnloadLora("a", 1)] * 2
    wire.take("worker")
    generate(s, "y", prompt(40), lora="a")
    (w,) = run_step(s, wire)
    assert (w.lora, w.start_pos) == (3, 0)  # the old weights' cached blocks are not its
    run_all(s, wire)
    assert idle(s)


def test_slots_freed_are_taken_again_and_each_load_roots_a_chain_of_its_own():
    """Loads, replacements and unloads over and over keep the workers' bank as wide as the adapters held at once: a
    load takes the lowest slot the workers freed. Each load's weights take an id of their own, so new weights in a
    slot the old ones had never take the old ones' cached blocks; KV events name that id."""
    s, wire = make_tp()
    for turn in range(4):  # "a" replaced in place again and again: slots 3, 1, 3, 1 (each freed as it retires)
        deliver(s, ROUTER, m.LoadLora("a", f"/adapters/a{turn}", replace=True))
        asked = _answer_workers(s, wire)
        (said,) = _router_said(wire)
        assert said.error == "" and said.slot == (3 if turn % 2 == 0 else 1), (turn, said)
        assert asked == [m.LoadLora("a", f"/adapters/a{turn}", said.slot, replace=False)] * 2
        assert s.lora.lora_id("a") == 3 + turn  # never used again, slot or not
        freed = wire.take("worker")  # the old weights' slot, freed at once (no request holds it)
        assert freed == [m.UnloadLora("a", 1 if turn % 2 == 0 else 3)] * 2
        generate(s, f"x{turn}", prompt(40), lora="a")
        (w,) = run_step(s, wire)
        assert (w.lora, w.start_pos) == (said.slot, 0)  # the last weights' cached blocks (same slot) are not its
        run_all(s, wire)
    assert s.lora.next_slot == 4  # never past the launch's two and one more
    deliver(s, ROUTER, m.UnloadLora("b"))
    wire.take("worker")
    deliver(s, ROUTER, m.LoadLora("c", "/adapters/c"))
    asked = _answer_workers(s, wire)
    assert asked == [m.LoadLora("c", "/adapters/c", 2)] * 2  # b's slot, freed
    generate(s, "y", prompt(40), lora="c")
    (w,) = run_step(s, wire)
    assert (w.lora, w.start_pos) == (2, 0)
    run_all(s, wire)
    assert idle(s)


def test_lora_off_refuses_a_load():
    inst = InstanceConfig(role="local", engine_id="e", num_blocks=16, worker_endpoints=("w0",),
                          writer_endpoints=("x0",))
    s, wire = wired(DeploymentConfig(mode="local", model=preset("tiny"), local=inst), inst)
    deliver(s, ROUTER, m.LoadLora("c", "/adapters/c"))
    (said,) = _router_said(wire)
    assert "start it with --enable-lora" in said.error and not wire.take("worker")


def test_metrics_say_which_adapters_run_and_wait_as_vllms_lora_requests_info():
    """The gauge the Gateway API Inference Extension's LoRA affinity reads: comma-separated adapters of the running
    and the waiting requests, --max-loras, the time; only with --enable-lora."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def info(core) -> list:
        core.publish_metrics()
        text = generate_latest(core.metrics.registry).decode()
        return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "vllm:lora_requests_info"]

    s, wire = make(max_loras=1, num_blocks=4)
    generate(s, "a1", prompt(20), lora="a", max_tokens=30)  # all four blocks
    generate(s, "b1", prompt(20, 5), lora="b", max_tokens=30)  # waits for blocks
    s.wall = 1234.5
    ((labels, when),) = info(s)
    assert labels == {"max_lora": "1", "running_lora_adapters": "a", "waiting_lora_adapters": "b"}
    assert when == 1234.5
    inst = InstanceConfig(role="local", engine_id="e", num_blocks=4, worker_endpoints=("w0",),
                          writer_endpoints=("x0",))
    plain, _ = wired(DeploymentConfig(mode="local", model=preset("tiny"), local=inst), inst)
    assert info(plain) == []
