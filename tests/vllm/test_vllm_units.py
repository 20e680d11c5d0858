"""pushkv.vllm's pure parts, no vLLM needed: KV memory description and block
mapping over views laid out as vLLM 0.32 lays them, kv_transfer_params
parsing, the proxy's two request bodies, the shared-memory allocation hook, the
worker half's bookkeeping of layer-streamed requests."""
import os
import select
import stat
import threading
import time

import pytest
import torch

from pushkv.kv import layer_events
from pushkv.vllm import params as P
from pushkv.vllm import regions as R
from pushkv.vllm.memory import SharedKVAllocation
from pushkv.vllm.proxy import Proxy


def views(num_layers, num_blocks, page_shape, layer_major=True, dtype=torch.float32):
    """Per-layer [B, ...page] views of one flat buffer, as allocate_kv_cache makes them."""
    elem = torch.tensor([], dtype=dtype).element_size()
    page = 1
    for n in page_shape:
        page *= n
    buf = torch.zeros(num_layers * num_blocks * page * elem, dtype=torch.int8)
    out = {}
    for layer in range(num_layers):
        if layer_major:  # LBHNC: layer outermost
            off, bstride = layer * num_blocks * page, page
        else:  # block outermost: a block holds every layer's page
            off, bstride = layer * page, num_layers * page
        inner = []
        acc = 1
        for n in reversed(page_shape):
            inner.append(acc)
            acc *= n
        out[f"layers.{layer}.attn"] = torch.as_strided(buf.view(dtype), (num_blocks, *page_shape),
                                                       (bstride, *reversed(inner)), off)
    return buf, out


@pytest.mark.parametrize("layer_major", [True, False])
def test_describe_reads_offsets_strides_and_pages(layer_major):
    buf, v = views(2, 8, (2, 4, 16, 32), layer_major)
    mem = R.describe(v, buf.data_ptr(), buf.numel())
    page = 2 * 4 * 16 * 32 * 4
    assert mem.num_blocks == 8 and len(mem.layers) == 2
    assert [lr.page_bytes for lr in mem.layers] == [page, page]
    if layer_major:
        assert [(lr.offset, lr.block_stride) for lr in mem.layers] == [(0, page), (8 * page, page)]
    else:
        assert [(lr.offset, lr.block_stride) for lr in mem.layers] == [(0, 2 * page), (page, 2 * page)]


def test_describe_refuses_memory_outside_the_allocation_and_unknown_layouts():
    buf, v = views(1, 4, (2, 8))
    other = torch.zeros(1 << 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="outside the shared allocation"):
        R.describe(v, other.data_ptr(), other.numel())
    flat = {"l": torch.zeros(4, 8)}  # no layout of vLLM's
    t = flat["l"]
    with pytest.raises(ValueError, match="not a layout"):
        R.describe(flat, t.data_ptr(), t.untyped_storage().nbytes())
    shared = dict(v, again=v["layers.0.attn"])  # a KV-sharing layer is listed once
    assert len(R.describe(shared, buf.data_ptr(), buf.numel()).layers) == 1


PAGE = 64
LM = R.KVMemory(2 * 16 * PAGE, 16, (R.LayerRegion(0, PAGE, PAGE), R.LayerRegion(16 * PAGE, PAGE, PAGE)))
BM = R.KVMemory(2 * 16 * PAGE, 16, (R.LayerRegion(0, 2 * PAGE, PAGE), R.LayerRegion(PAGE, 2 * PAGE, PAGE)))


@pytest.mark.parametrize("src,src_blocks,dst,dst_blocks,expect", [
    # contiguous on both sides: one descriptor per layer
    (LM, [0, 1, 2], LM, [5, 6, 7], [(0, 5 * PAGE, 3 * PAGE), (16 * PAGE, 21 * PAGE, 3 * PAGE)]),
    # a gap on D splits the run
    (LM, [0, 1, 2], LM, [5, 6, 9], [(0, 5 * PAGE, 2 * PAGE), (2 * PAGE, 9 * PAGE, PAGE),
                                     (16 * PAGE, 21 * PAGE, 2 * PAGE), (18 * PAGE, 25 * PAGE, PAGE)]),
    # block-outermost layouts: a block's layers are adjacent, consecutive blocks merge whole
    (BM, [3, 4], BM, [0, 1], [(6 * PAGE, 0, 4 * PAGE)]),
    # D registered only the blocks it lacked (prefix cache hit): aligned at the end
    (LM, [0, 1, 2, 3], LM, [10, 11], [(2 * PAGE, 10 * PAGE, 2 * PAGE), (18 * PAGE, 26 * PAGE, 2 * PAGE)]),
    (LM, [4], LM, [], []),
])
def test_map_blocks(src, src_blocks, dst, dst_blocks, expect):
    assert R.map_blocks(src, src_blocks, dst, dst_blocks) == expect


