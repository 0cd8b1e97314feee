"""Constrained decoding on the torch engine (services/node/engines/grammar.py): the tiny model's
weights are random, so whatever it would say freely is nonsense; under an output grammar its
greedy and sampled outputs must still parse and validate against the schema, end by themselves
with an end token, survive an eviction and a migration's catch-up, and leave the unconstrained
rows of a batch alone. Engines that cannot mask logits refuse a grammar by name."""

from __future__ import annotations

import dataclasses
import json

import jsonschema_rs
import pytest

from services.node.engines.base import RequestBook, SamplingParams
from shared.grammar import (ANY_JSON_OBJECT, GrammarError, closed_objects, compile_grammar,
                            json_schema_grammar)
from shared.schemas import OutputGrammar
from tests.engines import engine_checks as checks

PROMPT = list(range(100, 120))
LIMIT = 120  # tokens; every schema below is complete well before (its strings are bounded)

ENUM = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "size"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"], "additionalProperties": False}},
    "required": ["person"], "additionalProperties": False}
ARRAY = {"type": "object", "properties": {
    "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
           "minItems": 1, "maxItems": 4}},
    "required": ["xs"], "additionalProperties": False}
# Pydantic's shape (what the openai client's parse() sends): $defs and $ref, an optional field
# that strict mode makes required-but-nullable.
REFS = {"$defs": {"Pet": {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 30}, {"type": "null"}]}},
    "required": ["kind", "age"], "additionalProperties": False}},
    "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"},
                                              "maxItems": 3}},
    "required": ["pets"], "additionalProperties": False}
SCHEMAS = {"enum": ENUM, "nested": NESTED, "array": ARRAY, "refs": REFS}
# As Pydantic and hand-written tool schemas come: properties listed, the object not closed.
OPEN = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color"]}


@pytest.fixture
def engine(make_engine):
    return make_engine(dtype="float32")


def constrained(engine, schema, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=LIMIT, eos_token_ids=engine.eos_token_ids,
                          grammar=json_schema_grammar(schema), **kwargs)


def document(tokenizer, engine, out: list[int]):
    """The output as JSON: it must have ended with an end token, before max_tokens."""
    assert out[-1] in engine.eos_token_ids and len(out) < LIMIT, out
    return json.loads(tokenizer.decode(out[:-1]))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_and_sampled_outputs_validate_against_the_schema(engine, tokenizer, name):
    schema = SCHEMAS[name]
    validator = jsonschema_rs.validator_for(schema)
    params = [constrained(engine, schema)]
    params += [constrained(engine, schema, temperature=1.0, seed=seed) for seed in range(3)]
    for i, p in enumerate(params):
        value = document(tokenizer, engine, checks.run_to_end(engine, f"{name}-{i}", PROMPT, p))
        validator.validate(value)


def test_an_open_object_is_generated_with_its_listed_keys_only(engine, tokenizer):
    params = [constrained(engine, OPEN)]
    params += [constrained(engine, OPEN, temperature=1.0, seed=seed) for seed in range(3)]
    for i, p in enumerate(params):
        value = document(tokenizer, engine, checks.run_to_end(engine, f"open-{i}", PROMPT, p))
        jsonschema_rs.validate(OPEN, value)
        assert set(value) <= set(OPEN["properties"]), value


def test_free_output_does_not_parse_so_the_mask_did_the_work(engine, tokenizer):
    free = checks.run_alone(engine, "free", PROMPT, 20, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free))


def test_json_object_is_any_object(engine, tokenizer):
    # The random model's strings are unbounded here: a seed whose object closes early.
    params = constrained(engine, ANY_JSON_OBJECT, temperature=1.0, seed=3)
    value = document(tokenizer, engine, checks.run_to_end(engine, "obj", PROMPT, params))
    assert isinstance(value, dict)


def test_a_stop_token_id_ends_a_complete_output(engine, tokenizer):
    """The request's own end tokens replace the tokenizer's EOS in the mask: here only a stop
    token the client named, and the output ends with it."""
    stop = 42
    params = dataclasses.replace(constrained(engine, ENUM), eos_token_ids=(stop,))
    out = checks.run_to_end(engine, "stop", PROMPT, params)
    assert out[-1] == stop and not set(engine.eos_token_ids) & set(out)
    jsonschema_rs.validate(ENUM, json.loads(tokenizer.decode(out[:-1])))


def test_a_constrained_row_leaves_its_batch_neighbours_alone(engine):
    plain = SamplingParams(max_tokens=12)
    alone = checks.run_alone(engine, "alone", PROMPT, 12, plain)
    engine.add_request("free", PROMPT, plain)
    engine.add_request("json", PROMPT, constrained(engine, ARRAY))
    free = [engine.prefill("free").tokens["free"]]
    engine.prefill("json")
    while len(free) < 12:
        free.append(engine.decode(["json", "free"]).tokens["free"])
    assert free == alone


