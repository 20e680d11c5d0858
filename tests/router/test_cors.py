"""Cross-origin requests answered as vLLM's server answers them (router/cors.py): by default every origin, method and
header, no credentials; a preflight answered before the API key's check; a response, streamed ones included, given
Access-Control-Allow-Origin where the request's Origin is allowed, and nothing without an Origin."""
import asyncio

import pytest

from pushkv.router import cors
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)

PAGE = "https://chat.example"


def answer(g):
    return [(None, tokens(g, [72, 105], True, "length", (stage("scheduled"), stage("finished"))))]


def test_vllms_defaults_allow_every_origin_without_credentials():
    p = cors.Policy()
    assert cors.response_headers(p, {"Origin": PAGE}) == {"Access-Control-Allow-Origin": "*"}
    assert cors.response_headers(p, {}) == {}
    status, headers, _ = cors.preflight(p, {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Access-Control-Max-Age"] == "600"


def test_a_named_policy_allows_only_what_it_names():
    p = cors.Policy(origins=(PAGE,), methods=("POST",), headers=("Authorization",), credentials=True)
    assert cors.response_headers(p, {"Origin": PAGE}) == {
        "Access-Control-Allow-Origin": PAGE, "Vary": "Origin", "Access-Control-Allow-Credentials": "true"}
    assert cors.response_headers(p, {"Origin": "https://evil.example"}) == {}
    ask = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    status, headers, _ = cors.preflight(p, ask)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert headers["Access-Control-Allow-Credentials"] == "true" and headers["Access-Control-Allow-Methods"] == "POST"
    for change, refused in (({"Origin": "https://evil.example"}, "origin"),
                            ({"Access-Control-Request-Method": "DELETE"}, "method"),
                            ({"Access-Control-Request-Headers": "X-Other"}, "headers")):
        status, headers, body = cors.preflight(p, {**ask, **change})
        assert status == 400 and refused in body and "Access-Control-Allow-Origin" not in headers
    # every origin with credentials: the request's own origin, never "*"
    p = cors.Policy(credentials=True)
    assert cors.response_headers(p, {"Origin": PAGE})["Access-Control-Allow-Origin"] == PAGE


def test_the_router_answers_a_browser_as_vllm_does(tmp_path):
    """A preflight answered though the router wants an API key (the browser sends none with it); the completion,
    streamed, carries Access-Control-Allow-Origin; a request without Origin gets no CORS header; a disallowed origin's
    preflight is a 400."""
    async def body():
        h = Harness(make_cfg(tmp_path, "local"), {"local": answer})
        h.router.api_key = "sekrit"
        async with h:
            pre = await h.http.options("/v1/completions", headers={
                "Origin": PAGE, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert pre.status == 200 and pre.headers["Access-Control-Allow-Origin"] == "*"
            assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            auth = {"Authorization": "Bearer sekrit"}
            r = await h.http.post("/v1/completions", headers={"Origin": PAGE, **auth},
                                  json={"prompt": "Hey", "max_tokens": 2, "model": "tiny", "stream": True})
            text = await r.text()
            assert r.status == 200 and "[DONE]" in text and r.headers["Access-Control-Allow-Origin"] == "*"
            r = await h.http.post("/v1/completions", headers=auth,
                                  json={"prompt": "Hey", "max_tokens": 2, "model": "tiny"})
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            refused = await h.http.post("/v1/completions", headers={"Origin": PAGE},
                                        json={"prompt": "Hey", "max_tokens": 2, "model": "tiny"})
            assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == "*"

        named = make_cfg(tmp_path, "local", cors_origins=(PAGE,))
        async with Harness(named, {"local": answer}) as h:
            pre = await h.http.options("/v1/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert pre.status == 400 and "origin" in await pre.text()
            r = await h.http.get("/health", headers={"Origin": "https://evil.example"})
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            r = await h.http.get("/health", headers={"Origin": PAGE})
            assert r.headers["Access-Control-Allow-Origin"] == PAGE and "Origin" in r.headers["Vary"]

    asyncio.run(asyncio.wait_for(body(), 25))


def test_up_takes_vllms_cors_flags():
    from processes.cli import build_parser
    from pushkv.config_flags import user_config

    ap = build_parser()
    args = ap.parse_args(["up", "--mode", "local", "--device", "cpu", "--allowed-origins", f'["{PAGE}"]',
                          "--allowed-methods", '["GET", "POST"]', "--allow-credentials"])
    cfg = user_config(vars(args))
    assert (cfg.cors_origins, cfg.cors_methods, cfg.cors_headers, cfg.cors_credentials) == (
        (PAGE,), ("GET", "POST"), ("*",), True)
    assert user_config(vars(ap.parse_args(["up", "--mode", "local", "--device", "cpu"]))).cors_origins == ("*",)
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            ap.parse_args(["up", "--allowed-origins", bad])


def test_vllms_yaml_config_gives_the_cors_lists(tmp_path):
    from processes.cli import build_parser
    from pushkv import vllm_serve
    from pushkv.config_flags import user_config

    path = tmp_path / "serve.yaml"
    path.write_text(f"allowed-origins: [\"{PAGE}\", \"https://b.example\"]\nallow-credentials: true\n")
    argv = vllm_serve.expand_config(["up", "--mode", "local", "--device", "cpu", "--config", str(path)])
    cfg = user_config(vars(build_parser().parse_args(argv)))
    assert cfg.cors_origins == (PAGE, "https://b.example") and cfg.cors_credentials