def test_map_blocks_refuses_mismatches():
    small = R.KVMemory(16 * 32, 16, (R.LayerRegion(0, 32, 32),) * 2)
    with pytest.raises(ValueError, match="pages differ"):
        R.map_blocks(LM, [0], small, [0])
    with pytest.raises(ValueError, match="only 1"):
        R.map_blocks(LM, [0], LM, [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        R.map_blocks(LM, [16], LM, [0])


# heads outermost in a page: P TP 2 (one head of HEAD bytes a page) and D TP 1 (both heads)
HEAD = 32
P2 = R.KVMemory(2 * 16 * HEAD, 16, (R.LayerRegion(0, HEAD, HEAD, HEAD), R.LayerRegion(16 * HEAD, HEAD, HEAD, HEAD)),
                2)
D1 = R.KVMemory(2 * 16 * PAGE, 16, (R.LayerRegion(0, PAGE, PAGE, HEAD), R.LayerRegion(16 * PAGE, PAGE, PAGE, HEAD)),
                2)


@pytest.mark.parametrize("src,src_blocks,dst,dst_blocks,heads,expect", [
    # P rank 0's head into D's head 0 of each page: one run per block (D's pages interleave the heads)
    (P2, [0, 1], D1, [5, 6], (0, 0, 1), [(0, 5 * PAGE, HEAD), (HEAD, 6 * PAGE, HEAD),
                                         (16 * HEAD, 21 * PAGE, HEAD), (17 * HEAD, 22 * PAGE, HEAD)]),
    # P rank 1's head: D's head 1, half a page in
    (P2, [3], D1, [5], (0, 1, 1), [(3 * HEAD, 5 * PAGE + HEAD, HEAD), (16 * HEAD + 3 * HEAD, 21 * PAGE + HEAD, HEAD)]),
    # D TP 1 -> a rank of TP 2 (the other way round): head 1 of D's page is all of the other's
    (D1, [2, 3], P2, [0, 1], (1, 0, 1), [(2 * PAGE + HEAD, 0, HEAD), (3 * PAGE + HEAD, HEAD, HEAD),
                                         (18 * PAGE + HEAD, 16 * HEAD, HEAD), (19 * PAGE + HEAD, 17 * HEAD, HEAD)]),
])
def test_map_blocks_moves_the_heads_two_tp_sizes_share(src, src_blocks, dst, dst_blocks, heads, expect):
    assert R.map_blocks(src, src_blocks, dst, dst_blocks, heads) == expect


def test_map_blocks_by_head_needs_the_heads_known():
    with pytest.raises(ValueError, match="heads differ"):
        R.map_blocks(LM, [0], LM, [0], (0, 0, 1))  # no head_bytes: pages are moved whole only
    assert P2.same_heads(D1) and not P2.same_pages(D1)


def test_describe_splits_pages_by_head_when_heads_are_outermost():
    buf, v = views(2, 8, (2, 4, 16), dtype=torch.float32)  # [heads, block_size, 2 * head_size]
    mem = R.describe(v, buf.data_ptr(), buf.numel(), kv_heads=2, total_kv_heads=4)
    assert [lr.head_bytes for lr in mem.layers] == [4 * 16 * 4] * 2 and mem.total_kv_heads == 4
    assert all(lr.head_bytes == 0 for lr in R.describe(v, buf.data_ptr(), buf.numel(), kv_heads=3).layers)


def test_kv_memory_travels_as_msgpack():
    import msgspec

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(LM), type=R.KVMemory) == LM


SRC = {"engine_id": "P-1", "tp": 1, "handshake": ["tcp://127.0.0.1:7001"]}


@pytest.mark.parametrize("params,expect", [
    (None, None),
    ({"other": 1}, None),
    ({"pushkv": {"role": "prefill", "transfer_id": "t1"}}, P.Leg("prefill", "t1")),
    ({"pushkv": {"role": "decode", "transfer_id": "t1", "source": SRC}},
     P.Leg("decode", "t1", P.parse_source(SRC))),
])
def test_parse_leg(params, expect):
    assert P.parse_leg(params) == expect


@pytest.mark.parametrize("params,match", [
    ({"pushkv": "x"}, "must be an object"),
    ({"pushkv": {"role": "both", "transfer_id": "t"}}, "'prefill' or 'decode'"),
    ({"pushkv": {"role": "prefill", "transfer_id": ""}}, "non-empty string"),
    ({"pushkv": {"role": "decode", "transfer_id": "t"}}, "needs 'source'"),
    ({"pushkv": {"role": "decode", "transfer_id": "t", "source": dict(SRC, tp=2)}}, "one endpoint per P rank"),
])
def test_parse_leg_refuses_bad_params(params, match):
    with pytest.raises(P.ParamsError, match=match):
        P.parse_leg(params)


def test_settings_from_extra_config_and_env():
    s = P.settings("E", 2, {"handshake_port": 7100}, env={})  # one host: the port does not matter
    hs = [s.handshake_endpoint(r) for r in range(2)]
    d = P.socket_dir()
    assert hs == [f"ipc://{d}/E-0-hs", f"ipc://{d}/E-1-hs"]  # in the 0700 directory (checked below)
    assert P.source_dict(s.source()) == {"engine_id": "E", "tp": 2, "handshake": hs}
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5900", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
           "PUSHKV_SECRET_FILE": "/s"}
    s = P.settings("E", 1, None, env=env)
    assert (s.handshake_endpoint(0), s.secret_file) == ("tcp://10.0.0.1:5900", "/s")
    s = P.settings("E", 2, {"handshake_host": "10.0.0.2", "handshake_port": 7100, "secret_file": "/x"}, env={})
    assert [s.handshake_endpoint(r) for r in range(2)] == ["tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"]
    ep = P.settings("E", 1, None, env={}).cmd_endpoint(0)
    assert ep.startswith("ipc:///") and "@" not in ep  # a file in a 0700 directory, not the abstract namespace
    d = os.path.dirname(ep[len("ipc://"):])
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.stat(d).st_uid == os.getuid()


