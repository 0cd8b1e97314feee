"""Structured output and tool calls on the default real model (SmolLM2-135M-Instruct), through
the whole stack, asked the way applications ask: the openai client's `chat.completions.parse`
with Pydantic models, for content and for a tool's arguments, streamed and not. The model is
small; the grammar, not the model, makes every answer parse. (The stack serves the model in
the best-effort SLO class: a prompt that describes a tool is ~140 tokens, whose standard TTFT
this model misses on a loaded 2-core CPU, and the placer rightly drops such a request.)
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from shared.default_model import NAME
from tests.e2e.clients import openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
LIMIT = 120  # tokens; every answer below ends well before (greedy, on this model)


class City(BaseModel):
    name: str
    country: str
    # Bounded: greedy, this model writes "1111..." for an unbounded integer until max_tokens
    # (the grammar allows any length); the bound caps its digits.
    population: int = Field(ge=0, le=100_000_000)


class GetWeather(BaseModel):
    city: str


CITY_QUESTION = [{"role": "user", "content": "Describe Paris as JSON with its name, country "
                                             "and population."}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = openai.pydantic_function_tool(GetWeather)


def test_parse_with_a_pydantic_model(real_stack):
    completion = openai_client(real_stack, timeout=300).chat.completions.parse(
        model=NAME, messages=CITY_QUESTION, response_format=City, temperature=0,
        max_tokens=LIMIT)
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert "Paris" in message.parsed.name
    assert completion.choices[0].finish_reason == "stop"


def test_a_streamed_schema_answer_a_json_object_and_a_constrained_completion(real_stack):
    client = openai_client(real_stack, timeout=300)
    schema = {**City.model_json_schema(), "additionalProperties": False}
    chunks = client.chat.completions.create(
        model=NAME, messages=CITY_QUESTION, temperature=0, max_tokens=LIMIT, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema_rs.validate(schema, json.loads(text))
    answer = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=LIMIT, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer with a JSON object whose key city is "
                                              "Paris."}])
    assert json.loads(answer.choices[0].message.content) == {"city": "Paris"}
    capital = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
               "required": ["capital"], "additionalProperties": False}
    completion = client.completions.create(
        model=NAME, prompt="The capital of France as JSON:", temperature=0, max_tokens=LIMIT,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "capital", "schema": capital}}})
    assert json.loads(completion.choices[0].text) == {"capital": "Paris"}


def test_a_named_tool_choice_yields_a_call_the_client_parses(real_stack):
    completion = openai_client(real_stack, timeout=300).chat.completions.parse(
        model=NAME, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=LIMIT)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert "Paris" in call.function.parsed_arguments.city


def _streamed_required_call(client: openai.OpenAI):
    with client.chat.completions.stream(
            model=NAME, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=LIMIT) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    return call, deltas


def test_a_required_call_streamed(real_stack):
    call, deltas = _streamed_required_call(openai_client(real_stack, timeout=300))
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert len(deltas) > 1  # the arguments arrived in pieces


def test_a_call_and_its_result_sent_back(real_stack):
    """The call and its result go back; the model answers (tools still offered)."""
    client = openai_client(real_stack, timeout=300)
    call, _ = _streamed_required_call(client)
    answer = client.chat.completions.create(
        model=NAME, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, messages=[
            *WEATHER_QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}])
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
