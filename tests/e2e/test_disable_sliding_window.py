"""vLLM's ``--disable-sliding-window``: every layer attends to the whole context, which is capped at the model's
sliding window. Within the window both attentions are the same, so the tokens equal the windowed model's; past it a
prompt is refused; and a --max-model-len past the window is refused before anything starts."""
import pytest

from pushkv.config_flags import user_config
from tests.support.deploy import deployment

pytestmark = pytest.mark.timeout(240)


@pytest.mark.unit
def test_the_window_goes_and_the_context_is_capped_at_it():
    windowed = user_config({"mode": "local", "device": "cpu", "model": "hybrid"})
    assert windowed.model.sliding_window == 48 and windowed.model.window_layers == (0, 2)
    full = user_config({"mode": "local", "device": "cpu", "model": "hybrid", "disable_sliding_window": True})
    assert full.model.sliding_window == 0 and full.model.window_layers == () and full.max_model_len == 48
    less = user_config({"mode": "local", "device": "cpu", "model": "hybrid", "disable_sliding_window": True,
                        "max_model_len": 32})
    assert less.max_model_len == 32
    with pytest.raises(ValueError, match="--disable-sliding-window.*48"):
        user_config({"mode": "local", "device": "cpu", "model": "hybrid", "disable_sliding_window": True,
                     "max_model_len": 64})
    # a model without a window: nothing changes
    plain = user_config({"mode": "local", "device": "cpu", "model": "small", "disable_sliding_window": True})
    assert plain.max_model_len == 0 and plain.model.sliding_window == 0


def test_within_the_window_the_tokens_are_the_windowed_models(tmp_path):
    prompt = [(i * 13 + 7) % 256 for i in range(30)]
    for sub in ("windowed", "full"):
        (tmp_path / sub).mkdir()
    with deployment(tmp_path / "windowed", "--mode", "local", "--model", "hybrid", "--num-blocks", "64") as dep:
        want = dep.tokens(prompt, 12)  # 42 tokens in all: within the 48-token window
    with deployment(tmp_path / "full", "--mode", "push", "--model", "hybrid", "--num-blocks", "64",
                    "--disable-sliding-window") as dep:
        assert dep.tokens(prompt, 12) == want
        status, body = dep.post("/v1/completions", {"prompt": list(range(1, 61)), "max_tokens": 2})
        assert status == 400 and "48" in body["error"]["message"], body
