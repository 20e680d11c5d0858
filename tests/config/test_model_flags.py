"""The model flags as vLLM spells them (pushkv.config_flags): ``--model`` a directory, a Hugging
Face repo id (resolved from a local Hub cache laid out as huggingface_hub lays it out, offline),
or a random-weight shape with ``--load-format dummy``; ``--revision``, ``--tokenizer``,
``--served-model-name``, ``--max-model-len``, ``--dtype auto``, ``-tp``; the old spellings with
their one-line deprecations. Table-driven over ``user_config``; no process starts."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from processes import cli
from pushkv.config import DeploymentConfig, preset
from pushkv.config_flags import deprecations, user_config, weights_note
from tests.model.test_hf_reference import save_hf_checkpoint

REPO = "acme/tiny-qwen2"


def parse(*flags: str) -> dict:
    return vars(cli.build_parser().parse_args(["up", *flags]))


def config(*flags: str) -> DeploymentConfig:
    return user_config(parse(*flags))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "qwen2", seed=1)


@pytest.fixture()
def hub(tmp_path, ckpt, monkeypatch):
    """An offline Hub cache holding REPO at main and at tag v2 (a 3-layer variant)."""
    import huggingface_hub.constants as hc

    repo = tmp_path / "hub" / ("models--" + REPO.replace("/", "--"))
    v2 = save_hf_checkpoint(str(tmp_path / "v2"), "qwen2", seed=2, num_hidden_layers=3)
    for ref, src in (("main", ckpt), ("v2", v2)):
        commit = hashlib.sha1(ref.encode()).hexdigest()
        shutil.copytree(src, repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    # huggingface_hub reads both at import: the module's values are what it uses
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def test_model_takes_a_directory(ckpt):
    cfg = config("--model", ckpt)
    assert cfg.model.checkpoint == ckpt and cfg.model.architecture == "Qwen2ForCausalLM"
    assert cfg.served_names()[0] == ckpt
    assert deprecations(parse("--model", ckpt)) == []
    assert weights_note(cfg.model).startswith(f"weights: {ckpt} (Qwen2ForCausalLM")


def test_model_takes_a_hub_id_from_the_offline_cache(hub):
    cfg = config("--model", REPO)
    assert cfg.model.checkpoint.startswith(str(hub / "snapshots"))
    assert cfg.model.name == REPO and cfg.served_names()[0] == REPO  # vLLM's default served name
    # the one /v1/models lists; the snapshot's path still answers a request
    assert cfg.served_model_name == (REPO,) and cfg.model_aliases == (cfg.model.checkpoint,)
    assert cfg.model.num_layers == 2
    assert config("--model", REPO, "--revision", "v2").model.num_layers == 3
    assert config("--model", REPO, "--served-model-name", "mine").served_names() == ("mine",)


@pytest.mark.usefixtures("hub")
@pytest.mark.parametrize("flags, needle", [
    (("--model", "acme/absent"), "'acme/absent': not in the local Hugging Face cache"),
    (("--model", REPO, "--revision", "v9"), "revision 'v9': not in the local Hugging Face cache"),
    (("--model", "no-such-dir"), "'no-such-dir': no such directory, and not a Hugging Face repo id"),
    (("--model", "tiny", "--revision", "v2"), "--revision 'v2' needs --model to name a Hugging Face repo id"),
    (("--model", REPO, "--max-model-len", "100000"), r"--max-model-len 100000 must be in \[1, 512\]"),
])
def test_bad_model_flags_are_refused_by_name(flags, needle):
    with pytest.raises(ValueError, match=needle):
        config(*flags)


def test_load_format_dummy_keeps_the_shape_and_tokenizer_of_a_checkpoint(ckpt):
    model = config("--model", ckpt, "--load-format", "dummy").model
    assert model.checkpoint is None and model.tokenizer == ckpt and model.qkv_bias
    assert weights_note(model).startswith("RANDOM weights (--load-format dummy)")


@pytest.mark.parametrize("flags, fields", [
    (("--model", "tiny", "--load-format", "dummy"), {"model": preset("tiny")}),
    (("--model", "tiny", "--load-format", "dummy", "--dtype", "auto"), {"model": preset("tiny")}),
    (("-tp", "2",), {"prefill.tp": 2, "decode.tp": 2, "local.tp": 2}),
    (("--tensor-parallel-size", "2", "--decode-tp", "1"), {"prefill.tp": 2, "decode.tp": 1, "local.tp": 2}),
    (("--tp", "2", "--prefill-tp", "1"), {"prefill.tp": 1, "decode.tp": 2, "local.tp": 2}),
    (("--max-model-len", "1000"), {"max_model_len": 1000}),
])
def test_flags_set_fields(flags, fields):
    cfg = config(*flags)
    for dotted, want in fields.items():
        obj = cfg
        for part in dotted.split("."):
            obj = getattr(obj, part)
        assert obj == want, dotted


@pytest.mark.parametrize("flags, lines", [
    (("--model", "tiny", "--load-format", "dummy"), []),
    (("--load-format", "dummy"), []),
    (("--model", "tiny"), ["--model tiny serves random weights; that this needs no --load-format dummy is "
                           "deprecated: use --model tiny --load-format dummy"]),
    ((), ["no --model serves random weights; that this needs no --load-format dummy is deprecated: use "
          "--model small --load-format dummy"]),
    (("--model", "tiny", "--load-format", "dummy", "--tp", "2"),
     ["--tp is deprecated: use -tp/--tensor-parallel-size 2 (every side; --prefill-tp/--decode-tp override it)"]),
])
def test_old_spellings_get_one_line_each(flags, lines):
    assert deprecations(parse(*flags)) == lines


def test_checkpoint_flag_still_works_and_says_so(ckpt):
    assert config("--checkpoint", ckpt).model == config("--model", ckpt).model
    assert deprecations(parse("--checkpoint", ckpt)) == [f"--checkpoint is deprecated: use --model {ckpt}"]
    assert config("--model", ckpt, "--checkpoint", ckpt).model == config("--model", ckpt).model
    # a preset beside it named another model, whose shape was dropped without a word (an MLA preset over Llama)
    with pytest.raises(ValueError, match="name two models"):
        config("--model", "mla", "--checkpoint", ckpt)


def test_tokenizer_flag(ckpt, hub):
    assert config("--model", "tiny", "--load-format", "dummy", "--tokenizer", REPO).model.tokenizer \
        .startswith(str(hub / "snapshots"))
    assert config("--model", "tiny", "--load-format", "dummy", "--tokenizer", ckpt).model.tokenizer == ckpt


def test_tokenizer_revision_flag(ckpt, hub):
    """vLLM's --tokenizer-revision: the tokenizer's repo (--tokenizer, else --model's) at that revision."""
    v2 = str(hub / "snapshots" / hashlib.sha1(b"v2").hexdigest())
    main = str(hub / "snapshots" / hashlib.sha1(b"main").hexdigest())
    got = config("--model", "tiny", "--load-format", "dummy", "--tokenizer", REPO, "--tokenizer-revision", "v2")
    assert got.model.tokenizer == v2
    both = config("--model", REPO, "--tokenizer-revision", "v2").model  # the weights at main, the tokenizer at v2
    assert both.checkpoint == main and both.tokenizer == v2
    with pytest.raises(ValueError, match="--tokenizer-revision 'v2' applies to a Hugging Face repo id"):
        config("--model", ckpt, "--tokenizer-revision", "v2")
    with pytest.raises(ValueError, match="--tokenizer-revision 'v2' needs --tokenizer or --model"):
        config("--model", "tiny", "--load-format", "dummy", "--tokenizer-revision", "v2")
    with pytest.raises(ValueError, match="--tokenizer 'org/nope' revision 'v2': not in the local"):
        config("--model", "tiny", "--load-format", "dummy", "--tokenizer", "org/nope", "--tokenizer-revision", "v2")


def test_vllm_spellings_of_lengths_and_dtypes():
    """vLLM's human-readable integers (2k = 2000, 2K = 2048), --max-model-len auto (the model's own), and its dtype
    names half and float; a malformed length is an argparse error, not a traceback."""
    assert config("--model", "tiny", "--load-format", "dummy", "--max-model-len", "2k").max_model_len == 2000
    assert config("--model", "tiny", "--load-format", "dummy", "--max-model-len", "1K").max_model_len == 1024
    assert config("--model", "tiny", "--load-format", "dummy", "--max-model-len", "auto").max_model_len in (0, None)
    got = config("--model", "tiny", "--load-format", "dummy", "--max-num-batched-tokens", "2K")
    assert got.prefill.max_batch_tokens == 2048
    assert config("--model", "tiny", "--load-format", "dummy", "--dtype", "half").model.dtype == "float16"
    assert config("--model", "tiny", "--load-format", "dummy", "--dtype", "float").model.dtype == "float32"
    with pytest.raises(SystemExit):
        parse("--model", "tiny", "--max-model-len", "4x")
    from pushkv.vllm_serve import human_int

    assert [human_int(v) for v in ("16.1k", "4.1m", "25.6k", "0.5K")] == [16100, 4100000, 25600, 512]  # exact


def _bin_copy(src: str, dst, shards: int, legacy: bool = False) -> None:
    """``src``'s checkpoint with its weights as pytorch_model.bin (one file, or ``shards`` and their index), as
    older Hub repos hold them; ``legacy``: in torch.save's format before 1.6 (no zip, which torch cannot map)."""
    import json

    import torch
    from safetensors.torch import load_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(f"{src}/model.safetensors")
    if shards == 1:
        torch.save(tensors, dst / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
        return
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: tensors[n] for n in names[i::shards]}
        torch.save(part, dst / file, _use_new_zipfile_serialization=not legacy)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards, legacy", [(1, False), (3, False), (1, True), (3, True)])
def test_a_pytorch_model_bin_checkpoint_loads_as_its_safetensors_would(ckpt, tmp_path, shards, legacy):
    """vLLM's --load-format auto falls back to pytorch_model.bin where a repo has no safetensors; pushkv started the
    deployment and every worker then failed on "no model.safetensors". Every tensor, and a TP rank's slice of it,
    is read as from the same weights in safetensors; from a .bin of torch.save's legacy format too, which vLLM reads
    and torch cannot map (`pushkv up` ended in a traceback, "mmap can only be used with files saved with ...")."""
    from pushkv.model.checkpoint import CheckpointSource

    _bin_copy(ckpt, tmp_path / "bin", shards, legacy)
    model = config("--model", str(tmp_path / "bin")).model
    got, want = CheckpointSource(model.checkpoint), CheckpointSource(ckpt)
    assert sorted(got.weight_map) == sorted(want.weight_map)
    for name in want.weight_map:
        assert got.get(name).equal(want.get(name)), name
    q = "model.layers.1.self_attn.q_proj.weight"
    assert got.get(q, 0, 16, 32).equal(want.get(q, 0, 16, 32)) and got.get(q, 1, 8, 40).equal(want.get(q, 1, 8, 40))
    with pytest.raises(ValueError, match=r"--load-format safetensors: --model .* has no safetensors, only "
                                         r"pytorch_model.*\.bin \(--load-format auto reads it"):
        config("--model", str(tmp_path / "bin"), "--load-format", "safetensors")  # as vLLM's: those only


def test_a_checkpoint_without_weights_is_refused_before_anything_starts(ckpt, tmp_path):
    shutil.copytree(ckpt, tmp_path / "bare", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match=r"no weights: none of model\.safetensors\.index\.json or model\.safetensors "
                                         r"or pytorch_model\.bin\.index\.json or pytorch_model\.bin"):
        config("--model", str(tmp_path / "bare"))
    assert config("--model", str(tmp_path / "bare"), "--load-format", "dummy").model.tokenizer == str(tmp_path / "bare")


def test_a_router_host_needs_the_checkpoints_config_and_tokenizer_not_its_weights(ckpt, tmp_path):
    """A router host (--role router) reads config.json, the tokenizer and the chat template, and loads no weights:
    the weights check refused one whose --model directory holds no weights ("no weights: none of ..."), which
    started before it came in; its P and D hosts are still refused without them."""
    shutil.copytree(ckpt, tmp_path / "bare", ignore=shutil.ignore_patterns("*.safetensors"))
    hosts = ("--registry", "etcd://127.0.0.1:2379", "--advertise", "127.0.0.1")
    cfg = config("--model", str(tmp_path / "bare"), "--role", "router", *hosts)
    assert cfg.model.checkpoint == str(tmp_path / "bare") and cfg.host_role == "router"
    with pytest.raises(ValueError, match="no weights"):
        config("--model", str(tmp_path / "bare"), "--role", "prefill", *hosts)


def test_a_hub_repo_is_fetched_with_the_files_its_load_reads(ckpt, tmp_path, monkeypatch):
    """Online, the snapshot holds only what allow_patterns names: a .bin-only repo's weights are asked for once no
    safetensors came (not both formats of a repo that has both, which can weigh as much again)."""
    import fnmatch

    import huggingface_hub

    from pushkv.model import hub

    _bin_copy(ckpt, tmp_path / "bin", 1)
    asked = []

    def snapshot_download(repo_id, revision, allow_patterns, cache_dir):  # the Hub: the repo's files that match
        asked.append(allow_patterns)
        src, dst = (ckpt if repo_id == "acme/st" else tmp_path / "bin"), tmp_path / "snap" / repo_id
        dst.mkdir(parents=True, exist_ok=True)
        for f in (p for p in os.listdir(src) if any(fnmatch.fnmatch(p, a) for a in allow_patterns)):
            shutil.copy(f"{src}/{f}", dst)
        return str(dst)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert config("--model", "acme/st").model.architecture == "Qwen2ForCausalLM" and asked == [hub.SERVE_FILES]
    asked.clear()
    assert config("--model", "acme/bin").model.checkpoint == str(tmp_path / "snap" / "acme/bin")
    assert asked == [hub.SERVE_FILES, hub.BIN_FILES]
    asked.clear()
    with pytest.raises(ValueError, match="no weights"):  # --load-format safetensors asks for those only
        config("--model", "acme/other-bin", "--load-format", "safetensors")
    assert asked == [hub.SERVE_FILES]
    # --load-format dummy fetched every safetensors file of the repo (a 235B model's 470 GB) for weights it never
    # reads; it asks for the shape and tokenizer only, as vLLM's dummy loader
    asked.clear()
    shutil.rmtree(tmp_path / "snap")
    assert config("--model", "acme/st", "--load-format", "dummy").model.tokenizer == str(tmp_path / "snap" / "acme/st")
    fetched = os.listdir(tmp_path / "snap" / "acme/st")
    assert asked == [hub.SHAPE_FILES] and "tokenizer.json" in fetched and not any(f.endswith(".safetensors")
                                                                                 for f in fetched)


@pytest.mark.parametrize("flags, gpus, dtype", [
    ((), 1, "bfloat16"),  # the default device: the GPU the driver shows
    (("--dtype", "auto"), 1, "bfloat16"),
    (("--load-format", "dummy"), 1, "bfloat16"),
    (("--device", "cpu", "--decode-device", "cuda:0"), 0, "bfloat16"),  # one side on a GPU: both (their KV meets)
    (("--dtype", "float32"), 1, "float32"),
    (("--dtype", "float"), 1, "float32"),
    ((), 0, "float32"),  # the CPU keeps it
    (("--device", "cpu"), 1, "float32"),
])
def test_dtype_auto_runs_a_float32_checkpoint_in_bfloat16_on_a_gpu_as_vllm(ckpt, flags, gpus, dtype):
    """vLLM's --dtype auto downcasts a float32 checkpoint to bfloat16 on a GPU; pushkv served it in float32 there,
    twice the weights' and the KV's memory and bandwidth of the same `vllm serve`."""
    assert user_config(parse("--model", ckpt, *flags), gpus=lambda: (gpus, "")).model.dtype == dtype


def test_dtype_auto_keeps_a_half_precision_checkpoints_dtype_on_a_gpu(ckpt, tmp_path):
    import json

    shutil.copytree(ckpt, tmp_path / "fp16")
    hf = json.loads((tmp_path / "fp16" / "config.json").read_text())
    (tmp_path / "fp16" / "config.json").write_text(json.dumps({**hf, "dtype": "float16"}))
    assert user_config(parse("--model", str(tmp_path / "fp16")), gpus=lambda: (1, "")).model.dtype == "float16"


@pytest.mark.parametrize("checkpoint, capability, dtype", [
    ("bfloat16", (7, 5), "float16"),  # Turing has no bfloat16: vLLM's first dtype there
    ("float32", (7, 0), "float16"),
    ("float16", (7, 5), "float16"),
    ("bfloat16", (8, 0), "bfloat16"),
    ("float32", (8, 6), "bfloat16"),
    ("bfloat16", (5, 2), "float32"),  # Maxwell: float32 alone
    ("bfloat16", None, "bfloat16"),  # not known: taken as Ampere's
])
def test_dtype_auto_takes_the_gpus_dtypes_as_vllm(ckpt, tmp_path, checkpoint, capability, dtype):
    """vLLM's --dtype auto (``_resolve_auto_dtype``) runs a bfloat16 checkpoint in float16 on a GPU before Ampere
    (compute capability < 8.0), which has no bfloat16; pushkv kept bfloat16 there."""
    import json

    shutil.copytree(ckpt, tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**hf, "dtype": checkpoint}))
    got = user_config(parse("--model", str(tmp_path / "m")), gpus=lambda: (1, ""), capability=lambda: capability)
    assert got.model.dtype == dtype
    assert user_config(parse("--model", str(tmp_path / "m"), "--dtype", "float32"), gpus=lambda: (1, ""),
                       capability=lambda: capability).model.dtype == "float32"  # given: kept
    assert user_config(parse("--model", str(tmp_path / "m")), gpus=lambda: (0, ""),
                       capability=lambda: capability).model.dtype == checkpoint  # the CPU keeps the checkpoint's


