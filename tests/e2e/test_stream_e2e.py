"""Chunked prefill and streaming push end to end: real processes over loopback, real NIXL.

Greedy tokens with ``--prefill-chunk 32`` (local, pull, and push with ``--push-stream
chunk``) must equal unchunked local mode's, token for token, run with P's TP size (as in
tests/e2e/test_layouts_e2e.py: the KV is then produced by the same per-rank computation), for
prompts of 1, 16, 37 and 300 tokens, in the layouts the repo supports: TP on P or D, block
sizes that differ both ways, an MLA-style latent cache (P rank 1 a replica that tracks the
stream and writes nothing) and a hybrid sliding-window model (which falls back to one
WRITE and says so). After each P/D request the KV bytes of every head in every D rank are
compared with the P rank that produced them, so a part that lands in the wrong place fails
even where a greedy token would not notice; and every pool is free again.

One deployment per layout; the prompts run inside it.
"""
from __future__ import annotations

import math

import pytest

from pushkv.kv import layout as L
from pushkv.protocol.tp import consumers_for, is_producer
from tests.support.deploy import concurrent, deployment, local_references, wait_pools_free
from tools.layout_report import kv_mismatches, prompt

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 6
NUM_BLOCKS = 64
LENGTHS = (1, 16, 37, 300)
PROMPTS = {n: prompt(n, n) for n in LENGTHS}
CHUNK = ("--prefill-chunk", "32")
# --push-pin-fraction 1: no request goes late (P holds, D registers after the relay: no stream),
# however many stream at once
STREAM = ("--mode", "push", "--push-stream", "chunk", "--push-pin-fraction", "1", *CHUNK)
# three layer groups of the small model's four layers (2, 1, 1): uneven on purpose
LAYER = ("--mode", "push", "--push-stream", "layer", "--push-stream-groups", "3", "--push-pin-fraction", "1")


def shape(p_tp: int, d_tp: int, p_bs: int, d_bs: int) -> tuple[str, ...]:
    return ("--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
            "--prefill-block-size", str(p_bs), "--decode-block-size", str(d_bs))


