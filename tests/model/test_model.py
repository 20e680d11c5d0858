"""The model: paged attention against a dense reference, batch invariance, sliding
window, HF checkpoints, tensor parallelism over real processes, bad geometry."""
from __future__ import annotations

import json
import os
import random
import time

import msgspec
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from pushkv.config import ModelConfig, preset
from pushkv.kv.layout import blocks_for, pool_shape
from pushkv.messages import SeqWork
from pushkv.model import build_model, get_tokenizer, transformer
from pushkv.model.checkpoint import model_config_from_hf
from pushkv.model.reference import dense_logits, generate_dense
from pushkv.model.shard import shard_plan
from pushkv.model.weights import DictSource, hf_names, random_weights

TP_TIMEOUT_S = 50.0


def prompt_of(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def new_pool(model, num_blocks: int, block_size: int) -> torch.Tensor:
    # NaN everywhere: reading a slot that was never written poisons the output.
    # 6-d [blocks, layers, planes, heads, block, dim] even for hybrid models: the model
    # takes per-layer views of any physical arrangement (the pools split layer groups).
    lay = model.kv_layout(num_blocks, block_size)
    shape = (num_blocks, lay.num_layers, lay.kv_planes, lay.kv_heads, block_size, lay.head_dim)
    return torch.full(shape, float("nan"), dtype=model.dtype)


def shuffled_table(n: int, seed: int = 0) -> tuple[int, ...]:
    t = list(range(n))
    random.Random(seed).shuffle(t)
    return tuple(t)


def paged_generate(model, pool, prompt, max_tokens, table, chunk=None, on_prefill=None):
    """Greedy generation through execute(): prefill (optionally chunked), then decode."""
    chunk = chunk or len(prompt)
    out = []
    for s in range(0, len(prompt), chunk):
        last = s + chunk >= len(prompt)
        # an earlier chunk names the prompt's length, as the scheduler's do (dynamic RoPE reads it)
        got = model.execute([SeqWork(0, tuple(prompt[s:s + chunk]), s, table, sample=last,
                                     rope_len=0 if last else len(prompt))], pool)
        assert len(got) == (1 if last else 0)
        out += got
    if on_prefill:
        on_prefill(pool)
    pos = len(prompt)
    while len(out) < max_tokens:
        out += model.execute([SeqWork(0, (out[-1],), pos, table)], pool)
        pos += 1
    return out


def seq_kv(pool, table, num_tokens) -> bytes:
    """Bytes of a sequence's KV for its first num_tokens positions, in position order."""
    bs = pool.shape[4]
    blocks = pool[torch.tensor(table[:blocks_for(num_tokens, bs)])]
    flat = blocks.permute(1, 2, 3, 0, 4, 5).reshape(*blocks.shape[1:4], -1, blocks.shape[5])
    return flat[:, :, :, :num_tokens].contiguous().numpy().tobytes()


@pytest.fixture(scope="module")
def tiny():
    return build_model(preset("tiny"))


# --------------------------------------------------------------------- paged vs dense
@pytest.mark.parametrize("prompt_len, block_size, chunk", [
    (1, 16, None),  # a single token
    (16, 16, None),  # exactly one block
    (130, 16, None),  # many blocks, not a multiple
    (37, 8, None),  # non-multiple of the block size
    (45, 4, 16),  # chunked prefill: start_pos > 0 with several new tokens
])
def test_paged_matches_dense(tiny, prompt_len, block_size, chunk):
    prompt = prompt_of(prompt_len)
    n = 10
    table = shuffled_table(blocks_for(prompt_len + n, block_size) + 3, seed=prompt_len)
    pool = new_pool(tiny, len(table) + 2, block_size)
    assert paged_generate(tiny, pool, prompt, n, table, chunk) == generate_dense(tiny, prompt, n)


def test_paged_logits_close_to_dense(tiny):
    prompt = prompt_of(50)
    pool = new_pool(tiny, 8, 16)
    got = tiny.logits([SeqWork(0, tuple(prompt), 0, shuffled_table(8))], pool)[0]
    want = dense_logits(tiny, prompt, 1)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny", "small", "medium"])
def test_greedy_output_not_degenerate(name):
    model = build_model(preset(name))
    out = paged_generate(model, new_pool(model, 8, 16), prompt_of(20, seed=7), 32, shuffled_table(8))
    assert len(set(out)) > 1, out


def test_random_weights_are_reproducible():
    cfg = preset("tiny", seed=3)
    a, b = random_weights(cfg), random_weights(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"],
                           random_weights(preset("tiny"))["model.embed_tokens.weight"])


# ------------------------------------------------------------------ batch invariance
def _run_batch(model, jobs, pool):
    """jobs: list of (seq_id, prompt, table); prefill all together then decode 4 steps together."""
    outs = {sid: [] for sid, _, _ in jobs}
    got = model.execute([SeqWork(sid, tuple(p), 0, t) for sid, p, t in jobs], pool)
    for (sid, _, _), tok in zip(jobs, got):
        outs[sid].append(tok)
    for step in range(4):
        work = [SeqWork(sid, (outs[sid][-1],), len(p) + step, t) for sid, p, t in jobs]
        for (sid, _, _), tok in zip(jobs, model.execute(work, pool)):
            outs[sid].append(tok)
    return outs


def test_batch_invariance_deterministic(tiny):
    assert tiny.cfg.deterministic
    a = (0, prompt_of(45, seed=2), (5, 1, 9, 3, 12))
    b = (1, prompt_of(70, seed=3), (0, 2, 4, 6, 8, 10, 11))
    pool_alone, pool_batched = new_pool(tiny, 16, 16), new_pool(tiny, 16, 16)
    alone = _run_batch(tiny, [a], pool_alone)
    batched = _run_batch(tiny, [b, a], pool_batched)
    assert alone[0] == batched[0]
    n = len(a[1]) + 4
    assert seq_kv(pool_alone, a[2], n) == seq_kv(pool_batched, a[2], n)


def test_packed_mode_matches_per_seq_mode():
    packed = build_model(preset("tiny", deterministic=False))
    a = (0, prompt_of(33, seed=4), (7, 1, 3))
    b = (1, prompt_of(20, seed=5), (0, 2))
    alone = _run_batch(packed, [a], new_pool(packed, 8, 16))
    both = _run_batch(packed, [a, b], new_pool(packed, 8, 16))
    assert both[0] == alone[0]
    assert both[1] == _run_batch(packed, [b], new_pool(packed, 8, 16))[1]


# --------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("chunk_rows", [256, 1])  # 1: windowed prefill in many query chunks
def test_sliding_window_matches_dense_and_differs_from_full(monkeypatch, chunk_rows):
    monkeypatch.setattr(transformer, "WINDOW_CHUNK", chunk_rows)
    window = 8
    cfg = preset("tiny", sliding_window=window, window_layers=(1,))
    model = build_model(cfg)
    assert model.kv_layout(4, 16).window_layers == (1,) and model.kv_layout(4, 16).window == window
    prompt, n, bs = prompt_of(40, seed=9), 8, 4
    table = shuffled_table(blocks_for(len(prompt) + n, bs), seed=1)

    def poison_outside_window(pool):
        # The window layer must never read KV older than the window (P may not send it).
        old = len(prompt) - window + 1
        for p in range(old):
            pool[table[p // bs], 1, :, :, p % bs] = float("nan")

    got = paged_generate(model, new_pool(model, len(table), bs), prompt, n, table,
                         on_prefill=poison_outside_window)
    assert got == generate_dense(model, prompt, n)
    full = build_model(preset("tiny"))
    windowed_logits = dense_logits(model, prompt, 1)[0]
    assert not torch.allclose(windowed_logits, dense_logits(full, prompt, 1)[0], atol=1e-3)
    # Chunked prefill crossing the window boundary goes through the explicit mask.
    again = paged_generate(model, new_pool(model, len(table), bs), prompt, n, table, chunk=6)
    assert again == got


# ------------------------------------------------------------------------- checkpoints
def write_checkpoint(path, cfg: ModelConfig, arch: str, sharded: bool):
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in random_weights(cfg).items()}
    if sharded:
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2],
                  "model-00002-of-00002.safetensors": names[1::2]}
        weight_map = {}
        for fname, keys in halves.items():
            save_file({k: tensors[k] for k in keys}, os.path.join(path, fname))
            weight_map.update({k: fname for k in keys})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": [arch], "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "torch_dtype": "float32", "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "eos_token_id": 3, "bos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_tokenizer(os.path.join(path, "tokenizer.json"), cfg.vocab_size)


