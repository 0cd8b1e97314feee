"""Every bad input gets a 4xx in OpenAI's error shape, and the gateway keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from tests.gateway.conftest import PUBLIC_MODEL, SHORT_MODEL

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": PUBLIC_MODEL, "messages": MSG, **kw}


def compl(**kw):
    return {"model": PUBLIC_MODEL, "prompt": "hi", **kw}


# (path, body (dict -> JSON, bytes -> raw), status, param, code)
CASES = [
    # malformed / wrong shape
    (CHAT, b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    (CHAT, b"", 400, None, "invalid_json"),
    (CHAT, b"[1, 2]", 400, None, "invalid_type"),
    (COMPL, b"null", 400, None, "invalid_type"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None,
     "invalid_utf8"),
    # missing fields
    (CHAT, {"messages": MSG}, 400, "model", "missing_required_parameter"),
    (CHAT, {"model": PUBLIC_MODEL}, 400, "messages", "missing_required_parameter"),
    (COMPL, {"model": PUBLIC_MODEL}, 400, "prompt", "missing_required_parameter"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role", "missing_required_parameter"),
    # wrong types
    (CHAT, chat(max_tokens="10"), 400, "max_tokens", "invalid_value"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "invalid_value"),
    (CHAT, chat(stream="yes"), 400, "stream", "invalid_value"),
    (CHAT, chat(messages="hi"), 400, "messages", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", "invalid_value"),
    (COMPL, compl(prompt=3), 400, "prompt", "invalid_value"),
    (COMPL, compl(stop=5), 400, "stop", "invalid_value"),
    (CHAT, {"model": 7, "messages": MSG}, 400, "model", "invalid_value"),
    # unknown model (and a private one of another tenant: see test_auth)
    (CHAT, chat(model="no-such-model"), 404, "model", "model_not_found"),
    # empty prompt / messages
    (CHAT, chat(messages=[]), 400, "messages", "empty_messages"),
    (CHAT, chat(messages=[{"role": "user", "content": ""}]), 400, "messages", "empty_messages"),
    (COMPL, compl(prompt=""), 400, "prompt", "empty_prompt"),
    (COMPL, compl(prompt=[]), 400, "prompt", "empty_prompt"),
    # max_tokens
    (CHAT, chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (COMPL, compl(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", "invalid_value"),
    (CHAT, chat(max_tokens=100_000), 400, "max_tokens", "invalid_value"),
    (COMPL, compl(model=SHORT_MODEL, max_tokens=65), 400, "max_tokens", "invalid_value"),
    # context length
    (COMPL, compl(model=SHORT_MODEL, prompt="word " * 200), 400, "prompt", "context_length_exceeded"),
    (CHAT, chat(model=SHORT_MODEL, messages=[{"role": "user", "content": "word " * 200}]), 400,
     "messages", "context_length_exceeded"),
    (COMPL, compl(model=SHORT_MODEL, prompt="a b c", max_tokens=63), 400, "prompt",
     "context_length_exceeded"),
    # other ranges
    (CHAT, chat(temperature=3.0), 400, "temperature", "invalid_value"),
    (CHAT, chat(top_p=0), 400, "top_p", "invalid_value"),
    (CHAT, chat(stop=[""]), 400, "stop", "invalid_value"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value"),
    (COMPL, compl(prompt=[1, 10**9]), 400, "prompt", "invalid_value"),
    # unsupported parameters, named
    (CHAT, chat(n=17), 400, "n", "invalid_value"),  # above SLINFER_MAX_CHOICES (16)
    (COMPL, compl(n=0), 400, "n", "invalid_value"),
    (COMPL, compl(n=3, best_of=1), 400, "best_of", "invalid_value"),
    (COMPL, compl(best_of=3), 400, "best_of", "unsupported_parameter"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    (COMPL, compl(logprobs=21), 400, "logprobs", "invalid_value"),
    (CHAT, chat(echo=True), 400, "echo", "unsupported_parameter"),  # completions only
    (COMPL, compl(echo=1), 400, "echo", "invalid_value"),
    (COMPL, compl(suffix="end"), 400, "suffix", "unsupported_parameter"),
    (CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias", "invalid_value"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice", "invalid_value"),  # no tools
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400,
     "tools[0].function.name", "invalid_value"),
    (CHAT, chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400,
     "response_format.json_schema.schema", "invalid_value"),
    (COMPL, compl(response_format={"type": "json_object"}, ignore_eos=True), 400, "ignore_eos",
     "invalid_value"),
    (CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", "invalid_value"),
    (COMPL, compl(prompt=["one", "two"]), 400, "prompt", "unsupported_parameter"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content[0]", "unsupported_parameter"),
    # (an unknown key such as `frobnicate` is ignored, not refused: test_client_fields.py)
    # JSON escapes of a lone surrogate: refused by the parser (no tokenizer could take them)
    (COMPL, b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None, "invalid_json"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     None, "invalid_json"),
    # JSON Schema integers: 2.0 is one, "2" and true are not
    (CHAT, chat(max_tokens=True), 400, "max_tokens", "invalid_value"),
    (COMPL, compl(max_tokens=2.5), 400, "max_tokens", "invalid_value"),
]


def _assert_openai_error(resp: httpx.Response, status: int, param, code) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES,
                         ids=[f"{i}-{c[4]}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input(client_a, path, body, status, param, code):
    if isinstance(body, bytes):
        resp = client_a.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = client_a.post(path, json=body)
    err = _assert_openai_error(resp, status, param, code)
    if code == "unsupported_parameter" and param in ("best_of", "tools", "functions"):
        assert param in err["message"]


def test_oversized_body_is_413_before_it_is_read(client_a, gateway):
    big = json.dumps(compl(prompt="x" * (gateway.settings.max_body_bytes + 10)))
    _assert_openai_error(client_a.post(COMPL, content=big), 413, None, "request_too_large")


def test_oversized_chunked_body_is_413(client_a, gateway):
    limit = gateway.settings.max_body_bytes

    def chunks():  # no Content-Length: counted while it is read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(limit // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    _assert_openai_error(client_a.post(COMPL, content=chunks()), 413, None, "request_too_large")


def test_declared_length_over_limit_answers_without_the_body(gateway):
    """A client that declares a huge body gets 413 straight away, without sending it."""
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/nope", 404), ("POST", "/v1/images/generations", 404),
    ("GET", "/v1/completions", 405), ("GET", "/v1/embeddings", 405),
    ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods(client_a, method, path, status):
    resp = client_a.request(method, path)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and path in err["message"]


async def test_gateway_keeps_serving_after_bad_input(gateway, responder):
    """All the bad inputs at once, concurrently; then a good request succeeds."""
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                                 trust_env=False, timeout=20) as client:
        async def send(path, body):
            if isinstance(body, bytes):
                return await client.post(path, content=body)
            return await client.post(path, json=body)

        results = await asyncio.gather(*(send(p, b) for p, b, *_ in CASES))
        assert [r.status_code for r in results] == [c[2] for c in CASES]
        assert (await client.get("/health")).json()["status"] == "ok"
        resp = await client.post(CHAT, json=chat(max_tokens=20))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "Hello, wörld — ✓ 日本"