@pytest.mark.parametrize("rope, longest, why", [
    (None, 512, "max_position_embeddings 512"),
    ({"rope_type": "linear", "factor": 2.0}, 1024, "max_position_embeddings 512 x its linear RoPE factor 2"),
    ({"rope_type": "dynamic", "factor": 4.0}, 2048, "max_position_embeddings 512 x its dynamic RoPE factor 4"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024,
     "its YaRN RoPE's original_max_position_embeddings 256 x factor 4"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, 512,
     "max_position_embeddings 512"),
])
def test_a_max_model_len_past_the_model_names_how_its_length_was_derived(ckpt, rope, longest, why, monkeypatch):
    """A scaled RoPE's length was refused as 'the model's max_position_embeddings', a number config.json does not
    hold (1024 for a 512 one with linear factor 2): the refusal names the fields it came from (YaRN's past its
    derived length with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as vLLM 0.32 takes it)."""
    import json

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

    flags = ("--hf-overrides", json.dumps({"rope_scaling": rope})) if rope else ()
    assert config("--model", ckpt, *flags, "--max-model-len", str(longest)).max_model_len == longest
    with pytest.raises(ValueError) as e:
        config("--model", ckpt, *flags, "--max-model-len", str(longest + 1))
    assert str(e.value) == f"--max-model-len {longest + 1} must be in [1, {longest}]: the model's longest sequence " \
                           f"({why})"


