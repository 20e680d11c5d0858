"""``vllm serve``'s command line as ``pushkv up`` takes it (pushkv/vllm_serve.py): the model as the first argument,
vLLM's names for pushkv's settings giving the config pushkv's own spelling gives, a value pushkv does not run
refused by name, a feature it does not build refused with what to do instead, a knob it has no counterpart of
taken and said, vLLM's YAML config file, and the docs' table generated from the code."""
from __future__ import annotations

import os
import re

import msgspec
import pytest

from processes import cli
from pushkv import vllm_serve
from pushkv.config_flags import user_config
from pushkv.supervisor.plan import plan_deployment
from pushkv.vllm_serve import FLAGS, NO_EFFECT, ON_OFF, REFUSED, SAME, SWITCH, WHEN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_GPU = lambda: (0, "no GPU in this test")  # noqa: E731


def config(*argv: str):
    args = cli.build_parser().parse_args(["up", *argv])
    return user_config(vars(args), NO_GPU)


def argv_of(f, value=None) -> list[str]:
    """The command line that gives flag ``f`` (with ``value``, or a value of its type)."""
    if f.value == SWITCH:
        return [f.name]
    if f.value == ON_OFF:
        return [f.name]
    return [f.name, str(value if value is not None else (1 if f.value in (int, float) else "x"))]


def test_vllm_spellings_give_the_config_pushkvs_own_give():
    theirs = config("tiny", "--load-format", "dummy", "--max-num-batched-tokens", "2048",
                    "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                    "-pp", "1", "-dp", "1", "--kv-cache-dtype", "auto", "--distributed-executor-backend", "mp",
                    "--trust-remote-code", "--disable-log-stats")
    ours = config("--model", "tiny", "--load-format", "dummy", "--max-batch-tokens", "2048", "--num-blocks", "100",
                  "--no-prefix-cache", "--prefill-chunk", "2048")
    assert theirs == ours
    assert (ours.prefill.max_batch_tokens, ours.decode.num_blocks, ours.prefill.prefix_cache,
            ours.prefill.prefill_chunk) == (2048, 100, False, 2048)


def test_chunked_prefill_takes_the_step_size_and_can_be_turned_off():
    default_tokens = config("tiny", "--load-format", "dummy").prefill.max_batch_tokens
    assert config("tiny", "--load-format", "dummy", "--enable-chunked-prefill").prefill.prefill_chunk == default_tokens
    assert config("tiny", "--load-format", "dummy", "--max-batch-tokens", "512",
                  "--enable-chunked-prefill").prefill.prefill_chunk == 512
    assert config("tiny", "--load-format", "dummy", "--no-enable-chunked-prefill").prefill.prefill_chunk == 0
    assert config("tiny", "--load-format", "dummy", "--prefill-chunk", "256",
                  "--enable-chunked-prefill").prefill.prefill_chunk == 256  # pushkv's own chunk stands
    with pytest.raises(ValueError, match="--no-enable-chunked-prefill disagrees with --prefill-chunk 256"):
        config("tiny", "--load-format", "dummy", "--prefill-chunk", "256", "--no-enable-chunked-prefill")
    assert config("tiny", "--load-format", "dummy", "--enable-prefix-caching").prefill.prefix_cache is True


def test_enforce_eager_reaches_what_every_worker_reads():
    """The planned config is what each worker process reads (its config file); the batched engine replays no
    graph when the model says so (on a GPU: tests/model/test_gpu_graphs.py)."""
    assert config("tiny", "--load-format", "dummy").model.cuda_graphs is True
    planned = plan_deployment(config("tiny", "--load-format", "dummy", "--enforce-eager"))
    assert planned.model.cuda_graphs is False
    assert msgspec.json.decode(msgspec.json.encode(planned), type=type(planned)).model.cuda_graphs is False


