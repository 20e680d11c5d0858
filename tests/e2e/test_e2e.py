"""The whole deployment over loopback and real NIXL: supervisor, router, and
P and D each with scheduler, worker and writer. Greedy tokens through P/D must
equal local mode's, token for token."""
import json
import os
import random
import re
import time

import pytest

from tests.support.deploy import concurrent, deployment, wait_pools_free
from tests.support.other_uid import nobody_runs_python, probe

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
MAX_TOKENS = 12
rng = random.Random(7)
PROMPTS = {
    "one-token": [65],
    "one-block": [rng.randrange(256) for _ in range(BLOCK)],
    "non-multiple": [rng.randrange(256) for _ in range(37)],
    "many-blocks": [rng.randrange(256) for _ in range(300)],
    "text": "The quick brown fox jumps over the lazy dog.",
}
COMMON = ("--model", "small", "--num-blocks", "512", "--tool-call-parser", "hermes")  # (a forced tool_choice needs it)


LETTERS = list(range(ord("a"), ord("z") + 1))  # allowed_token_ids: the byte tokenizer's lower-case letters


def _constrained(dep, **kw) -> list[int]:
    return dep.complete(PROMPTS["text"], MAX_TOKENS, allowed_token_ids=LETTERS, **kw)["choices"][0]["token_ids"]


def constrained_requests(letters: list[int]) -> dict[str, dict]:
    """vLLM's allowed_token_ids and bad_words, given the letters a greedy request restricted to a-z drew: its first
    letter banned as a word (P draws the first token, so P must honour it) and its third and fourth as a two-letter
    word (D bans the fourth only after the third: the output so far decides)."""
    g = "".join(chr(t) for t in letters)
    return {"sampled": {"temperature": 0.9, "seed": 11}, "one-letter-word": {"bad_words": [g[0]]},
            "two-letter-word": {"bad_words": [g[2:4]]}}


# a prompt whose greedy output repeats its tokens, which a repetition penalty then avoids (P weighs the prompt's ids,
# D the prompt's and the output's so far)
REPEATED = PROMPTS["one-token"]


def _repeated(dep) -> list[int]:
    return dep.complete(REPEATED, MAX_TOKENS, repetition_penalty=20.0)["choices"][0]["token_ids"]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
STRUCTURED = {  # name: (the request's field, what its text must be)
    "choice": ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    "regex": ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    # compact JSON: a random model would write whitespace forever otherwise
    "json": ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
             lambda t: set(json.loads(t)) == {"ok", "n"}),
}


def _structured(dep, name: str) -> dict:
    body, _ = STRUCTURED[name]
    choice = dep.complete(PROMPTS["text"], 40, **body)["choices"][0]
    return {"text": choice["text"], "tokens": choice["token_ids"], "finish": choice["finish_reason"]}


def structural_requests(free: list[int]) -> tuple[int, dict[str, dict]]:
    """vLLM's structural tags (free text until a trigger, then the tag's begin, schema and end), given the greedy
    output without one: the trigger is a character that output first draws at index k >= 1, so the output is free
    to k and then held (on D) to "=", an integer and ";". In the older form (structures and triggers, as
    response_format) and in xgrammar's (a format, as structured_outputs' JSON text)."""
    k = next(i for i in range(1, len(free)) if 32 < free[i] < 127 and free[i] not in free[:i]
             and chr(free[i]) not in "\\\"=;0123456789-")
    trig = chr(free[k])
    older = {"response_format": {"type": "structural_tag", "structures": [
        {"begin": trig + "=", "schema": {"type": "integer"}, "end": ";"}], "triggers": [trig]}}
    xgr = {"structured_outputs": {"structural_tag": json.dumps({"format": {"type": "triggered_tags", "triggers": [trig],
           "tags": [{"type": "tag", "begin": trig + "=", "content": {"type": "json_schema",
                                                                     "json_schema": {"type": "integer"}},
                     "end": ";"}]}})}}
    return k, {"older": older, "format": xgr}


def _structural(dep, body: dict) -> dict:
    choice = dep.complete(PROMPTS["text"], MAX_TOKENS, **body)["choices"][0]
    return {"text": choice["text"], "tokens": choice["token_ids"], "finish": choice["finish_reason"]}