def write_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(path)


@pytest.mark.parametrize("arch, overrides, sharded", [
    ("LlamaForCausalLM", {"qk_norm": False}, False),
    ("Qwen3ForCausalLM", {"tie_embeddings": True}, True),
])
def test_checkpoint_round_trip(tmp_path, arch, overrides, sharded):
    cfg = preset("tiny", seed=11, **overrides)
    write_checkpoint(tmp_path, cfg, arch, sharded)
    loaded_cfg = model_config_from_hf(str(tmp_path))
    assert loaded_cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert loaded_cfg.eos_token_id == 3
    loaded = build_model(loaded_cfg)
    direct = build_model(cfg, source=DictSource(random_weights(cfg)))
    prompt = prompt_of(21, seed=5)
    want = paged_generate(direct, new_pool(direct, 4, 16), prompt, 6, (2, 0, 3, 1))
    assert paged_generate(loaded, new_pool(loaded, 4, 16), prompt, 6, (2, 0, 3, 1)) == want

    tok = get_tokenizer(loaded_cfg)
    ids = tok.encode("hello lazy fox")
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "hello lazy fox"
    assert (tok.bos_token_id, tok.eos_token_id) == (2, 3)


def test_checkpoint_errors(tmp_path):
    cfg = preset("tiny")
    write_checkpoint(tmp_path, cfg, "GPTNeoXForCausalLM", False)
    with pytest.raises(ValueError, match=r"architectures \['GPTNeoXForCausalLM'\]: not supported"):
        model_config_from_hf(str(tmp_path))
    write_checkpoint(tmp_path, cfg, "Qwen3ForCausalLM", False)
    with pytest.raises(ValueError, match="does not match checkpoint"):
        build_model(preset("tiny", checkpoint=str(tmp_path), num_layers=3))


