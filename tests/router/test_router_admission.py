"""The router's global in-flight bound: past it a request gets 429 with Retry-After at once, before
anything is prefilled for it (pure decision; then the router itself over fake schedulers)."""
import asyncio
import threading

import pytest

from pushkv import messages as m
from pushkv.router.server import RETRY_AFTER_S, admission
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("in_flight,n,bound,refused", [
    (0, 1, 1, False), (0, 2, 1, True), (3, 1, 4, False), (4, 1, 4, True), (2, 3, 4, True), (0, 16, 16, False),
])
def test_admission(in_flight, n, bound, refused):
    why = admission(in_flight, n, bound)
    assert bool(why) == refused
    if refused:
        assert f"bound {bound}" in why and f"{in_flight} choice(s)" in why


def test_past_the_bound_is_429_with_retry_after_and_nothing_is_sent(tmp_path):
    gate = threading.Event()

    def held(g):  # answers only once the test opens the gate
        return [(gate, tokens(g, [72], True, "length", (stage("scheduled"), stage("finished"))))]

    async def body():
        cfg = make_cfg(tmp_path, "local", router_max_in_flight=2)
        async with Harness(cfg, {"local": held}) as h:
            req = {"prompt": "Hey", "max_tokens": 1, "model": "tiny"}
            first = [asyncio.ensure_future(h.http.post("/v1/completions", json=req)) for _ in range(2)]
            await h.wait(lambda e: len([x for r, d, x in e if d == "recv" and isinstance(x, m.Generate)]) == 2)
            over = await h.http.post("/v1/completions", json=req)
            assert over.status == 429 and over.headers["Retry-After"] == str(RETRY_AFTER_S)
            body = await over.json()
            assert body["error"]["type"] == "rate_limit_error" and "bound 2" in body["error"]["message"]
            two = await h.http.post("/v1/completions", json=dict(req, n=2, temperature=1.0))  # n counts
            assert two.status == 429
            assert len(h.log.received("local", m.Generate)) == 2  # the refused ones cost nothing
            gate.set()
            assert [(await f).status for f in first] == [200, 200]
            again = await h.http.post("/v1/completions", json=req)  # room again once they ended
            assert again.status == 200
    asyncio.run(asyncio.wait_for(body(), 25))