def test_fewer_batched_tokens_than_sequences_is_refused_as_vllms(tmp_path):
    """vLLM's SchedulerConfig: max_num_batched_tokens below max_num_seqs is refused at start, chunked prefill or not
    (a step holds a token of each sequence it runs); where --max-num-seqs is not given, EngineArgs lowers its default
    to the tokens instead, and so does pushkv."""
    for chunked in ((), ("--enable-chunked-prefill",)):
        with pytest.raises(ValueError, match=re.escape(
                "prefill instance: max_batch_tokens (--max-batch-tokens, vLLM's --max-num-batched-tokens) (16) must be "
                "greater than or equal to max_num_seqs (--max-num-seqs) (32)")):
            plan_deployment(config("tiny", "--load-format", "dummy", "--max-num-batched-tokens", "16",
                                   "--max-num-seqs", "32", *chunked), run_root=str(tmp_path))
    lowered = config("tiny", "--load-format", "dummy", "--max-num-batched-tokens", "16")
    assert (lowered.prefill.max_num_seqs, lowered.decode.max_num_seqs, lowered.local.max_num_seqs) == (16, 16, 16)
    assert plan_deployment(lowered, run_root=str(tmp_path)).decode.max_num_seqs == 16
    equal = config("tiny", "--load-format", "dummy", "--max-batch-tokens", "8", "--max-num-seqs", "8")
    assert plan_deployment(equal, run_root=str(tmp_path)).prefill.max_num_seqs == 8
    assert config("tiny", "--load-format", "dummy").prefill.max_num_seqs == 32  # the default where the tokens allow
    # a --config file's own max_num_seqs is given: refused, not lowered
    f = tmp_path / "d.json"
    f.write_text('{"decode": {"max_num_seqs": 64}}')
    with pytest.raises(ValueError, match=r"decode instance: max_batch_tokens .* \(48\) must be greater than or "
                                         r"equal to max_num_seqs \(--max-num-seqs\) \(64\)"):
        plan_deployment(config("tiny", "--load-format", "dummy", "--config", str(f), "--max-batch-tokens", "48"),
                        run_root=str(tmp_path))


def test_the_model_as_the_first_argument_is_the_model():
    assert config("tiny", "--load-format", "dummy").model == config("--model", "tiny", "--load-format", "dummy").model
    with pytest.raises(ValueError, match="given twice: 'tiny' and --model 'small'"):
        config("tiny", "--model", "small", "--load-format", "dummy")


@pytest.mark.parametrize("f", [f for f in FLAGS if f.kind == REFUSED], ids=lambda f: f.name)
def test_each_feature_not_built_is_refused_by_name_saying_what_instead(f):
    with pytest.raises(ValueError) as e:
        config("tiny", "--load-format", "dummy", *argv_of(f))
    assert str(e.value).startswith(f.name) and f.says in str(e.value)


# (flag, a value pushkv runs, a value it does not)
WHEN_VALUES = {"--pipeline-parallel-size": (1, 2), "--data-parallel-size": (1, 4), "--api-server-count": (1, 2),
               "--kv-cache-dtype": ("auto", "fp8_e4m3"), "--quantization": ("none", "awq"),
               "--lora-dtype": ("auto", "float16"),
               "--distributed-executor-backend": ("mp", "ray"), "--tokenizer-mode": ("auto", "mistral"),
               "--scheduling-policy": ("fcfs", "priority"), "--max-logprobs": (20, 50),
               "--cpu-offload-gb": (0, 8.5), "--guided-decoding-backend": ("xgrammar", "outlines"),
               "--structured-outputs-config": ('{"backend": "xgrammar"}', '{"backend": "guidance"}'),
               "--response-role": ("assistant", "bot")}


@pytest.mark.parametrize("f", [f for f in FLAGS if f.kind == WHEN and f.value != SWITCH], ids=lambda f: f.name)
def test_a_value_pushkv_runs_is_taken_and_another_refused_naming_it(f):
    good, bad = WHEN_VALUES[f.name]
    config("tiny", "--load-format", "dummy", *argv_of(f, good))
    with pytest.raises(ValueError) as e:
        config("tiny", "--load-format", "dummy", *argv_of(f, bad))
    assert str(e.value).startswith(f"{f.name} {bad} is not supported")