@pytest.mark.parametrize("extra,env", [
    ({"handshake_host": "127.0.0.1"}, {}),  # loopback too: another local user reaches it
    (None, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1"}),
])
def test_a_tcp_handshake_without_a_secret_is_refused(extra, env):
    with pytest.raises(ValueError, match="needs a secret for CURVE"):
        P.settings("E", 1, extra, env=env)


def test_proxy_legs_share_one_transfer_id():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 16, "stream": True, "stream_options": {}, "temperature": 0}
    p, d = Proxy.legs(body, "tid", SRC)
    assert p == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "temperature": 0,
                 "kv_transfer_params": {"pushkv": {"role": "prefill", "transfer_id": "tid"}}}
    assert d["max_tokens"] == 16 and d["stream"] is True
    assert d["kv_transfer_params"] == {"pushkv": {"role": "decode", "transfer_id": "tid", "source": SRC}}
    assert P.parse_leg(d["kv_transfer_params"]).source.handshake == ("tcp://127.0.0.1:7001",)
    assert "kv_transfer_params" not in body  # the client's body is left alone


def test_proxy_chat_legs_keep_the_messages_and_give_p_one_token():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    p, d = Proxy.legs(body, "tid", SRC)
    assert p == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                 "kv_transfer_params": {"pushkv": {"role": "prefill", "transfer_id": "tid"}}}
    assert d["max_completion_tokens"] == 40 and d["top_logprobs"] == 2 and d["messages"] == body["messages"]


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (404, "not_found_error"),
                                          (502, "bad_gateway"), (500, "server_error")])
def test_proxy_errors_have_openais_shape(status, kind):
    import json as _json

    resp = Proxy._error(status, "why", param="prompt")
    assert resp.status == status
    assert _json.loads(resp.body) == {"error": {"message": "why", "type": kind, "param": "prompt", "code": status}}


