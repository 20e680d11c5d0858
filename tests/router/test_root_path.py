"""vLLM's ``--root-path``: behind a proxy that serves the API under a prefix, the router answers each route under it
as well as bare; the API key guards a route under the prefix as it guards its bare twin (and a prefix that looks like
an API path opens nothing); and a prefix that is not a URL path is refused by name before anything starts."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pushkv.router.auth import authorized, unrooted
from tools.launch import launched

pytestmark = pytest.mark.timeout(240)


def _get(url: str, key: str = "") -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_routes_answer_under_the_root_and_bare_with_the_key_guarding_both(tmp_path):
    with launched("--mode", "local", "--num-blocks", "128", "--root-path", "/api", "--api-key", "k3y",
                  log_path=str(tmp_path / "up.log")) as d:
        for root in ("/api", ""):
            assert _get(d.url + root + "/v1/models")[0] == 401, root  # the key guards both
            status, body = _get(d.url + root + "/v1/models", "k3y")
            assert status == 200 and body["data"], (root, body)
            assert _get(d.url + root + "/health")[0] == 200, root  # open for probes, as bare
        assert _get(d.url + "/apix/v1/models", "k3y")[0] == 404  # the prefix is a whole path segment
        # a completion under the root, through the router to the engine
        req = urllib.request.Request(d.url + "/api/v1/completions", data=json.dumps(
            {"prompt": [1, 2, 3], "max_tokens": 4}).encode(), headers={"Authorization": "Bearer k3y",
                                                                      "content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 4
        # vLLM's runtime LoRA paths are not served without VLLM_ALLOW_RUNTIME_LORA_UPDATING (tests/e2e/test_lora.py)
        req = urllib.request.Request(d.url + "/v1/load_lora_adapter", data=b'{"lora_name": "a", "lora_path": "/a"}',
                                     headers={"Authorization": "Bearer k3y", "content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404
        d.wait_pools_free()


@pytest.mark.unit
def test_the_key_guards_a_path_if_it_or_its_unrooted_form_is_an_api_path():
    assert unrooted("/api/v1/models", "/api") == "/v1/models" and unrooted("/apix/v1", "/api") == "/apix/v1"
    assert unrooted("/api", "/api") == "/" and unrooted("/v1/models", "") == "/v1/models"
    # a root of /v1: /v1/completions is both a bare API path and /completions under the root; guarded either way
    for path in ("/v1/completions", "/v1/v1/completions"):
        ok = authorized(path, "", "k", False) and authorized(unrooted(path, "/v1"), "", "k", False)
        assert not ok, path


@pytest.mark.unit
def test_a_root_path_that_is_no_url_path_is_refused_by_name():
    from pushkv.config_flags import user_config

    for bad in ("api", "/api/", "/a?b", "/a b"):
        with pytest.raises(ValueError, match="--root-path"):
            user_config({"mode": "local", "device": "cpu", "root_path": bad})
    assert user_config({"mode": "local", "device": "cpu", "root_path": "/api/v2"}).root_path == "/api/v2"
