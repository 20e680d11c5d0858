"""Structured output, as vLLM and OpenAI take it: a request's one grammar, from whichever field names it.

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"schema": ...}}``; ``{"type": "text"}`` is no grammar;
- vLLM's ``structured_outputs``: an object of one of ``json`` (a schema, object or JSON text), ``regex``, ``choice``
  (a list of strings), ``grammar`` (EBNF, xgrammar's), ``json_object`` (true), with ``disable_any_whitespace``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (``guided_decoding_backend``
  "xgrammar" or "auto" taken, any other refused).

The grammar is checked here (xgrammar compiles it without a tokenizer), so a bad schema, regex or grammar is a 400
naming the field before anything runs; the schedulers hold each request's output to it (scheduler/grammar.py).
Pure but for that check; xgrammar is imported only when a request asks.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pushkv import limits as L
from pushkv.extras import missing
from pushkv.grammars import grammar_of
from pushkv.messages import Structured
from pushkv.router.api import bad

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OUTPUTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # structured_outputs' grammars
BACKENDS = (None, "", "auto", "xgrammar")


def parse(body: dict, compile: bool = True) -> Optional[Structured]:
    """The request's grammar, or None; a 400 naming the field for a malformed one, for two at once, and for one
    that xgrammar cannot compile (``compile`` False: its shape alone is checked)."""
    found: list[tuple[str, Structured]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if not isinstance(fmt, dict) or not isinstance(kind, str):
            raise bad("response_format", "response_format must be an object with a string 'type'")
        if kind == "json_object":
            found.append(("response_format", Structured("json_object")))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise bad("response_format", "response_format json_schema needs a json_schema object with a schema")
            found.append(("response_format", Structured("json", _schema(js["schema"], "response_format"))))
        elif kind == "structural_tag":
            found.append(("response_format", Structured("structural_tag", _structural_tag(
                {k: v for k, v in fmt.items() if k != "type"}, "response_format"))))
        elif kind != "text":
            raise bad("response_format", f"response_format {kind!r} is not supported (json_object, json_schema, "
                                         "structural_tag, text)")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _guided(kind, body[name], name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        found.append(("structured_outputs", _outputs(outputs)))
    backend = body.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise bad("guided_decoding_backend", f"guided_decoding_backend {backend!r} is not supported: pushkv holds "
                                             "output to a grammar with xgrammar (auto, xgrammar)")
    if body.get("guided_whitespace_pattern") not in (None, ""):
        raise bad("guided_whitespace_pattern", "guided_whitespace_pattern is not supported (structured_outputs' "
                                               "disable_any_whitespace writes compact JSON)")
    if not found:
        return None
    if len(found) > 1:
        raise bad(found[1][0], f"{found[0][0]} and {found[1][0]} both ask for structured output: give one")
    field, spec = found[0]
    if len(spec.spec) > L.MAX_STRUCTURED_CHARS:
        raise bad(field, f"a grammar of at most {L.MAX_STRUCTURED_CHARS} characters, got {len(spec.spec)}")
    if compile:
        check(spec, field)
    return spec


FIELDS = ("response_format", "structured_outputs", *GUIDED)  # the fields that ask for a grammar


def keeps_own(body: dict) -> bool:
    """Whether a chat request's own structured output stands beside a forced tool_choice: vLLM's tool parser
    (adjust_request) leaves a request whose ``structured_outputs`` holds a ``structural_tag`` as it is, so that tag,
    not the calls' schema, holds the output (which is then read as the calls)."""
    outputs = body.get("structured_outputs")
    return isinstance(outputs, dict) and outputs.get("structural_tag") is not None


def set_aside(body: dict, named: bool) -> dict:
    """A chat request whose tool_choice forces calls, without the structured output it asks for: vLLM's tool parser
    sets it aside (``response_format`` None, ``structured_outputs`` replaced: the calls' schema holds the output
    instead). Each field is still checked for its shape, as vLLM's request model checks it (a 400), and with a named
    function, structured_outputs' (or the older guided_*) json, regex or choice is vLLM's 400."""
    outputs = body.get("structured_outputs")
    one_constraint(outputs)
    constrained = [f"structured_outputs.{k}" for k in ("json", "regex", "choice")
                   if isinstance(outputs, dict) and outputs.get(k) is not None]
    constrained += [f for f in ("guided_json", "guided_regex", "guided_choice") if body.get(f) is not None]
    if named and constrained:  # vLLM's ChatCompletionRequest.check_structured_outputs_count
        raise bad(constrained[0], "You can only either use constraints for structured outputs or tools, not both.")
    for field in FIELDS:
        if body.get(field) is not None:
            parse({field: body[field]}, compile=False)
    return {k: v for k, v in body.items() if k not in FIELDS}