@pytest.mark.parametrize("status, answer, want", [
    (400, {"error": {"message": "messages.0.role: Field required", "type": "BadRequestError", "param": None,
                     "code": 400}}, "messages.0.role: Field required"),
    (500, {"error": {"message": "boom", "type": "InternalServerError"}}, "KV transfer failed"),
    (400, b"not json", "KV transfer failed"),
])
def test_proxy_relays_what_d_said_of_a_bad_request(status, answer, want):
    """D refusing the client's request (4xx with vLLM's error) is the client's error, told as D put it,
    in OpenAI's shape; anything else is named a failed transfer with its id."""
    import asyncio
    import json as _json

    async def run():
        async def prefill_ok():
            return None

        data = answer if isinstance(answer, bytes) else _json.dumps(answer).encode()
        return await Proxy(["http://p"], ["http://d"])._failed(status, data, asyncio.ensure_future(prefill_ok()), "t1")

    resp = asyncio.run(run())
    err = _json.loads(resp.body)["error"]
    assert resp.status == status and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert err["message"].startswith(want) and (("t1" in err["message"]) == (want == "KV transfer failed"))


def test_shared_allocation_hook_takes_only_the_kv_buffer():
    alloc = SharedKVAllocation("pushkv-test")
    with alloc:
        other = torch.zeros(3, 4)  # not the KV buffer: a plain tensor
        kv = torch.zeros(1 << 20, dtype=torch.int8, device="cpu")
        later = torch.zeros(64, dtype=torch.int8)  # only the first int8 buffer is taken
    assert torch.zeros is not None and alloc.tensor is kv
    assert alloc.base_addr == kv.data_ptr() and alloc.nbytes == 1 << 20
    assert later.data_ptr() != alloc.base_addr and other.dtype == torch.float32
    # another mapping of the same memfd sees the writes: this is how the writer sees vLLM's KV
    import mmap

    mm = mmap.mmap(alloc.fd, alloc.nbytes)
    kv[123] = 7
    assert mm[123] == 7
    mm.close()
    assert os.readlink(f"/proc/self/fd/{alloc.fd}").startswith("/memfd:pushkv-test")
    os.close(alloc.fd)


@pytest.mark.parametrize("raw, want", [(b"{not json", 400), (b'{"prompt": "hi"}', None)])
def test_proxy_reads_json_bodies_once_for_every_protocol(raw, want):
    """The three front handlers share one body reader: not JSON is a 400 naming it, JSON comes back parsed."""
    import asyncio
    import json as _json

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    class Body:  # the request's payload stream
        def __init__(self, data):
            self.data = data

        def set_read_chunk_size(self, n):
            pass

        async def readany(self):
            data, self.data = self.data, b""
            return data

    async def run():
        req = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                                  payload=Body(raw))
        return await Proxy._json(req)

    got = asyncio.run(run())
    if want is None:
        assert got == {"prompt": "hi"}
    else:
        assert isinstance(got, web.Response) and got.status == want
        assert _json.loads(got.body)["error"]["message"] == "body must be JSON"


@pytest.mark.parametrize("extra", [{}, {"rank": 3, "tp": 4, "model_id": "m", "transfer_s": 2.5, "secret_file": "/s"}])
def test_writer_args_round_trip_through_the_command_line(extra):
    """The connector's command starts the writer with exactly what it meant (one copy of the flags)."""
    from pushkv.vllm.writer_args import WriterArgs, parse

    a = WriterArgs(role="decode", engine_id="e", fd=7, memory="ab", cmd_endpoint="ipc:///c", event_endpoint="ipc:///e",
                   handshake_endpoint="tcp://h:1", parent_pid=42, **extra)
    argv = a.argv()
    assert argv[1:3] == ["-m", "pushkv.vllm.writer"] and parse(argv[3:]) == a


class _Sent:  # the worker's command socket to its writer: what it sent
    def __init__(self):
        self.msgs = []

    def send(self, data):
        from pushkv.vllm import wire as w

        self.msgs.append(w.DEC_TO_WRITER.decode(data))


def _worker():
    from pushkv.vllm.scheduler_side import StepMeta
    from pushkv.vllm.worker_side import WorkerSide

    ws = WorkerSide(P.settings("P-unit", 1, {}), 0, "prefill")
    ws.cmd = _Sent()
    return ws, StepMeta