def test_byte_tokenizer():
    tok = get_tokenizer(preset("tiny"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (256, 257, 320)
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode())
    assert tok.decode([256] + ids + [257, 300]) == "héllo"
    assert tok.decode([0xC3]) == "\ufffd"


# --------------------------------------------------------------------- tensor parallel
TP_PROMPT = prompt_of(23, seed=8)
TP_STEPS = 4


def _tp_run(model, pool):
    """Prefill + decode; returns (tokens, stacked logits)."""
    table = (3, 0, 2, 1)
    logits = [model.logits([SeqWork(0, tuple(TP_PROMPT), 0, table)], pool)[0]]
    for i in range(TP_STEPS):
        tok = int(logits[-1].argmax())
        logits.append(model.logits([SeqWork(0, (tok,), len(TP_PROMPT) + i, table)], pool)[0])
    return [int(l.argmax()) for l in logits], torch.stack(logits)


def _tp_worker(rank, world, init_file, out_dir, cfg_json):
    done = False
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=world)
    try:
        cfg = msgspec.json.decode(cfg_json, type=ModelConfig)
        model = build_model(cfg, tp_rank=rank, tp_size=world, group=torch.distributed.group.WORLD)
        lay = model.kv_layout(4, 16)
        pool = torch.zeros(pool_shape(lay))
        tokens, logits = _tp_run(model, pool)
        torch.save({"tokens": tokens, "logits": logits, "pool": pool,
                    "head_start": lay.head_start, "kv_heads": lay.kv_heads},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        # every rank done with gloo before any tears it down: a rank that destroys the group
        # while its peer is still in a collective aborts the peer ("terminate called ...")
        torch.distributed.barrier()
        done = True
    finally:
        torch.distributed.destroy_process_group()
    if done:  # skip interpreter teardown: threads of gloo still joinable there aborted a rank now and
        os._exit(0)  # then ("terminate called without an active exception", SIGABRT), results already saved


def run_tp_ranks(worker, tp: int, tmp_path, cfg: ModelConfig, timeout_s: float) -> None:
    """Spawn ``worker(rank, tp, init_file, out_dir, cfg_json)`` on every rank; fail past the deadline."""
    ctx = mp.start_processes(worker, args=(tp, str(tmp_path / "init"), str(tmp_path), msgspec.json.encode(cfg)),
                             nprocs=tp, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"tp={tp} workers did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("tp, engine", [(2, "per-seq"), (4, "per-seq"), (2, "batched")])
def test_tensor_parallel_matches_single_rank(tmp_path, tp, engine):
    cfg = preset("tiny", engine=engine)  # 4 query heads, 2 KV heads: tp=4 replicates each KV head
    run_tp_ranks(_tp_worker, tp, tmp_path, cfg, TP_TIMEOUT_S)
    single = build_model(cfg)
    pool1 = torch.zeros(pool_shape(single.kv_layout(4, 16)))
    tokens, logits = _tp_run(single, pool1)
    for rank in range(tp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tokens"] == tokens
        torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=1e-4)
        h0, n = got["head_start"], got["kv_heads"]
        assert (h0, n) == ((rank * 2 // tp, 1) if tp > 2 else (rank, 1))
        torch.testing.assert_close(got["pool"], pool1[:, :, :, h0:h0 + n], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------- bad geometry
@pytest.mark.parametrize("heads, kv_heads, inter, tp, rank, want", [
    # want = (q_start, q_heads, kv_start, kv_heads) or an error fragment
    (8, 4, 64, 1, 0, (0, 8, 0, 4)),
    (8, 4, 64, 2, 1, (4, 4, 2, 2)),
    (8, 2, 64, 4, 3, (6, 2, 1, 1)),  # replicated KV heads
    (8, 2, 64, 8, 2, (2, 1, 0, 1)),
    (8, 4, 64, 3, 0, "num_heads=8 is not divisible"),
    (8, 4, 60, 8, 0, "intermediate_size=60"),
    (12, 6, 64, 4, 0, "num_kv_heads=6 is not divisible"),
    (8, 4, 64, 8, 0, (0, 1, 0, 1)),
    (6, 4, 64, 2, 0, "multiple of num_kv_heads"),
    (16, 8, 64, 16, 0, (0, 1, 0, 1)),
    (16, 2, 64, 4, 2, (8, 4, 1, 1)),
    (12, 3, 72, 6, 0, (0, 2, 0, 1)),
    (12, 3, 72, 4, 0, "tp_size=4 > num_kv_heads=3"),
    (8, 4, 64, 2, 2, "bad tensor-parallel rank"),
])
def test_shard_plan(heads, kv_heads, inter, tp, rank, want):
    cfg = preset("tiny", num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            shard_plan(cfg, rank, tp)
        with pytest.raises(ValueError):
            build_model(cfg, rank, tp)
    else:
        p = shard_plan(cfg, rank, tp)
        assert (p.q_start, p.q_heads, p.kv_start, p.kv_heads) == want


@pytest.mark.parametrize("overrides", [
    {"sliding_window": 4, "window_layers": (5,)},
    {"head_dim": 15},
    {"dtype": "int8"},
])
def test_bad_config_raises(overrides):
    with pytest.raises(ValueError):
        build_model(preset("tiny", **overrides))


def test_bad_work_raises(tiny):
    pool = new_pool(tiny, 2, 16)
    assert tiny.execute([], pool) == []
    with pytest.raises(ValueError, match="cannot hold"):
        tiny.execute([SeqWork(0, tuple(range(40)), 0, (0, 1))], pool)
    with pytest.raises(ValueError, match="outside vocab"):
        tiny.execute([SeqWork(0, (999,), 0, (0,))], pool)
    with pytest.raises(ValueError, match="pool shape"):
        tiny.execute([SeqWork(0, (1,), 0, (0,))], torch.zeros(2, 3, 2, 2, 16, 16))


def test_hf_names_cover_weights(tiny):
    names = {n for n, _ in hf_names(tiny.cfg)}
    assert "model.layers.1.self_attn.q_norm.weight" in names and "lm_head.weight" in names