def field_of(body: dict) -> str:
    """The field a request's structured output came from (the first given)."""
    return next((f for f in FIELDS if body.get(f) is not None), "response_format")


def _schema(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad(field, f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise bad(field, "a JSON schema must be an object")
    return json.dumps(schema)


def _guided(kind: str, value: Any, field: str) -> Structured:
    if kind == "json":
        return Structured("json", _schema(value, field))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(field, "choice must be a non-empty list of non-empty strings")
        return Structured("choice", json.dumps(list(dict.fromkeys(value))))
    if not isinstance(value, str) or not value:
        raise bad(field, f"{field} must be a non-empty string")
    return Structured(kind, value)  # type: ignore[arg-type]


def _outputs(outputs: Any) -> Structured:
    field = "structured_outputs"
    if not isinstance(outputs, dict):
        raise bad(field, "structured_outputs must be an object")
    one_constraint(outputs)
    named = [k for k in OUTPUTS if outputs.get(k) not in (None, False)]
    if len(named) > 1:  # vLLM's StructuredOutputsParams, which writes its own fields after it
        raise bad(field, "You can only use one kind of structured outputs constraint but multiple are specified: "
                         f"{', '.join(named)}")
    if not named:
        raise bad(field, "You must use one kind of structured outputs constraint but none are specified (one of "
                         f"{', '.join(OUTPUTS)})")
    if outputs.get("whitespace_pattern") not in (None, ""):
        raise bad(field, "structured_outputs.whitespace_pattern is not supported")
    kind = named[0]
    if kind == "structural_tag":  # vLLM's: the tag as JSON text
        tag = outputs[kind]
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError:
                raise bad(f"{field}.{kind}", f"{field}.{kind} must be JSON text of a structural tag") from None
        return Structured("structural_tag", _structural_tag(tag, f"{field}.{kind}"))
    spec = Structured("json_object") if kind == "json_object" else _guided(kind, outputs[kind], f"{field}.{kind}")
    if outputs.get("disable_any_whitespace"):
        spec = Structured(spec.kind, spec.spec, any_whitespace=False)
    return spec


def one_constraint(outputs: Any) -> None:
    """vLLM 0.32's check_structured_outputs_count: structured_outputs with more than one of json, regex and choice is
    a 400 in its words, before the rest is looked at (a forced tool_choice's own 400 among it)."""
    if isinstance(outputs, dict) and sum(outputs.get(k) is not None for k in ("json", "regex", "choice")) > 1:
        raise bad("structured_outputs", "You can only use one kind of constraints for structured outputs ('json', "
                                        "'regex' or 'choice').")


def _structural_tag(tag: Any, field: str) -> str:
    """A structural tag as JSON text: xgrammar's ({"format": ...}) or the older {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}, as vLLM takes both; a 400 naming the field for another shape."""
    if not isinstance(tag, dict):
        raise bad(field, "a structural tag must be an object")
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures or not all(
                isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, bool)) for s in structures):
            raise bad(field, "structures must be a list of objects with a string begin and end and a schema")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise bad(field, "triggers must be a list of strings")
        return json.dumps({"structures": structures, "triggers": triggers})
    if not isinstance(tag.get("format"), dict):
        raise bad(field, "a structural tag needs a format object (or structures and triggers)")
    return json.dumps(tag)


def check(spec: Structured, field: str) -> None:
    """A 400 naming ``field`` when xgrammar cannot compile the spec (or is not installed)."""
    try:
        grammar_of(spec)
    except ImportError:
        raise bad(field, str(missing("xgrammar", "structured output"))) from None
    except (RuntimeError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise bad(field, f"the {spec.kind} does not compile: {msg[-300:]}") from None