def test_a_streams_early_answer_waits_until_vllm_hands_its_blocks_over():
    """A stream that ended before its request finished (a part failed): reporting it at once
    would have vLLM free the blocks of a running request; it is reported once the request is in
    the step's sends. A request that never streamed is reported at once, as before."""
    from pushkv.vllm import wire as w

    ws, StepMeta = _worker()
    ws.bind(StepMeta(idle=False, streams={"r1": ("T1", [4, 5], 256)}))
    ws._early += [w.BlocksSent("r1", "T1", False, "streamed part: boom"), w.BlocksSent("r2", "T2", True)]
    assert ws.transfer_results()[0] == {"r2"}
    ws.bind(StepMeta(idle=False, streams={"r1": ("T1", [4, 5, 6], 300)}))  # still prefilling
    assert ws.transfer_results()[0] == set()
    ws.bind(StepMeta(sends={"r1": "T1"}))  # vLLM's request_finished: the blocks wait on us now
    assert ws.transfer_results()[0] == {"r1"}
    ws._early.append(w.BlocksSent("r1", "T1", False, "transfer already failed"))  # its SendBlocks' answer
    assert ws.transfer_results()[0] == set()  # once only


def test_a_writer_dying_mid_stream_cancels_the_stream_and_frees_its_blocks_at_hand_over():
    from pushkv.vllm import wire as w

    ws, StepMeta = _worker()
    ws.bind(StepMeta(idle=False, streams={"r1": ("T1", [4], 128)}))
    ws._deaths.append(("pushkv writer (pid 1) died with status -9", {}, {}, dict(ws.streaming)))
    assert ws.transfer_results() == (set(), set(), set())  # the request still runs: its blocks are vLLM's
    why = "pushkv writer (pid 1) died with status -9 while streaming"
    assert ws.cmd.msgs == [w.CancelBlocks("r1", "T1", why, "prefill")]  # at the new writer: no wait for a registration
    ws.bind(StepMeta(sends={"r1": "T1"}))
    assert ws.transfer_results()[0] == {"r1"}  # free, whether or not the new writer got SendBlocks
    ws._early.append(w.BlocksSent("r1", "T1", False, why))  # the new writer's answer, if it got SendBlocks
    assert ws.transfer_results()[0] == set()


class _Proc:
    """Stands in for the writer's Popen: alive until killed."""

    pid = 4242

    def __init__(self):
        self.killed = False

    def poll(self):
        return -9 if self.killed else None

    def kill(self):
        self.killed = True

    def wait(self, timeout=None):
        return -9


def _events(ws):
    """The worker's event socket, bound; returns a PUSH into it (the writer's side)."""
    import zmq

    ws.events = ws.ctx.socket(zmq.PULL)
    ws.events.setsockopt(zmq.LINGER, 0)
    ws.events.bind(f"inproc://events-{id(ws)}")
    push = ws.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"inproc://events-{id(ws)}")
    return push


def test_a_preempted_stream_holds_the_step_until_the_writer_releases_it():
    """vLLM's handle_preemptions: the worker tells its writer and returns only once the writer says
    no WRITE reads the freed blocks; the writer's other events meanwhile wait for the step's results."""
    from pushkv import messages as m
    from pushkv.vllm import wire as w

    ws, _ = _worker()
    ws.proc = _Proc()
    push = _events(ws)
    try:
        push.send(m.encode(w.BlocksSent("r2", "T2", True)))
        push.send(m.encode(w.StreamReleased("r1", "T1")))
        ws.preempted({"r1": "T1"})
        assert ws.cmd.msgs == [w.StreamPreempted("r1", "T1")]
        assert ws._early == [w.BlocksSent("r2", "T2", True)] and not ws.proc.killed
        assert ws.transfer_results()[0] == {"r2"}
        ws.preempted({})  # no preemption: nothing sent, no wait
        assert len(ws.cmd.msgs) == 1
    finally:
        push.close(0)
        ws.events.close(0)


def test_a_writer_that_never_releases_a_preempted_stream_is_killed():
    """No answer within transfer_s: a late read could hand D another request's KV, so the writer
    dies (its WRITEs stop; D fails what it was writing; the supervisor restarts it)."""
    from pushkv.vllm.worker_side import WorkerSide

    ws = WorkerSide(P.settings("P-unit", 1, {"transfer_s": 0.3}), 0, "prefill")
    ws.cmd = _Sent()
    ws.proc = _Proc()
    push = _events(ws)
    try:
        ws.preempted({"r1": "T1"})
        assert ws.proc.killed
        ws.proc = _Proc()
        ws.proc.killed = True  # a dead writer reads nothing: no wait at all
        ws.preempted({"r3": "T3"})
    finally:
        push.close(0)
        ws.events.close(0)