def test_an_evicted_request_resumes_inside_its_grammar(engine):
    """Re-added with its output as prior_output (a migration by tokens), the matcher catches
    up on that output, and greedy decoding goes on exactly as if it had never moved."""
    params = constrained(engine, NESTED)
    whole = checks.run_to_end(engine, "whole", PROMPT, params)
    engine.add_request("m", PROMPT, params)
    first = [engine.prefill("m").tokens["m"]]
    first += [engine.decode(["m"]).tokens["m"] for _ in range(5)]
    tokens = engine.evict("m")
    moved = dataclasses.replace(params, max_tokens=LIMIT - len(first), prior_output=len(first))
    assert first + checks.run_to_end(engine, "m", tokens, moved) == whole


def test_a_migration_catch_up_rewinds_the_grammar(engine):
    """`extend` replaces the request's last sampled token with the source's tokens: the matcher
    rolls back that token and follows the source's, and the result matches a plain run."""
    params = constrained(engine, ENUM)
    whole = checks.run_to_end(engine, "whole", PROMPT, params)
    engine.add_request("d", PROMPT, params)
    engine.prefill("d")  # the destination sampled one token of its own
    tokens = [engine.extend("d", whole[:4]).tokens["d"]]
    while not engine.is_finished("d"):
        tokens.append(engine.decode(["d"]).tokens["d"])
    engine.release("d")
    assert whole[:4] + tokens == whole


def test_the_compiled_grammar_is_shared_by_requests(engine):
    from services.node.engines import grammar

    grammar._initial.cache_clear()
    for i in range(3):
        engine.add_request(f"c{i}", PROMPT, constrained(engine, ENUM))
    assert grammar._initial.cache_info().misses == 1
    for i in range(3):
        engine.release(f"c{i}")


# -- closing objects (no engine) ---------------------------------------------------------------------


def test_listed_properties_close_their_object_at_every_depth():
    pet = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}
    schema = {"$defs": {"Pet": pet}, "type": "object", "required": ["pets"], "properties": {
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
        "best": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
        "owner": {"allOf": [{"type": "object", "properties": {"name": {"type": "string"}}}]},
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
        "free": {"type": "object"}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Pet"] == {**pet, "additionalProperties": False}
    assert closed["properties"]["owner"]["allOf"][0]["additionalProperties"] is False
    assert closed["properties"]["tags"] == schema["properties"]["tags"]  # other keys asked for
    assert closed["properties"]["free"] == {"type": "object"}  # no properties listed: any object
    assert "additionalProperties" not in schema and "additionalProperties" not in pet  # a copy
    extra = {"pets": [{"kind": "cat", "age": 3}]}
    jsonschema_rs.validate(schema, extra)
    assert not jsonschema_rs.is_valid(closed, extra)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # b is not listed
    {"type": "object", "properties": {"a": {}}, "minProperties": 2},
])
def test_an_object_that_asks_for_other_keys_keeps_them(schema):
    assert closed_objects(schema) == schema


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"not": {"type": "object", "properties": {}}}}},
    {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    # anyOf and $ref apply to the same object: closing either side would refuse the other's keys
    {"properties": {"a": {}}, "required": ["a"],
     "anyOf": [{"properties": {"b": {}}, "required": ["b"]}]},
    {"$defs": {"B": {"properties": {"b": {}}, "required": ["b"]}},
     "properties": {"a": {}}, "required": ["a"], "$ref": "#/$defs/B"},
])
def test_a_schema_where_closing_could_change_its_meaning_is_left_whole(schema):
    assert closed_objects(schema) == schema


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"ignore_eos": True}, {"min_tokens": 2}, {"eos_token_ids": ()}])
def test_a_grammar_needs_an_end_it_can_reach(engine, bad):
    with pytest.raises(ValueError, match="output grammar needs end tokens"):
        engine.add_request("bad", PROMPT, dataclasses.replace(constrained(engine, ENUM), **bad))


def test_a_schema_llguidance_cannot_compile_is_refused_with_its_reason(engine):
    with pytest.raises(GrammarError, match="not"):
        compile_grammar(json_schema_grammar({"not": {"type": "string"}}))
    with pytest.raises(ValueError, match="Invalid type"):
        engine.add_request("bad", PROMPT, constrained(engine, {"type": "nonsense"}))
    assert "bad" not in engine.requests


class _NoMask(RequestBook):
    name = "nomask"

    def __init__(self) -> None:
        self.requests = {}


@pytest.mark.parametrize("param", ["response_format", "tool_choice"])
def test_an_engine_that_cannot_mask_refuses_the_grammar_by_the_parameter_that_asked(param):
    grammar = OutputGrammar("json_schema", "{}", param)
    params = SamplingParams(max_tokens=4, eos_token_ids=(2,), grammar=grammar)
    with pytest.raises(ValueError, match=f"{param} not served by the nomask engine"):
        _NoMask().check_new("r", [1, 2], params, max_context=64, vocab_size=100)


def test_only_the_torch_engine_masks_logits():
    from shared.engine_features import GRAMMAR_FEATURES, unsupported

    asked = sorted(GRAMMAR_FEATURES)
    assert unsupported("torch", asked) == []
    assert unsupported("openvino", asked) == asked
    assert unsupported("vllm", asked) == asked
