"""Output grammars for constrained decoding, compiled with llguidance (Microsoft's guidance
engine: a JSON-Schema-to-grammar compiler and an Earley parser over the tokenizer's bytes that
computes each step's token mask in well under a millisecond).

The gateway builds a request's `OutputGrammar` (from response_format, or from a required or
named tool_choice) and checks it here, so a schema llguidance cannot compile is a 400 before the
request is queued; an engine that masks logits (the torch engine, services/node/engines/grammar.py)
compiles it again against the model's tokenizer.

JSON is generated compact, with one space after ',' and ':' (OpenAI's and Python's default
layout) and no other whitespace: a small model left free to choose whitespace can loop on
newlines until max_tokens, and the layout does not change what the JSON means.

An object schema that lists its `properties` and says nothing of others is generated closed
(`closed_objects`), as vLLM's default grammar backend does: JSON Schema allows unlisted keys
there, and a small model given a Pydantic schema (LangChain's `bind_tools` and
`with_structured_output` send them without `additionalProperties`) goes on inventing keys until
max_tokens. A closed schema's documents are documents of the original; a schema that asks for
unlisted keys (`additionalProperties`, `patternProperties`, ...) keeps them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from shared.schemas import OutputGrammar

JSON_SCHEMA = "json_schema"
LARK = "lark"
KINDS = (JSON_SCHEMA, LARK)
# llguidance's JSON compile options (its "x-guidance" schema key): the layout described above.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object
MAX_GRAMMAR_CHARS = 64 * 1024  # the request travels in one NATS message with its grammar
COMPILED = 256  # grammars whose compiled text is kept (0.4 to 2 ms each to compile again)


class GrammarError(ValueError):
    """A schema or grammar that cannot constrain an output (says why)."""


# Keywords under which narrowing a subschema can widen what the whole accepts (`not`), or make
# it unsatisfiable (several allOf members each listing their own properties): a schema that
# uses any of them anywhere is left as written.
UNCLOSABLE = frozenset({"not", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies",
                        "unevaluatedProperties", "unevaluatedItems"})
# An object that says what keys it has and also applies another schema to itself: closing
# either could refuse the keys the other requires, so a schema with one is left as written too.
OBJECT_KEYWORDS = frozenset({"properties", "required", "patternProperties",
                             "additionalProperties"})
APPLICATORS = frozenset({"$ref", "allOf", "anyOf"})
# Beside `properties`, keywords that admit keys it does not list: such an object keeps them.
OPENING = frozenset({"additionalProperties", "patternProperties", "minProperties",
                     "dependentRequired"})


class _KeepOpen(Exception):
    """The schema uses a keyword under which closing is not known to be safe."""


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> OutputGrammar:
    """The grammar of JSON documents valid against `schema`, its objects closed
    (`closed_objects`), laid out as JSON_LAYOUT says."""
    return OutputGrammar(JSON_SCHEMA, json.dumps(closed_objects(schema), separators=(",", ":")),
                         param)


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `"additionalProperties": false` on every object that lists its properties,
    requires none it does not list, and says nothing else of other keys: reached through
    properties, items, anyOf, a single allOf and $defs. Every document of the result is a
    document of `schema`. A schema that uses a keyword of UNCLOSABLE, or has an object that
    lists keys and applies another schema too, is returned unchanged."""
    try:
        return _close(schema)
    except _KeepOpen:
        return schema


def _close(node: Any) -> Any:
    if not isinstance(node, dict):  # true / false schemas, or a malformed one llguidance refuses
        return node
    keys = node.keys()
    if UNCLOSABLE & keys or len(node.get("allOf") or ()) > 1 \
            or (OBJECT_KEYWORDS & keys and APPLICATORS & keys):
        raise _KeepOpen
    out = dict(node)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in node[key].items()}
    for key in ("items", "prefixItems", "anyOf", "allOf", "additionalProperties"):
        if key in node:
            sub = node[key]
            out[key] = [_close(s) for s in sub] if isinstance(sub, list) else _close(sub)
    if _closable(node):
        out["additionalProperties"] = False
    return out


def _closable(node: dict[str, Any]) -> bool:
    properties, required = node.get("properties"), node.get("required", [])
    return (isinstance(properties, dict) and not OPENING & node.keys()
            and isinstance(required, list) and all(isinstance(r, str) for r in required)
            and set(required) <= properties.keys())


def with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` carrying JSON_LAYOUT as its llguidance options, for a `%json` block inside a Lark
    grammar (a top-level JSON Schema grammar gets them from `compile_grammar`)."""
    return {**schema, "x-guidance": JSON_LAYOUT}


@lru_cache(maxsize=COMPILED)
def compile_grammar(grammar: OutputGrammar) -> str:
    """llguidance's grammar definition for `grammar`, checked (GrammarError if it cannot be
    compiled: a keyword llguidance does not implement, a bad $ref, a Lark syntax error...)."""
    import llguidance

    if len(grammar.text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is {len(grammar.text)} characters; at most "
                           f"{MAX_GRAMMAR_CHARS} are accepted")
    matcher = llguidance.LLMatcher
    if grammar.kind == JSON_SCHEMA:
        try:
            schema = json.loads(grammar.text)
        except ValueError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON Schema must be an object")
        try:
            text = matcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    elif grammar.kind == LARK:
        text = matcher.grammar_from_lark(grammar.text)
    else:
        raise GrammarError(f"unknown grammar kind {grammar.kind!r} (one of {', '.join(KINDS)})")
    failed, messages = matcher.validate_grammar_with_warnings(text)
    if failed:
        raise GrammarError("; ".join(messages))
    return text
