"""A structured output's grammar (``messages.Structured``) as xgrammar builds it, without a tokenizer: what the
router compiles to check a request and each scheduler compiles over its model's tokenizer (scheduler/grammar.py).
Ground: imports only ``messages``; xgrammar only when called."""
from __future__ import annotations

import json

from pushkv.messages import Structured


def grammar_of(spec: Structured):
    """The xgrammar Grammar a spec stands for (no tokenizer needed); ImportError without xgrammar."""
    import xgrammar as xgr

    if spec.kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "structural_tag":
        return structural_tag(json.loads(spec.spec))
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
    return xgr.Grammar.from_ebnf(spec.spec)


def structural_tag(tag: dict):
    """xgrammar's grammar of a structural tag, as vLLM compiles one: the older form (free text until one of
    ``triggers``, then a structure's begin, its JSON schema and its end, then free text again) or xgrammar's own
    ({"format": ...})."""
    import xgrammar as xgr

    if "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(json.dumps(tag))