def test_yarn_serves_the_derived_length_and_a_longer_one_needs_vllms_env_var(ckpt, monkeypatch):
    """vLLM 0.32 derives a YaRN checkpoint's max_model_len as its max_position_embeddings (not stretched by the
    factor) and refuses a longer --max-model-len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; pushkv served the stretched
    length by default and took any --max-model-len up to it."""
    import json

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    yarn = ("--hf-overrides", json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 256}}))
    cfg = config("--model", ckpt, *yarn)  # max_position_embeddings 512; YaRN's reach 256 x 4
    assert (cfg.model.max_position, cfg.model.derived_max_len, cfg.max_model_len) == (1024, 512, 512)
    assert config("--model", ckpt, *yarn, "--max-model-len", "512").max_model_len == 512
    with pytest.raises(ValueError) as e:
        config("--model", ckpt, *yarn, "--max-model-len", "1024")
    assert str(e.value) == ("--max-model-len 1024 is greater than the derived max_model_len "
                            "(max_position_embeddings=512 in the model's config.json, which vLLM does not stretch by "
                            "YaRN's factor); as vLLM's, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to serve up to "
                            "1024 (its YaRN RoPE's "
                            "original_max_position_embeddings 256 x factor 4)")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert config("--model", ckpt, *yarn, "--max-model-len", "1024").max_model_len == 1024
    assert config("--model", ckpt, *yarn).max_model_len == 512  # the default stays the derived length
    # where the two agree (max_position_embeddings already the YaRN length, as DeepSeek's): nothing changes
    same = ("--hf-overrides", json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                            "original_max_position_embeddings": 256}}))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    cfg = config("--model", ckpt, *same, "--max-model-len", "512")
    assert (cfg.model.max_position, cfg.model.derived_max_len, cfg.max_model_len) == (512, 0, 512)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_sharded_checkpoint_missing_a_shard_is_refused_before_anything_starts(ckpt, tmp_path, fmt):
    """An interrupted download leaves the index and some shards: pushkv started the deployment and every worker then
    stopped on 'No such file or directory' at the first tensor of a missing shard."""
    import json

    from safetensors.torch import load_file, save_file

    if fmt == "bin":
        _bin_copy(ckpt, tmp_path / "ckpt", 3)
        (tmp_path / "ckpt" / "pytorch_model-00002-of-00003.bin").unlink()
        index, gone = "pytorch_model.bin.index.json", "pytorch_model-00002-of-00003.bin"
    else:
        shutil.copytree(ckpt, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors"))
        tensors = load_file(f"{ckpt}/model.safetensors")
        weight_map = {n: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, n in enumerate(sorted(tensors))}
        save_file({n: t for n, t in tensors.items() if weight_map[n].startswith("model-00001")},
                  str(tmp_path / "ckpt" / "model-00001-of-00002.safetensors"))
        (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        index, gone = "model.safetensors.index.json", "model-00002-of-00002.safetensors"
    with pytest.raises(ValueError, match=rf"{index} names 1 file\(s\) that are not there \({gone}\): an interrupted"):
        config("--model", str(tmp_path / "ckpt"))


def test_a_checkpoint_without_tokenizer_json_is_refused_before_anything_starts(ckpt, tmp_path):
    """A SentencePiece-only repo (tokenizer.model), or weights saved without their tokenizer: the writers and workers
    started and loaded everything, then the router died with 'FileNotFoundError: ... has no tokenizer.json'."""
    shutil.copytree(ckpt, tmp_path / "ft", ignore=shutil.ignore_patterns("tokenizer.json"))
    (tmp_path / "ft" / "tokenizer.model").write_bytes(b"\x0a")
    ft = str(tmp_path / "ft")
    for flags in ((), ("--load-format", "dummy")):
        with pytest.raises(ValueError, match=rf"--model {ft}: no tokenizer.json \(it holds tokenizer.model, "
                                             r"tokenizer_config.json\): .* give --tokenizer a directory or repo id"):
            config("--model", ft, *flags)
    with pytest.raises(ValueError, match=f"--tokenizer {ft}: no tokenizer.json"):
        config("--model", ckpt, "--tokenizer", ft)
    assert config("--model", ft, "--tokenizer", ckpt).model.tokenizer == ckpt  # the base model's tokenizer
    assert config("--model", ft, "--skip-tokenizer-init").skip_tokenizer_init


@pytest.mark.parametrize("suffix", ["json", "toml"])
def test_a_config_files_max_model_len_is_checked_as_the_flags_is(ckpt, tmp_path, monkeypatch, suffix):
    """A ``--config`` file's max_model_len was taken unchecked: past the model's longest sequence, past YaRN's derived
    length without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, or negative, it reached the processes. Now it is refused as
    --max-model-len is, naming the file; the flag still wins over the file."""
    import json

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)

    def from_file(length: int, *flags: str) -> DeploymentConfig:
        f = tmp_path / f"d.{suffix}"
        f.write_text(json.dumps({"max_model_len": length}) if suffix == "json" else f"max_model_len = {length}\n")
        return config("--config", str(f), "--model", ckpt, *flags)

    where = f"max_model_len (--config {tmp_path / f'd.{suffix}'})"
    assert from_file(300).max_model_len == 300
    for bad in (100000, -1):
        with pytest.raises(ValueError) as e:
            from_file(bad)
        assert str(e.value) == f"{where} {bad} must be in [1, 512]: the model's longest sequence " \
                               "(max_position_embeddings 512)"
    assert from_file(100000, "--max-model-len", "400").max_model_len == 400  # the flag's, checked as before
    yarn = ("--hf-overrides", json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 256}}))
    assert from_file(512, *yarn).max_model_len == 512
    with pytest.raises(ValueError) as e:
        from_file(1024, *yarn)
    assert str(e.value).startswith(f"{where} 1024 is greater than the derived max_model_len "
                                   "(max_position_embeddings=512") and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in str(e.value)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert from_file(1024, *yarn).max_model_len == 1024
    with pytest.raises(ValueError, match=r"must be in \[1, 1024\]"):
        from_file(1025, *yarn)


def test_a_config_files_max_model_len_past_the_sliding_window_is_refused_with_disable_sliding_window(tmp_path):
    """--disable-sliding-window caps the context at the window; a --config file's longer max_model_len was kept."""
    f = tmp_path / "d.json"
    f.write_text('{"max_model_len": 100}')
    base = ("--model", "hybrid", "--load-format", "dummy", "--disable-sliding-window")
    with pytest.raises(ValueError, match=r"max_model_len \(--config .*d.json\) 100 with --disable-sliding-window: "
                                         "the context is capped at the sliding window, 48 tokens"):
        config("--config", str(f), *base)
    f.write_text('{"max_model_len": 40}')
    assert config("--config", str(f), *base).max_model_len == 40
    assert config(*base).max_model_len == 48