@pytest.mark.parametrize("value,taken", [
    ('{}', True), ('{"backend": "auto"}', True), ('{"backend": "xgrammar"}', True), ('{"backend": "outlines"}', False),
    ('{"disable_any_whitespace": true}', False), ('not json', False), ('["xgrammar"]', False)])
def test_structured_outputs_config_is_taken_where_it_asks_for_xgrammar_alone(value, taken):
    argv = ("tiny", "--load-format", "dummy", "--structured-outputs-config", value)
    if taken:
        config(*argv)
    else:
        with pytest.raises(ValueError, match="--structured-outputs-config"):
            config(*argv)


def test_every_flag_taken_when_is_in_the_values_table():
    assert {f.name for f in FLAGS if f.kind == WHEN and f.value != SWITCH} == set(WHEN_VALUES)


def test_each_knob_without_a_counterpart_is_taken_and_said():
    for f in FLAGS:
        if f.kind != NO_EFFECT:
            continue
        argv = ["tiny", "--load-format", "dummy", *argv_of(f)]
        args = vars(cli.build_parser().parse_args(["up", *argv]))
        assert config(*argv) == config("tiny", "--load-format", "dummy"), f.name
        assert vllm_serve.apply(args, 8192)[1] == [f"{vllm_serve._spelt(f, args[f.dest])} has no effect: {f.says}"]


def test_a_vllm_spelling_that_disagrees_with_pushkvs_is_refused():
    with pytest.raises(ValueError, match="--max-num-batched-tokens 100 disagrees with --max-batch-tokens 200"):
        config("tiny", "--load-format", "dummy", "--max-num-batched-tokens", "100", "--max-batch-tokens", "200")
    with pytest.raises(ValueError, match="--enable-prefix-caching disagrees with --no-prefix-cache"):
        config("tiny", "--load-format", "dummy", "--enable-prefix-caching", "--no-prefix-cache")
    # agreeing is fine
    assert config("tiny", "--load-format", "dummy", "--max-num-batched-tokens", "100",
                  "--max-batch-tokens", "100").prefill.max_batch_tokens == 100


def test_quantization_fp8_is_taken_only_on_an_fp8_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from tests.model.test_fp8_checkpoint import quantize_checkpoint
    from tests.model.test_hf_reference import save_hf_checkpoint

    plain = save_hf_checkpoint(str(tmp_path / "plain"), "llama")
    assert config(plain, "--load-format", "safetensors").model == config(plain).model  # what auto reads
    with pytest.raises(ValueError, match="is not a block-scaled fp8 checkpoint"):
        config(plain, "--quantization", "fp8")
    fp8 = save_hf_checkpoint(str(tmp_path / "fp8"), "llama")
    assert quantize_checkpoint(fp8, (16, 32))
    assert config(fp8, "-q", "fp8").model.checkpoint == fp8
    assert config(fp8).model == config(fp8, "-q", "fp8").model


