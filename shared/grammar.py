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


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> OutputGrammar:
    """The grammar of JSON documents valid against `schema`, laid out as JSON_LAYOUT says."""
    return OutputGrammar(JSON_SCHEMA, json.dumps(schema, separators=(",", ":")), param)


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
