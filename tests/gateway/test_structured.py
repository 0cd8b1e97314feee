"""Structured output and tools at the gateway (the stand-in responder plays the node): what
response_format and tool_choice send to the node as an output grammar, how tools and earlier
calls reach the prompt through a chat template that knows nothing of tools (the tiny model's),
the model's `<tool_call>` blocks parsed into OpenAI's tool_calls whole and streamed (the openai
client reading both), and the refusals: by name where the engine cannot mask logits, and for
combinations a constrained output cannot honour."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.gateway.tokenization import encode_chat
from services.gateway.tools import CALL_OPEN, TOOLS_SYSTEM_PROMPT
from shared.schemas import FinishReason
from tests.gateway.clients import api_client, sse_events
from tests.gateway.conftest import PUBLIC_MODEL
from tests.gateway.responder import token_script

pytestmark = pytest.mark.integration

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"], "additionalProperties": False}
CALL = f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'


def _openai(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="key-a", max_retries=0,
                              http_client=httpx.AsyncClient(trust_env=False))


def _says(responder, text: str, chunk: int = 1) -> None:
    """The node's output will be `text`, ended by the model (EOS)."""
    ids = responder.default_output(text)
    responder.script = lambda r: token_script(r, ids, chunk=chunk, finish=FinishReason.STOP)


# -- what reaches the node ---------------------------------------------------------------------------


async def test_response_format_travels_as_a_grammar_on_both_endpoints(gateway, responder):
    _says(responder, '{"answer": "x"}')
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    async with api_client(gateway) as c:
        for path, body in ((CHAT, {"messages": MSG}), (COMPL, {"prompt": "x"})):
            for response_format in (fmt, {"type": "json_object"}, {"type": "text"}):
                resp = await c.post(path, json={"model": PUBLIC_MODEL, **body,
                                                "response_format": response_format})
                assert resp.status_code == 200, resp.text
    grammars = [r.grammar for r in responder.requests]
    for schema_grammar, object_grammar, text in (grammars[:3], grammars[3:]):
        assert (schema_grammar.kind, schema_grammar.param) == ("json_schema", "response_format")
        assert json.loads(schema_grammar.text) == SCHEMA
        assert json.loads(object_grammar.text) == {"type": "object"}
        assert text is None


async def test_tool_choice_decides_the_grammar_and_the_prompt(gateway, responder, hf_tokenizer):
    _says(responder, "ok")
    base = {"model": PUBLIC_MODEL, "messages": MSG, "tools": [WEATHER, TIME]}
    choices = ["auto", "none", "required", {"type": "function", "function": {"name": "get_time"}}]
    async with api_client(gateway) as c:
        for choice in choices:
            resp = await c.post(CHAT, json={**base, "tool_choice": choice})
            assert resp.status_code == 200, resp.text
        resp = await c.post(CHAT, json={**base, "parallel_tool_calls": False,
                                        "tool_choice": "required"})
        assert resp.status_code == 200, resp.text
    auto, none, required, named, single = responder.requests
    assert auto.grammar is None and none.grammar is None
    assert none.prompt_token_ids == encode_chat(hf_tokenizer, MSG)  # no tools shown
    prompt = hf_tokenizer.decode(auto.prompt_token_ids)
    assert "get_weather" in prompt and "get_time" in prompt and CALL_OPEN in prompt
    assert auto.prompt_token_ids == required.prompt_token_ids == named.prompt_token_ids
    for forced in (required, named, single):
        assert (forced.grammar.kind, forced.grammar.param) == ("lark", "tool_choice")
    assert "get_weather" in required.grammar.text and "get_weather" not in named.grammar.text
    assert "call)*" in required.grammar.text and "call)*" not in single.grammar.text


async def test_earlier_calls_and_results_reach_a_template_without_tools(gateway, responder,
                                                                        hf_tokenizer):
    _says(responder, "It is sunny.")
    conversation = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": conversation,
                                        "tools": [WEATHER]})
        assert resp.status_code == 200, resp.text
    prompt = hf_tokenizer.decode(responder.requests[0].prompt_token_ids)
    system = TOOLS_SYSTEM_PROMPT.split("\n")[0]
    assert prompt.index(system) < prompt.index("weather in Paris?") < prompt.index(CALL)
    assert prompt.index(CALL) < prompt.index("<tool_response>\nsunny, 21 C\n</tool_response>")


# -- the answer --------------------------------------------------------------------------------------


async def test_a_call_is_parsed_whole_and_streamed(gateway, responder):
    _says(responder, f"Let me look.\n{CALL}")
    body = {"model": PUBLIC_MODEL, "messages": MSG, "tools": [WEATHER]}
    async with api_client(gateway) as c:
        whole = (await c.post(CHAT, json=body)).json()
        events = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "Let me look."
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # streamed: the head (id, name, empty arguments) first, then the arguments in pieces
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert len(pieces) > 2 and all(p["index"] == 0 for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(CALL_OPEN in (d.get("content") or "") for d in deltas)


async def test_the_openai_client_reads_calls_whole_and_streamed(gateway, responder):
    second = CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}")
    _says(responder, f"{CALL}\n{second}", chunk=3)
    client = _openai(gateway)
    args = dict(model=PUBLIC_MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice="required")
    whole = (await client.chat.completions.create(**args)).choices[0]
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    async with client.chat.completions.stream(**args) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    await client.close()


async def test_text_that_only_looks_like_a_call_stays_text(gateway, responder):
    text = "Use <tool_call> tags like <tool_call>this</tool_call> and <tool"
    _says(responder, text)
    body = {"model": PUBLIC_MODEL, "messages": MSG, "tools": [WEATHER]}
    async with api_client(gateway) as c:
        whole = (await c.post(CHAT, json=body)).json()["choices"][0]
        events = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
    assert whole["message"]["content"] == text and "tool_calls" not in whole["message"]
    assert whole["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == text
    # without tools nothing is parsed: the block is the answer's text
    _says(responder, CALL)
    async with api_client(gateway) as c:
        plain = (await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG})).json()
    assert plain["choices"][0]["message"]["content"] == CALL


async def test_the_openai_client_parses_structured_content(gateway, responder):
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str

    _says(responder, '{"answer": "Paris"}')
    client = _openai(gateway)
    parsed = await client.chat.completions.parse(model=PUBLIC_MODEL, messages=MSG,
                                                 response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(answer="Paris")
    grammar = responder.requests[0].grammar
    assert json.loads(grammar.text)["properties"]["answer"]["type"] == "string"
    await client.close()


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("patch", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
])
async def test_an_engine_that_cannot_mask_refuses_by_name(gateway, responder, openvino_model,
                                                          patch, param):
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": openvino_model, "messages": MSG, **patch})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
        assert "openvino" in error["message"]
        # auto needs no mask: the openvino model takes tools, its calls parsed
        auto = await c.post(CHAT, json={"model": openvino_model, "messages": MSG,
                                        "tools": [WEATHER]})
        assert auto.status_code == 200, auto.text


@pytest.mark.parametrize(("patch", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "not": {"type": "string"}}}}], "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
async def test_what_cannot_be_honoured_is_a_400_by_name(gateway, patch, param):
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG, **patch})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