def test_a_vllm_config_yaml_gives_its_flags_and_the_command_line_wins(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny\nload-format: dummy\nmax_num_batched_tokens: 1024\nenable-prefix-caching: false\n"
                    "tensor-parallel-size: 1\nserved-model-name: [a, b]\ntrust-remote-code: true\n")
    argv = vllm_serve.expand_config(["up", "--config", str(path), "--max-num-batched-tokens", "2048"])
    assert argv[0] == "up" and argv[-2:] == ["--max-num-batched-tokens", "2048"]
    cfg = user_config(vars(cli.build_parser().parse_args(argv)), NO_GPU)
    assert (cfg.model.name, cfg.prefill.max_batch_tokens, cfg.prefill.prefix_cache, cfg.served_model_name) == \
        ("tiny", 2048, False, ("a", "b"))
    # pushkv's own --config (JSON or TOML) is left as it is
    assert vllm_serve.expand_config(["up", "--config=c.toml"]) == ["up", "--config=c.toml"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert cli.main(["up", "--config", str(bad)]) == 2
    assert "not YAML" in capsys.readouterr().err


def test_an_unknown_flag_points_at_the_vllm_group(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["up", "tiny", "--load-format", "dummy", "--no-such-vllm-flag", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-vllm-flag 3" in err and "'vllm serve' group" in err


def test_every_same_flag_names_a_setting_that_exists():
    up = {a.dest for a in next(a for a in cli.build_parser()._actions if hasattr(a, "choices") and a.choices)
          .choices["up"]._actions}
    for f in FLAGS:
        if f.kind == SAME:
            assert f.sets in up | {"enforce_eager", "download_dir", "override_generation_config", "hf_overrides",
                                   "rope_scaling", "rope_theta"}, f.name


TABLE = re.compile(r"<!-- vllm serve table: python -m pushkv.vllm_serve -->\n(.*?)<!-- end of vllm serve table -->\n",
                   re.S)


def test_the_docs_table_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "running.md")) as f:
        m = TABLE.search(f.read())
    assert m, "docs/running.md lost its vllm serve table markers"
    assert m.group(1) == vllm_serve.markdown_table(), "regenerate docs/running.md's table: python -m pushkv.vllm_serve"


def test_chunked_prefill_takes_a_config_files_step_size(tmp_path):
    """--enable-chunked-prefill without a size: the chunk is a step's tokens on the instance that prefills, as the
    --config file sets them (the prefill instance in P/D, the local one in local mode), not the default's."""
    path = tmp_path / "deploy.json"
    path.write_text('{"model": "tiny", "prefill": {"max_batch_tokens": 768}, "local": {"max_batch_tokens": 384}}')
    pd = config("--config", str(path), "--enable-chunked-prefill")
    assert (pd.prefill.max_batch_tokens, pd.prefill.prefill_chunk) == (768, 768)
    local = config("--config", str(path), "--mode", "local", "--enable-chunked-prefill")
    assert (local.local.max_batch_tokens, local.local.prefill_chunk) == (384, 384)


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    """A small Qwen2 checkpoint in transformers 4's form (top-level rope_theta), as Qwen2.5's repos carry it."""
    import json

    from tests.model.test_hf_reference import GEOMETRY, _tokenizer

    path = tmp_path_factory.mktemp("qwen25")
    _tokenizer(str(path))
    hf = {**GEOMETRY, "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, "max_position_embeddings": 32768,
          "hidden_act": "silu", "use_sliding_window": False, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


YARN = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'


def test_hf_overrides_and_the_rope_flags_read_over_the_checkpoints_config(qwen25, monkeypatch):
    """Qwen2.5's long context as its model card has vLLM serve it: YaRN laid over config.json, and 128k tokens (with
    vLLM 0.32's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as it needs)."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    m = config("--model", qwen25, "--load-format", "dummy", "--hf-overrides", YARN, "--max-model-len", "131072").model
    assert (m.rope_scaling.rope_type, m.rope_scaling.factor, m.max_position) == ("yarn", 4.0, 131072)
    assert m.hf_overrides and m.rope_theta == 1e6
    same = config("--model", qwen25, "--load-format", "dummy", "--rope-scaling",
                  '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}').model
    assert same.rope_scaling == m.rope_scaling
    assert config("--model", qwen25, "--load-format", "dummy", "--rope-theta", "5e5").model.rope_theta == 5e5
    plain = config("--model", qwen25, "--load-format", "dummy").model
    assert plain.max_position == 32768 and plain.hf_overrides == ""
    for argv, needle in [
        (("--max-model-len", "131072"), "must be in [1, 32768]"),
        (("--hf-overrides", '{"quantization_config": {}}'), "quantization_config cannot be overridden"),
        (("--hf-overrides", "[1]"), "a JSON object"),
        (("--hf-overrides", '{"rope_theta": 1e4}', "--rope-theta", "5e5"), "disagrees"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            config("--model", qwen25, "--load-format", "dummy", *argv)
    with pytest.raises(ValueError, match="give --model a checkpoint"):
        config("--model", "tiny", "--load-format", "dummy", "--rope-theta", "5e5")


def test_vllm_server_flags_pushkv_runs_reach_the_config(tmp_path):
    """--enable-force-include-usage, --return-tokens-as-token-ids and --log-config-file, spelt as vLLM's; the log
    config's text travels in the config (every process of every host applies it), a file that is not a dictConfig
    object refused before anything starts."""
    log = tmp_path / "log.json"
    log.write_text('{"version": 1, "root": {"level": "WARNING"}}')
    cfg = config("tiny", "--load-format", "dummy", "--enable-force-include-usage", "--return-tokens-as-token-ids",
                 "--log-config-file", str(log))
    assert (cfg.force_include_usage, cfg.return_tokens_as_token_ids) == (True, True)
    assert cfg.log_config == '{"version": 1, "root": {"level": "WARNING"}}'
    plain = config("tiny", "--load-format", "dummy")
    assert (plain.force_include_usage, plain.return_tokens_as_token_ids, plain.log_config) == (False, False, "")
    for text, needle in [(None, "No such file"), ("[1]", "a JSON object"), ("{x", "not JSON"),
                         ('{"root": {}}', '"version": 1')]:
        bad = tmp_path / ("missing.json" if text is None else "bad.json")
        if text is not None:
            bad.write_text(text)
        with pytest.raises(ValueError, match=f"--log-config-file {bad}: .*{re.escape(needle)}"):
            config("tiny", "--load-format", "dummy", "--log-config-file", str(bad))


def test_vllm_logging_config_path_is_the_log_config_files_default(tmp_path, monkeypatch):
    """vLLM reads VLLM_LOGGING_CONFIG_PATH where --log-config-file is not given; the flag wins over it."""
    env, flag = tmp_path / "env.json", tmp_path / "flag.json"
    env.write_text('{"version": 1, "root": {"level": "ERROR"}}')
    flag.write_text('{"version": 1, "root": {"level": "DEBUG"}}')
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(env))
    assert config("tiny", "--load-format", "dummy").log_config == env.read_text()
    assert config("tiny", "--load-format", "dummy", "--log-config-file", str(flag)).log_config == flag.read_text()
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="VLLM_LOGGING_CONFIG_PATH .*missing.json: No such file"):
        config("tiny", "--load-format", "dummy")


def test_a_vllm_config_yamls_values_are_checked_as_the_command_lines(tmp_path):
    """vLLM's --config YAML becomes flags, so what the command line refuses it refuses alike: a max-model-len past the
    model's, a zero max-num-seqs (at planning, as for the flag)."""
    from pushkv.supervisor.plan import plan_deployment

    path = tmp_path / "serve.yaml"

    def from_yaml(text: str):
        path.write_text("model: tiny\nload-format: dummy\n" + text)
        argv = vllm_serve.expand_config(["up", "--config", str(path)])
        ports = iter(range(20000, 21000))
        return plan_deployment(user_config(vars(cli.build_parser().parse_args(argv)), NO_GPU),
                               pick_port=lambda: next(ports), run_root=str(tmp_path))

    assert from_yaml("max-model-len: 4096\n").max_model_len == 4096
    with pytest.raises(ValueError, match=r"^--max-model-len 100000 must be in \[1, 8192\]"):
        from_yaml("max-model-len: 100000\n")
    with pytest.raises(ValueError, match=r"max_num_seqs \(--max-num-seqs\) must be >= 1, got 0"):
        from_yaml("max-num-seqs: 0\n")