@pytest.mark.parametrize("cached,blocks,tokens,why", [
    (0, 3, 300, ""),  # nothing cached: as before
    (256, 1, 300, ""),  # two blocks cached, the third registered
    (256, 2, 300, "2 blocks registered for tokens [256, 300), which fill 1 blocks"),
    (100, 2, 300, "not whole blocks of 128"),
    (384, 0, 300, "leaves nothing of the 300-token prompt"),
])
def test_cached_tokens_must_agree_with_the_registered_blocks(cached, blocks, tokens, why):
    got = R.cached_problem(128, blocks, tokens, cached)
    assert (why in got and got) if why else got == "", got
    assert "block size" in R.cached_problem(0, 1, 300, 128)


def test_marks_keep_their_order_with_a_preemption_behind_them():
    """A preemption notice is handled after every mark the worker sent before it: on the CPU at
    once; on a GPU behind the marks whose events are still waited for."""
    from pushkv.vllm import wire as w

    cpu = layer_events.MarkWaiter()
    a, pre = w.LayersStored("r1", "T1", 0, (1,), 128), w.StreamPreempted("r1", "T1")
    cpu.submit(a)
    cpu.submit(pre)
    assert cpu.ready() == [(a, ""), (pre, "")]
    cpu.close()

    go = threading.Event()

    class Ev:
        def synchronize(self):
            assert go.wait(10)

    gpu = layer_events.MarkWaiter(lambda handle: Ev())
    marked = w.LayersStored("r1", "T1", 0, (1,), 128, b"h")
    gpu.submit(marked)
    gpu.submit(pre)
    assert gpu.ready() == []  # the preemption waits behind the event
    go.set()
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        select.select([gpu.fd], [], [], 1.0)
        got += gpu.ready()
    assert got == [(marked, ""), (pre, "")]
    gpu.close()


def test_a_step_during_a_writer_restart_waits_for_the_socket_instead_of_spinning():
    """While a restart holds the event socket (up to the new writer's start), a step waits ``idle_wait_ms`` for it,
    where it used to return at once: vLLM steps back to back while requests wait on a transfer, and on a small
    machine that loop took the cores the new writer started on. Without a restart a busy step takes the socket at
    once."""
    import threading

    ws, StepMeta = _worker()
    waits: list[tuple[float, bool]] = []

    class Recorded:  # the worker's lock, each acquire's timeout and outcome kept
        def __init__(self):
            self.lock = threading.Lock()

        def acquire(self, timeout: float = -1) -> bool:
            got = self.lock.acquire(timeout=timeout)
            waits.append((timeout, got))
            return got

        def release(self):
            self.lock.release()

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    ws._lock = Recorded()
    ws.bind(StepMeta(idle=False))
    assert ws.transfer_results() == (set(), set(), set())
    assert waits == [(ws.s.idle_wait_ms / 1e3, True)]  # free: taken at once
    done, restarted = threading.Event(), threading.Event()
    ws._start_writer = lambda: (restarted.set(), done.wait(30))
    t = threading.Thread(target=ws._restart)
    t.start()
    assert restarted.wait(30)
    ws.bind(StepMeta(idle=False))
    assert ws.transfer_results() == (set(), set(), set())
    done.set()
    t.join(30)
    assert ws.restarts == 1
    assert waits[1] == (ws.s.idle_wait_ms / 1e3, False) and waits[1][0] > 0  # held by the restart: waited, then left