def holds_tags(text: str, trig: str) -> bool:
    """Every trigger in text is followed by "=", an integer and ";" (or the text ends inside one)."""
    i = 0
    while (j := text.find(trig, i)) >= 0:
        m = re.match(r"=(-?[0-9]*)(;|$)", text[j + 1:])
        if not m:
            return False
        if not m.group(2):
            return True
        i = j + 1 + m.end()
    return True


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
CHOICES = {"named": {"type": "function", "function": {"name": "get_time"}}, "required": "required"}


def _forced(dep, name: str) -> dict:
    status, body = dep.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What time is it in Paris?"}], "max_tokens": 60, "tools": TOOLS,
        "tool_choice": CHOICES[name]})
    assert status == 200, body
    choice = body["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"].get("tool_calls") or []]
    return {"calls": calls, "finish": choice["finish_reason"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("local"), "--mode", "local", *COMMON) as dep:
        ref = {name: dep.tokens(p, MAX_TOKENS) for name, p in PROMPTS.items()}
        ref["letters"] = _constrained(dep)
        ref.update({name: _constrained(dep, **kw) for name, kw in constrained_requests(ref["letters"]).items()})
        ref["repetition"] = _repeated(dep)
        ref["structured"] = {name: _structured(dep, name) for name in STRUCTURED}
        ref["forced"] = {name: _forced(dep, name) for name in CHOICES}
        ref["structural"] = {name: _structural(dep, body)
                             for name, body in structural_requests(ref["text"])[1].items()}
        wait_pools_free(dep)
    return ref


def test_allowed_token_ids_bad_words_and_repetition_penalty_hold_and_equal_local(push, reference):
    g = reference["letters"]
    assert len(g) == MAX_TOKENS and set(g) <= set(LETTERS)
    one, two = reference["one-letter-word"], reference["two-letter-word"]
    assert set(one) <= set(LETTERS) and g[0] not in one  # a one-token word never comes
    first = next(i for i in range(1, 4) if (g[i - 1], g[i]) == (g[2], g[3]))  # where g first has the word
    assert two[:first] == g[:first] and two[first] != g[first]  # its first letter came; its second did not follow
    assert all((a, b) != (g[2], g[3]) for a, b in zip(two, two[1:]))
    assert set(reference["sampled"]) <= set(LETTERS)
    plain, penalised = reference["one-token"], reference["repetition"]
    assert len(set(plain)) < len(plain) and len(set(penalised)) > len(set(plain))
    assert _repeated(push) == penalised
    assert _constrained(push) == g
    for name, kw in constrained_requests(g).items():
        assert _constrained(push, **kw) == reference[name], name
    wait_pools_free(push)


MODES = {
    "push": ("--mode", "push"),
    "pull-inline": ("--mode", "pull", "--pull-read", "inline"),
    "pull-background": ("--mode", "pull", "--pull-read", "background"),
    "pull-write": ("--mode", "pull", "--pull-read", "write"),
}


@pytest.fixture(scope="module", params=list(MODES))
def push(request, tmp_path_factory):
    """A P/D deployment in each transfer mode (named push for the main one)."""
    with deployment(tmp_path_factory.mktemp(request.param), *MODES[request.param], *COMMON) as dep:
        yield dep


@pytest.mark.parametrize("name", list(PROMPTS))
def test_push_equals_local(push, reference, name):
    assert push.tokens(PROMPTS[name], MAX_TOKENS) == reference[name]
    wait_pools_free(push)


def test_push_concurrent_requests_equal_local(push, reference):
    names = list(PROMPTS) * 2
    got = concurrent(push, [PROMPTS[n] for n in names], MAX_TOKENS)
    for n, toks in zip(names, got):
        assert toks == reference[n], n
    wait_pools_free(push)


def test_lone_request_is_not_stalled(push):
    """No progress of a transfer waits for another request or engine step."""
    t0 = time.monotonic()
    # long enough (~100 ms of prefill here) that D's registration, sent when the D leg arrives,
    # lands before prefill ends even on two busy cores
    body = push.complete(PROMPTS["many-blocks"] * 3, 1)
    elapsed = time.monotonic() - t0
    tl = body["pushkv"]["timeline"]
    gap = tl["decode.kv_received"] - tl["prefill.prefill_end"]  # includes the relay in pull
    assert gap < 2.0, f"prefill end -> KV received took {gap:.3f}s on an idle deployment"
    assert elapsed < 20.0
    st = wait_pools_free(push)
    assert st["prefill"].counters.get("requests", 0) >= 1
    if push.cfg.mode == "push":
        assert tl["decode.registration_sent"] < tl["prefill.prefill_end"], "D must register while P computes"


def test_streaming_matches_non_streaming(push, reference):
    import json
    import urllib.request

    req = urllib.request.Request(push.url + "/v1/completions", data=json.dumps(
        {"prompt": PROMPTS["non-multiple"], "max_tokens": MAX_TOKENS, "stream": True}).encode(),
        headers={"content-type": "application/json"})
    toks = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                toks += ev["choices"][0].get("token_ids") or []
    assert toks == reference["non-multiple"]


def test_idle_processes_do_not_spin(push):
    """Event-driven loops: an idle deployment's processes (the writers included,
    which poll NIXL notifications with no fd to wait on) use almost no CPU."""

    from pushkv.supervisor.commands import ask

    ticks = os.sysconf("SC_CLK_TCK")

    def cpu(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    procs = {p.name: p.pid for p in ask(push.cfg.control_endpoint, "status").processes}
    wait_pools_free(push)
    before = {n: cpu(p) for n, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(3.0)  # the measurement window itself: nothing is synchronised on it
    wall = time.monotonic() - t0
    used = {n: cpu(p) - before[n] for n, p in procs.items()}
    assert all(u / wall < 0.10 for u in used.values()), used


def test_process_titles_name_the_deployment(push):
    """`ps` tells two deployments' processes apart, as docs/tracing.md's `pgrep -f 'pushkv prefill-writer 0 ID'`
    finds one: every child's title is `pushkv <what> <deployment id>`, as the supervisor's."""
    from pushkv.supervisor.commands import ask

    dep = push.cfg.deployment_id
    titles = {}
    for p in ask(push.cfg.control_endpoint, "status").processes:
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            titles[p.name] = f.read().replace(b"\0", b" ").decode().strip()
    assert titles["prefill-writer-0"] == f"pushkv prefill-writer 0 {dep}"
    assert titles["decode-scheduler"] == f"pushkv decode-scheduler 0 {dep}"
    assert titles["router"] == f"pushkv router {dep}"
    assert all(t.startswith("pushkv ") and t.endswith(f" {dep}") for t in titles.values()), titles


@pytest.mark.skipif(not nobody_runs_python(), reason="needs root, setpriv, and this python usable by uid 65534")
def test_another_uid_gets_no_handshake(push):
    """A default deployment on one host: another local uid cannot reach a writer's handshake, so it
    never gets a Hello (NIXL metadata, pool base: what a READ or WRITE of the pool needs). The same
    Hello from our own uid is answered, so the probe's Hello is one the writer would take."""
    from pushkv import messages as m
    from pushkv.config import model_fingerprint
    from pushkv.kv import layout as L
    from pushkv.transport.nixl_agent import NixlAgent

    cfg = push.cfg
    agent = NixlAgent("uid-probe")

    def hello(other) -> str:  # what a writer of the other role would say
        return m.encode(m.Hello("uid-probe", 0, 1, "uid-probe", agent.metadata(), 0,
                                L.instance_layout(cfg, other, 0), wire_version=m.WIRE_VERSION,
                                model_id=model_fingerprint(cfg.model))).hex()

    p_ep, d_ep = cfg.prefill.handshake_endpoints[0], cfg.decode.handshake_endpoints[0]
    asks = {p_ep: hello(cfg.decode), d_ep: hello(cfg.prefill)}
    theirs = probe(asks, as_other_uid=True)
    for ep, r in theirs.items():
        assert r["connect"] != "connected" and not r["answer"], (ep, r)
        assert r.get("unix") == "PermissionError", (ep, r)
    ours = probe({p_ep: asks[p_ep]}, as_other_uid=False)
    got = m.DEC_HANDSHAKE.decode(bytes.fromhex(ours[p_ep]["answer"]))
    assert isinstance(got, m.Hello) and got.agent_metadata, got


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own(push):
    """vLLM's cache_salt: P finds a prompt's cached blocks again under the same salt, never under another one, and
    the tokens are the same either way."""
    prompt = [(i * 7 + 3) % 256 for i in range(5 * BLOCK)]

    def hits() -> int:
        return push.stats("prefill").counters.get("prefix_hit_tokens", 0)

    def run(salt: str) -> list[int]:
        return push.complete(prompt, 4, cache_salt=salt)["choices"][0]["token_ids"]

    first = run("tenant-a")
    before = hits()
    assert run("tenant-b") == first and hits() == before
    assert run("tenant-a") == first and hits() >= before + 4 * BLOCK
    wait_pools_free(push)


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_structured_output_holds_on_p_and_d_and_equals_local(push, reference, name):
    """The output held to a grammar: P draws the first token under the grammar's mask, D the rest after taking P's
    token into it; the text is valid, the choice ends with the grammar ("stop"), token for token as local."""
    want = reference["structured"][name]
    assert want["finish"] == "stop" and STRUCTURED[name][1](want["text"]), want
    assert _structured(push, name) == want
    wait_pools_free(push)


@pytest.mark.parametrize("name", ["older", "format"])
def test_a_structural_tag_holds_what_follows_its_trigger_and_equals_local(push, reference, name):
    """A structural tag leaves the output free until its trigger, then holds it to the tag: the greedy output is
    the free one up to and with the trigger (drawn at k >= 1, by D in push), then "=", an integer and ";", token
    for token as local."""
    free = reference["text"]
    k, requests = structural_requests(free)
    want = reference["structural"][name]
    assert want["tokens"][:k + 1] == free[:k + 1] and want["tokens"][k + 1] == ord("="), (free, want)
    assert holds_tags(want["text"], chr(free[k])), want
    assert _structural(push, requests[name]) == want
    wait_pools_free(push)


@pytest.mark.parametrize("name", list(CHOICES))
def test_a_forced_tool_choice_gives_valid_calls_equal_to_local(push, reference, name):
    """tool_choice required or a named function: valid calls of the tools (the output held to their schema on P
    and D), finish_reason tool_calls (a named function's: stop, as vLLM's), as local gives them."""
    want = reference["forced"][name]
    assert want["finish"] == ("stop" if name == "named" else "tool_calls") and want["calls"], want
    valid = {"get_weather": ("city", {"Paris", "Rome"}), "get_time": ("tz", {"UTC", "CET"})}
    for fn, args in want["calls"]:
        key, values = valid[fn]
        assert set(args) == {key} and args[key] in values
    if name == "named":
        assert [fn for fn, _ in want["calls"]] == ["get_time"]
    assert _forced(push, name) == want
    wait_pools_free(push)


NO_THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
               "assistant: <think>\n\n</think>\n\n")  # as Qwen3's template writes it with enable_thinking false


def test_structured_output_with_a_reasoning_parser_holds_the_answer(tmp_path_factory):
    """With --reasoning-parser the grammar holds what follows the reasoning: here the template already ended it in
    the prompt, so the whole answer is held, content and not reasoning, in push as in local."""
    got = {}
    for mode in ("local", "push"):
        with deployment(tmp_path_factory.mktemp(f"think-{mode}"), "--mode", mode, *COMMON, "--reasoning-parser",
                        "qwen3", "--chat-template", NO_THINKING) as dep:
            status, body = dep.post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 20,
                "guided_choice": ["yes", "no", "maybe so"]})
            assert status == 200, body
            got[mode] = body["choices"][0]
            wait_pools_free(dep)
    msg = got["local"]["message"]
    assert msg["content"] in ("yes", "no", "maybe so") and not msg.get("reasoning_content")
    assert got["local"]["finish_reason"] == "stop" and got["push"] == got["local"]
