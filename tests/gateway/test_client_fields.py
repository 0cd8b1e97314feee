"""What real clients send: fields slinfer does not know (OpenWebUI's `num_ctx`, vLLM's
`chat_template_kwargs`, a message's `id`, newer stream options) are ignored, logged and named in a
response header; parameters it knows but cannot honour stay a 400 naming them; and a request
without `max_tokens` may use the rest of the model's context, as OpenAI and vLLM allow."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from services.gateway.tokenization import encode_chat
from tests.gateway.conftest import PUBLIC_MODEL, start_gateway
from tests.gateway.responder import Responder, token_script

pytestmark = pytest.mark.integration
HEADER = "x-slinfer-ignored-fields"
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def chat_body(**extra) -> dict:
    body = {"model": PUBLIC_MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi there", "id": "msg-1"}]}
    body.update(extra)
    return body


async def _post(url: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer key-a"},
                                 timeout=20, trust_env=False) as client:
        return await client.post(path, json=body)


async def test_unknown_chat_fields_are_ignored_logged_and_named(gateway, responder, hf_tokenizer,
                                                                caplog):
    output = responder.default_output("fine")
    responder.script = lambda r: token_script(r, output)
    body = chat_body(num_ctx=8192, chat_template_kwargs={"enable_thinking": False})
    with caplog.at_level(logging.INFO, logger="slinfer.gateway"):
        resp = await _post(gateway.url, CHAT, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "fine"
    assert resp.headers[HEADER] == "num_ctx, chat_template_kwargs, messages[0].id"
    (req,) = responder.requests  # the request itself is what it would be without them
    assert req.prompt_token_ids == encode_chat(hf_tokenizer, [{"role": "user",
                                                               "content": "hi there"}])
    assert req.max_tokens == 8
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert any(req.request_id in m and "num_ctx" in m and "messages[0].id" in m
               for m in logged), logged


async def test_unknown_stream_option_is_ignored_on_a_stream(gateway, responder):
    output = responder.default_output("streamed")
    responder.script = lambda r: token_script(r, output, chunk=1)
    body = chat_body(stream=True, stream_options={"include_usage": True,
                                                  "include_obfuscation": False})
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                                 timeout=20, trust_env=False) as client:
        async with client.stream("POST", CHAT, json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers[HEADER] == "stream_options.include_obfuscation, messages[0].id"
            events = [line async for line in resp.aiter_lines() if line.startswith("data: {")]
    usage = json.loads(events[-1].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == len(output)  # include_usage still honoured


async def test_a_request_with_only_known_fields_has_no_header(gateway, responder):
    responder.script = lambda r: token_script(r, responder.default_output("ok"))
    resp = await _post(gateway.url, COMPL, {"model": PUBLIC_MODEL, "prompt": "x", "max_tokens": 4})
    assert resp.status_code == 200 and HEADER not in resp.headers


async def test_odd_unknown_names_cannot_break_the_header(gateway, responder):
    responder.script = lambda r: token_script(r, responder.default_output("ok"))
    odd = {"a\r\nSet-Cookie: x=1": 1, "ünï": 2, **{f"k{i}": i for i in range(100)}}
    resp = await _post(gateway.url, COMPL,
                       {"model": PUBLIC_MODEL, "prompt": "x", "max_tokens": 4, **odd})
    assert resp.status_code == 200, resp.text
    value = resp.headers[HEADER]
    assert "set-cookie" not in resp.headers
    assert value.startswith("a%0D%0ASet-Cookie%3A%20x%3D1, %C3%BCn%C3%AF, k0, k1")
    assert value.endswith("more") and len(value) < 1024


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat_body(num_ctx=1, best_of=2), "best_of"),
    (CHAT, chat_body(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat_body(num_ctx=1, echo=True), "echo"),
    (CHAT, {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "x",
                                                  "function_call": {"name": "f"}}]},
     "messages[0].function_call"),
])
async def test_known_but_unsupported_values_stay_a_400_by_name(gateway, path, body, param):
    resp = await _post(gateway.url, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")


async def test_max_tokens_defaults_to_the_rest_of_the_context(make_settings, seeded_models,
                                                              gateway, nats_url, hf_tokenizer):
    """Without SLINFER_DEFAULT_MAX_TOKENS, a request that names no limit may run to the end of
    the model's context (the package's gateway sets a small default for its other tests)."""
    gw = start_gateway(make_settings(default_max_tokens=None))
    responder = Responder(nats_url, hf_tokenizer)
    await responder.start()
    try:
        responder.script = lambda r: token_script(r, responder.default_output("ok"))
        body = chat_body()
        del body["max_tokens"]
        resp = await _post(gw.url, CHAT, body)
        assert resp.status_code == 200, resp.text
        (req,) = responder.requests
        context = seeded_models[PUBLIC_MODEL].max_context
        assert req.max_tokens == context - len(req.prompt_token_ids)
    finally:
        await responder.stop()
        gw.stop()
