"""vLLM's LoRA flags as ``pushkv up`` takes them: NAME=PATH and the JSON form, each adapter's files checked against
the model before anything starts, and what is not served refused by name."""
from __future__ import annotations

import json

import pytest

from pushkv.config import LoraModule
from pushkv.lora_flags import lora_modules
from pushkv.model import build_model
from pushkv.model.lora_files import read_adapter
from tests.config.test_vllm_serve import config
from tests.model.test_hf_reference import save_hf_checkpoint
from tests.support.lora_adapters import ADAPTERS, save_adapter


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_flags")
    base = save_hf_checkpoint(str(root / "base"), "llama", seed=1)
    return base, save_adapter(base, str(root / "qv"), **ADAPTERS["qv"])


def test_both_spellings_of_an_adapter():
    assert lora_modules(["a=/x/y", '{"name": "b", "path": "/z", "base_model_name": "m"}']) == [
        LoraModule("a", "/x/y"), LoraModule("b", "/z", "m")]
    # vLLM's LoRAModulePath has is_3d_lora_weight too, and its parser skips an empty item
    assert lora_modules(["", '{"name": "b", "path": "/z", "is_3d_lora_weight": false}']) == [LoraModule("b", "/z")]
    for bad in ("a", "=/x", "a=", '{"name": "b"}', '{"name": "b", "path": "/z", "rank": 4}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            lora_modules([bad])


def test_adapters_are_read_and_checked_at_launch(llama, tmp_path):
    base, qv = llama
    cfg = config("--model", base, "--served-model-name", "m", "--enable-lora", "--lora-modules", f"qv={qv}",
                 json.dumps({"name": "qv2", "path": qv, "base_model_name": "m"}), "--max-loras", "2")
    lora = cfg.model.lora
    assert lora.enabled and lora.max_loras == 2 and lora.max_rank == 16
    assert [(mod.name, mod.path) for mod in lora.modules] == [("qv", qv), ("qv2", qv)]
    assert lora.slot("qv2") == 2 and lora.slot("") == 0 and lora.slot("other") == -1
    # the same check a worker makes as it loads them
    assert read_adapter("qv", qv, cfg.model, lora.max_rank).rank == ADAPTERS["qv"]["r"]
    assert build_model(cfg.model).lora_bank.loaded == {1, 2}


@pytest.mark.parametrize("argv, says", [
    (["--lora-modules", "qv=QV"], "--lora-modules needs --enable-lora"),
    (["--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "m=QV"], "the name is given twice, or is the served model's"),
    (["--enable-lora", "--lora-modules", "a=QV", "a=QV"], "the name is given twice"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "QV", "base_model_name": "x"}'],
     "base_model_name 'x' is not served"),
    (["--enable-lora", "--lora-modules", "a=/no/such/dir"], "no such directory, and not a Hugging Face repo id"),
    (["--enable-lora", "--max-lora-rank", "1", "--lora-modules", "a=QV"], "r 4 is past --max-lora-rank 1"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras 0: at least 1"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
     r"--max-cpu-loras \(1\) must be >= --max-loras \(2\)"),
])
def test_refused_before_anything_starts(llama, argv, says):
    base, qv = llama
    with pytest.raises(ValueError, match=says):
        config("--model", base, "--served-model-name", "m", *[a.replace("QV", qv) for a in argv])


def test_max_lora_rank_takes_vllms_ranks_only(capsys):
    """vLLM's LoRAConfig.max_lora_rank is one of its MaxLoRARanks, which its argparse offers as choices: another rank
    is refused as vLLM's parser refuses it, naming the ranks."""
    from pushkv.config import LoraConfig
    from pushkv.lora_flags import lora_config

    assert config("--enable-lora", "--max-lora-rank", "320").model.lora.max_rank == 320
    for rank in ("2", "4", "100", "0"):
        with pytest.raises(SystemExit):
            config("--enable-lora", "--max-lora-rank", rank)
        assert (f"argument --max-lora-rank: invalid choice: {rank} (choose from 1, 8, 16, 32, 64, 128, 256, 320, "
                "512)") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--max-lora-rank: invalid choice: 24 \(choose from 1, 8, "):
        lora_config({"enable_lora": True, "max_lora_rank": 24}, None, [])  # a caller past the parser
    with pytest.raises(ValueError, match="LoraConfig.max_rank: 2 is not one of 1, 8, 16"):
        LoraConfig(True, (), 1, 2)  # type: ignore[arg-type]


def test_an_adapter_of_another_shape_is_refused(llama, tmp_path):
    base, qv = llama
    other = save_hf_checkpoint(str(tmp_path / "wide"), "llama", seed=1, hidden_size=96)
    with pytest.raises(ValueError, match=r"where this model and r 4 make \[4, 96\]"):
        config("--model", other, "--enable-lora", "--lora-modules", f"qv={qv}")


def test_the_models_list_gives_each_adapters_path_as_given(llama, monkeypatch):
    """/v1/models' root is the path as --lora-modules gave it (vLLM's LoRARequest.path), not where it was resolved
    to (a Hub id's snapshot in the cache, a relative path made absolute)."""
    import os

    from pushkv.router.loras import Loras

    base, qv = llama
    monkeypatch.chdir(os.path.dirname(qv))
    cfg = config("--model", base, "--served-model-name", "m", "--enable-lora", "--lora-modules", "qv=qv")
    (mod,) = cfg.model.lora.modules
    assert mod.path == qv and mod.given == "qv"  # the workers read the resolved directory
    card = Loras(cfg, lambda: None).cards(0, 128, "m")[0]
    assert (card["id"], card["root"], card["parent"]) == ("qv", "qv", "m")


def test_a_config_files_adapters_are_served_and_checked_as_the_flags_are(llama, tmp_path):
    """A --config file's model.lora was dropped without a word (every start replaced it with --enable-lora's, off
    without the flag), its adapters never read nor checked. Now they are served, checked as --lora-modules' are, and
    refused naming the file; the flags still win where given."""
    base, qv = llama
    f = tmp_path / "d.json"

    def from_file(**lora) -> object:
        f.write_text(json.dumps({"model": {"lora": {"enabled": True, "modules": [{"name": "qv", "path": qv}],
                                                    **lora}}}))
        return config("--config", str(f), "--model", base, "--served-model-name", "m")

    got = from_file(max_loras=2).model.lora
    assert (got.enabled, got.max_loras, got.max_rank, [(m.name, m.path) for m in got.modules]) == \
        (True, 2, 16, [("qv", qv)])
    with pytest.raises(ValueError, match=rf"model.lora \(--config {f}\): .*r 4 is past --max-lora-rank 1"):
        from_file(max_rank=1)
    with pytest.raises(ValueError, match=r"model.lora \(--config .*\): --max-loras 0: at least 1"):
        from_file(max_loras=0)
    with pytest.raises(ValueError):
        from_file(max_rank=1)  # the file says 1 ...
    assert config("--config", str(f), "--model", base, "--served-model-name", "m", "--max-lora-rank", "8",
                  ).model.lora.max_rank == 8  # ... and the flag's 8 wins
    with pytest.raises(ValueError, match=r"value 4 - at `\$.model.lora.max_rank`: not one of 1, 8, 16, 32, "):
        from_file(max_rank=4)  # a rank vLLM's --max-lora-rank does not take


def test_enable_lora_on_the_command_line_keeps_the_config_files_adapters(llama, tmp_path):
    """--enable-lora beside a --config file whose model.lora lists adapters dropped the file's adapters and its
    max_loras (the file's model.lora was read only without the flag): the flag says no adapter, so the file's stand."""
    base, qv = llama
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"model": {"lora": {"enabled": True, "modules": [{"name": "qv", "path": qv}],
                                                "max_loras": 3}}}))
    got = config("--config", str(f), "--model", base, "--served-model-name", "m", "--enable-lora").model.lora
    assert (got.enabled, got.max_loras, [(m.name, m.path) for m in got.modules]) == (True, 3, [("qv", qv)])
