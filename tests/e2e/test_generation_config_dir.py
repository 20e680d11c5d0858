"""vLLM's --generation-config DIR over a real deployment: DIR/generation_config.json's sampling defaults reach the
router, and its max_new_tokens bounds a request's own max_tokens, as vLLM's override_max_tokens does."""
import json

import pytest

from tests.support.deploy import deployment

pytestmark = pytest.mark.timeout(240)


def test_a_directorys_generation_config_bounds_every_request(tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    with deployment(tmp_path, "--mode", "local", "--model", "tiny", "--load-format", "dummy", "--num-blocks", "64",
                    "--generation-config", str(folder)) as dep:
        asked = dep.complete([5, 6, 7], 10, ignore_eos=True)["choices"][0]
        fewer = dep.complete([5, 6, 7], 2, ignore_eos=True)["choices"][0]
    assert len(asked["token_ids"]) == 3 and asked["finish_reason"] == "length"
    assert len(fewer["token_ids"]) == 2