def test_a_dead_writers_transfers_end_while_its_successor_starts():
    """The restart holds the event socket until the new writer is ready (seconds, tens of them on a
    loaded machine; WRITER_READY_S and a retry for one that hangs): the dead writer's transfers end
    at the next step regardless, P's blocks free and D's loads failed, where they waited for that
    start."""
    import threading

    from pushkv.vllm import wire as w

    ws, StepMeta = _worker()
    ws.bind(StepMeta(sends={"r1": "T1"}, recvs={"r2": ("T2", [7, 8])}))

    class Dead:  # the writer, SIGKILLed
        pid = 1

        def wait(self) -> int:
            return -9

    ws.proc = Dead()  # type: ignore[assignment]
    starting, started = threading.Event(), threading.Event()

    def slow_start():  # the successor's start, under the restart's lock
        starting.set()
        started.wait(30)
        ws._stopping.set()  # (the supervisor then ends: one restart here)

    ws._start_writer = slow_start  # type: ignore[method-assign]
    t = threading.Thread(target=ws._supervise)
    t.start()
    try:
        assert starting.wait(30)
        assert ws.transfer_results() == ({"r1"}, {"r2"}, {"r2"})  # not after the start
        assert ws.take_load_errors() == {7, 8}
        why = "pushkv writer (pid 1) died with status -9"
        assert ws.cmd.msgs == [w.CancelBlocks("r1", "T1", why, "prefill")]  # queued for the new writer
        assert t.is_alive() and ws.restarts == 1
    finally:
        started.set()
        t.join(30)
    assert ws.transfer_results() == (set(), set(), set())  # once only


@pytest.mark.parametrize("cpu_s, before, verdict", [
    (3.0, 1.0, "starting"),  # it worked since the last look: a slow start on a loaded machine
    (3.0, 3.0, "stuck"),  # no CPU since: it waits on what will not come
    (0.0, 0.0, "stuck"),
    (-1.0, 0.0, "stuck"),  # its CPU time cannot be read
    (60.0, 30.0, "spinning"),  # working, but far past what a start takes
])
def test_a_writer_that_has_not_answered_is_killed_only_when_it_stopped_working(cpu_s, before, verdict):
    from pushkv.vllm.worker_side import start_verdict

    assert start_verdict(cpu_s, before) == verdict


_WORKS_THEN_ANSWERS = """
import os, sys, time, zmq
from pushkv import messages as m
from pushkv.vllm import wire as w
t = time.monotonic()
while time.monotonic() - t < float(sys.argv[2]):
    pass
s = zmq.Context().socket(zmq.PUSH)
s.connect(sys.argv[1])
s.send(m.encode(w.WriterReady(os.getpid(), "slow")))
time.sleep(5)
"""


@pytest.mark.parametrize("work_s, answers", [(1.5, True), (0.0, False)])
def test_a_slow_start_is_waited_on_and_a_stuck_one_killed(monkeypatch, tmp_path, work_s, answers):
    """A writer start on a loaded machine (seconds of CPU over a minute or more) is waited on past
    WRITER_READY_S while it works, where it was killed and started over, which on a machine that
    stays loaded never ends; one that stops working (here: never answers, sleeping) is killed."""
    import subprocess
    import sys

    import zmq

    from pushkv.vllm import wire as w
    from pushkv.vllm import worker_side

    monkeypatch.setattr(worker_side, "WRITER_READY_S", 0.5)
    ws, _ = _worker()
    endpoint = f"ipc://{tmp_path}/ev"
    ws.events = zmq.Context.instance().socket(zmq.PULL)
    ws.events.bind(endpoint)
    script = _WORKS_THEN_ANSWERS if answers else "import time; time.sleep(30)"
    ws._t0 = time.monotonic()
    ws.proc = subprocess.Popen([sys.executable, "-c", script, endpoint, str(work_s)],
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        if answers:
            assert ws._await(w.WriterReady, "test").pid == ws.proc.pid
            assert time.monotonic() - ws._t0 > 2 * worker_side.WRITER_READY_S  # waited on, past the bound
        else:
            with pytest.raises(RuntimeError, match="did not answer WriterReady .*stuck"):
                ws._await(w.WriterReady, "test")
            assert ws.proc.wait(5) == -9
    finally:
        ws.proc.kill()
        ws.proc.wait()
        ws.events.close(0)


@pytest.mark.parametrize("flag, env, key", [
    (None, None, None),  # instances without a key
    (None, "from-env", "from-env"),  # as vllm serve: $VLLM_API_KEY where --api-key is not given
    ("from-flag", "from-env", "from-flag"),  # the flag wins
    (None, "", None),
])
def test_the_proxy_probes_with_vllm_serves_key(monkeypatch, flag, env, key):
    from pushkv.vllm.proxy import probe_key
    if env is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env)
    assert probe_key(flag) == key