# id, model, flags, TP of the local reference (P's), what P's answer says of the stream
# (None: no P/D transfer, or pull, whose P answers before the READ and streams nothing)
CASES = [
    ("local-chunked", "small", ("--mode", "local", *CHUNK), 1, None),
    ("pull-chunked tp1->1", "small", ("--mode", "pull", "--pull-read", "background", *CHUNK), 1, None),
    ("push-chunk tp1->2 p32/d16", "small", STREAM + shape(1, 2, 32, 16), 1, "chunk"),
    ("push-chunk tp2->1 p16/d32", "small", STREAM + shape(2, 1, 16, 32), 2, "chunk"),
    ("push-chunk mla tp2->1 p16/d32", "mla", STREAM + shape(2, 1, 16, 32), 2, "chunk"),
    ("push-chunk hybrid tp1->1", "hybrid", STREAM, 1, "fallback: sliding-window layers"),
    ("push-layer tp1->2 p32/d16", "small", LAYER + shape(1, 2, 32, 16), 1, "layer"),
    ("push-layer chunked tp2->1 p16/d32", "small", LAYER + CHUNK + shape(2, 1, 16, 32), 2, "layer"),
    ("push-layer mla tp2->1 p16/d32", "mla", LAYER + shape(2, 1, 16, 32), 2, "layer"),
    ("push-layer hybrid tp1->1", "hybrid", LAYER, 1, "fallback: sliding-window layers"),
    # each P rank's WRITEs posted by its own second agent on a thread, one at a time through its link
    # queue (what UCX over TCP gets by default)
    ("push-layer threaded post tp2->1 p16/d32", "small",
     LAYER + ("--writer-post-thread", "on", "--link-window", "1") + shape(2, 1, 16, 32), 2, "layer"),
    # --staging pushkv: NIXL moves the writers' staging areas (host memory beside a host pool here, as
    # pinned memory beside a GPU pool there); P copies out before each post, D copies each part in once
    # both producers' parts landed (PartWritten) and the rest before reporting; D's area (2 MiB: 16 of
    # its 64 blocks) is smaller than the concurrent load needs, so registrations wait for room
    ("push-layer pushkv staging tp2->1 p16/d32", "small",
     LAYER + ("--staging", "pushkv", "--staging-mib", "2", "--link-window", "1") + shape(2, 1, 16, 32), 2, "layer"),
    # the same staging with chunk parts: each part carries every layer group of its chunk's blocks
    ("push-chunk pushkv staging tp1->2 p32/d16", "small",
     STREAM + ("--staging", "pushkv", "--staging-mib", "2", "--link-window", "1") + shape(1, 2, 32, 16), 1, "chunk"),
    ("push-chunk pushkv staging tp1->1", "small", STREAM + ("--staging", "pushkv", "--link-window", "1"), 1, "chunk"),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Unchunked local-mode tokens per (model, tp), each deployment started once."""
    return local_references(tmp_path_factory, PROMPTS, MAX_TOKENS, NUM_BLOCKS)


@pytest.mark.parametrize("name,model,flags,ref_tp,stream", CASES, ids=[c[0] for c in CASES])
def test_chunked_and_streamed_tokens_equal_local(name, model, flags, ref_tp, stream, references, tmp_path):
    ref = references(model, ref_tp)
    # --no-prefix-cache: the KV check reads the blocks an idle pool hands out first, which the prefix
    # cache would move (tests/e2e/test_prefix_e2e.py streams with the cache on)
    with deployment(tmp_path, *flags, "--model", model, "--num-blocks", str(NUM_BLOCKS), "--no-prefix-cache") as dep:
        cfg = dep.cfg
        early = 0  # streamed requests whose registration came before their first chunk ended
        for n, toks in PROMPTS.items():
            wait_pools_free(dep)  # idle pools hand out blocks 0.. on both sides (the KV check reads them)
            body = dep.complete(toks, MAX_TOKENS)
            assert body["choices"][0]["token_ids"] == ref[n], f"{n} tokens: differ from unchunked local tp={ref_tp}"
            wait_pools_free(dep)
            if cfg.mode == "local":
                continue
            if stream is not None:
                kv, tl = body["pushkv"]["kv"]["prefill"], body["pushkv"]["timeline"]
                assert kv["stream"].startswith(stream), (n, kv)
                # the tokens before the first part can leave: a chunk's, or a whole unit's (layer)
                first = 32 if stream == "chunk" else math.lcm(cfg.prefill.block_size, cfg.decode.block_size) - 1
                if stream not in ("chunk", "layer") or n <= first:  # no stream, or nothing whole before the end
                    assert kv["parts"] == 0, (n, kv)
                elif tl["prefill.registration_received"] < tl[
                        "prefill.stream_start" if stream == "chunk" else "prefill.layers_stored_0"]:
                    # D's registration was in when the first chunk ended (the first layer group was
                    # stored): a part left at once (on two busy cores D may register later, and the
                    # last WRITE then takes it all)
                    assert kv["parts"] > 0, (n, kv, tl)
                    early += 1
            if cfg.mode == "push":  # D counts what P's writers moved into it, the streamed parts with the last WRITE
                kv = body["pushkv"]["kv"]
                assert kv["decode"]["bytes"] == kv["prefill"]["bytes"] > 0, (n, kv)
            if "--staging" in flags or "--writer-post-thread" in flags:  # each WRITE's stamps (tools/stream_bench's
                # breakdown) in its order: asked; staged: its copy into P's area issued and seen done; posted;
                # from a poster thread: taken, its post call returned, seen ended; done. The last WRITE's number
                # is the parts' + 1 (P rank 0's or 1's: the first to report gives them)
                stamps = ("asked",) + (("stage_out_start", "stage_out_issued", "stage_out_done") if "--staging" in
                                       flags else ()) + ("posted",) + (("poster_picked", "poster_returned",
                                                                         "poster_ended") if "--writer-post-thread"
                                                                        in flags else ()) + ("done",)
                count = 0
                while f"prefill.w{count + 1}_asked" in tl:
                    count += 1
                    seq = [tl[f"prefill.w{count}_{s}"] for s in stamps]
                    assert seq == sorted(seq), (count, tl)
                    if "--staging" in flags:
                        assert tl[f"prefill.w{count}_copy_begun"] <= tl[f"prefill.w{count}_stage_out_done"], tl
                assert count >= 1 and f"prefill.w{count}_done" in tl, tl
            if "--staging" in flags and "decode.stage_in_part_first" in tl:  # D copied parts in before the rest
                assert tl["decode.stage_in_part_first"] <= tl["decode.stage_in_part_last"] < tl[
                    "decode.stage_in_start"] < tl["decode.kv_received"], tl
            p_table = range(L.blocks_for(n, cfg.prefill.block_size))
            d_table = range(L.blocks_for(n + MAX_TOKENS, cfg.decode.block_size))
            bad, compared = kv_mismatches(cfg, n, p_table, d_table)
            assert bad == [] and compared > 0, f"{n} tokens: {bad[:5]}"
        if cfg.mode == "local":
            return
        p_tp, d_tp = cfg.prefill.tp, cfg.decode.tp

        def per_rank(counters, k):
            return [counters.get(f"writer.{r}.{k}", 0) for r in range(p_tp)]

        if stream == "layer":  # every rank hears every group of every prefill step
            counters = dep.stats("prefill").counters
            steps = sum(-(-n // 32) for n in LENGTHS) if "--prefill-chunk" in flags else len(LENGTHS)
            groups = len(L.layer_groups(L.instance_layout(cfg, cfg.prefill, 0)))
            assert groups == 3 if model == "small" else groups > 1, groups
            assert per_rank(counters, "layer_marks_received") == [steps * groups] * p_tp, counters
            assert per_rank(counters, "stream_progress_received") == [0] * p_tp
        rounds = 1  # of the prompts
        if stream in ("chunk", "layer") and model == "small":  # several streams at once, mixed in P's steps
            got = concurrent(dep, [PROMPTS[n] for n in LENGTHS] * 2, MAX_TOKENS)
            assert got == [ref[n] for n in LENGTHS] * 2
            wait_pools_free(dep)
            rounds = 3
        counters = dep.stats("prefill").counters
        # a layer mark may trail P's SendKV (worker and scheduler send apart): counted late, dropped
        for k in ("transfers_failed", "command_refused", "write_post_failed", "stale_progress") + (
                () if stream == "layer" else ("late_progress",)):
            assert per_rank(counters, k) == [0] * p_tp, (k, counters)
        parts, posts = per_rank(counters, "parts"), per_rank(counters, "part_posts")
        if stream in ("chunk", "layer"):
            if stream == "chunk":  # every rank hears every chunk (37 tokens: 1; 300: 9)
                assert per_rank(counters, "stream_progress_received") == [10 * rounds] * p_tp
            assert sum(parts) > 0 or not early, parts
            for r in range(p_tp):  # producers write parts
                writes_to = len(consumers_for(r, p_tp, d_tp, cfg.model.cache_kv_heads)) if \
                    is_producer(r, p_tp, cfg.model.cache_kv_heads) else 0
                assert posts[r] == parts[r] * writes_to, (r, parts, posts)  # MLA: rank 1, a replica, writes none
        else:  # pull streams nothing; the hybrid push falls back to one WRITE, and its scheduler, reading the
            # same transfer plan as the writers, sends them no chunk either
            assert per_rank(counters, "stream_progress_received") == [0] * p_tp
            assert per_rank(counters, "layer_marks_received") == [0] * p_tp
            assert parts == posts == [0] * p_tp
        if "--link-window" in flags:  # every WRITE took its turn in its link's queue, one on the link at a time
            writes = per_rank(counters, "write_posts")
            assert per_rank(counters, "link_posts_queued") == [a + b for a, b in zip(posts, writes)], counters
            assert per_rank(counters, "link_inflight_peak") == [1] * p_tp, counters
            assert per_rank(counters, "link_queued") == [0] * p_tp, counters
        if "--staging" in flags:  # every WRITE (part or last) was copied into the mirror before it went
            writes = per_rank(counters, "write_posts")
            assert per_rank(counters, "stage_out_copies") == [a + b for a, b in zip(posts, writes)], counters
            d_counters = dep.stats("decode").counters
            received = sum(v for k, v in d_counters.items() if k.endswith(".kv_received"))
            staged_in = sum(v for k, v in d_counters.items() if k.endswith(".stage_in_copies"))
            assert received > 0 and staged_in == received, d_counters
            # D copied each part's cells (layer group x written block) in once both producers' parts had
            # landed, before the last WRITE, and after it only the rest: every cell of every transfer once
            d_groups = len(L.layer_groups(L.instance_layout(cfg, cfg.decode, 0)))
            cells = {k: sum(v for c, v in d_counters.items() if c.endswith(f".stage_in_{k}_cells"))
                     for k in ("part", "rest")}
            assert cells["part"] + cells["rest"] == rounds * d_tp * d_groups * sum(
                L.blocks_for(n, cfg.decode.block_size) for n in LENGTHS), (cells, d_counters)
            assert cells["part"] > 0 or not early, (cells, early)
            # P staged each cell (layer group x P block) of every transfer once per D rank it writes to, and
            # took room for those cells only: its area is cut per layer group, so a part of one group holds
            # that group's cells, not its blocks in every group
            p_groups = len(L.layer_groups(L.instance_layout(cfg, cfg.prefill, 0)))
            p_blocks = sum(L.blocks_for(n, cfg.prefill.block_size) for n in LENGTHS)
            for r in range(p_tp):
                writes_to = len(consumers_for(r, p_tp, d_tp, cfg.model.cache_kv_heads))
                assert counters[f"writer.{r}.stage_out_cells"] == rounds * writes_to * p_groups * p_blocks, counters
                assert counters[f"writer.{r}.stage_out_cells_taken"] == counters[f"writer.{r}.stage_out_cells"]
            for counters_of in (counters, d_counters):  # every slot of every area is back
                areas = {k.rsplit(".", 1)[0]: v for k, v in counters_of.items() if k.endswith(".staging_blocks")}
                assert areas and all(counters_of[f"{w}.staging_free_blocks"] == n for w, n in areas.items()), \
                    counters_of
            if name.startswith("push-layer pushkv staging"):
                assert areas == {"writer.0": 16}, areas  # D's: 2 MiB of 128 KiB blocks


def test_a_transfer_larger_than_the_staging_area_fails_and_frees_everything(tmp_path):
    """--staging pushkv with D's area (1 MiB: 8 of its 128 KiB blocks) smaller than a 300-token
    prompt needs (10): that request fails at once, saying what to raise; a short one then gets its
    tokens, and every block and staging slot is free again."""
    flags = ("--mode", "push", "--staging", "pushkv", "--staging-mib", "1", "--model", "small",
             "--num-blocks", str(NUM_BLOCKS)) + shape(2, 1, 16, 32)
    with deployment(tmp_path, *flags) as dep:
        status, body = dep.post("/v1/completions", {"prompt": PROMPTS[300], "max_tokens": MAX_TOKENS})
        assert status >= 500 and "staging" in str(body) and "--staging-mib" in str(body), (status, body)
        assert len(dep.complete(PROMPTS[16], MAX_TOKENS)["choices"][0]["token_ids"]) == MAX_TOKENS
        wait_pools_free(dep)
        d = dep.stats("decode").counters
        assert d["writer.0.staging_too_small"] == 1 and d["writer.0.staging_blocks"] == 8, d
        assert d["writer.0.staging_free_blocks"] == 8, d
        p = dep.stats("prefill").counters
        assert all(p[f"writer.{r}.staging_free_blocks"] == p[f"writer.{r}.staging_blocks"] for r in range(2)), p
