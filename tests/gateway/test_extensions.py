"""vLLM's sampling extensions through the gateway: accepted, range-checked, forwarded to the
placer in the InferenceRequest; continuous usage on every streamed chunk; and the exact request
bodies guidellm and `vllm bench serve` send."""

from __future__ import annotations


import pytest

from tests.gateway.clients import api_client, sse_events
from tests.gateway.conftest import PUBLIC_MODEL
from tests.gateway.responder import token_script

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hi"}]


async def test_extensions_are_forwarded(gateway, responder, hf_tokenizer):
    async with api_client(gateway) as c:
        resp = await c.post("/v1/completions", json={
            "model": PUBLIC_MODEL, "prompt": "x", "max_tokens": 30, "temperature": 0.7,
            "top_k": 7, "repetition_penalty": 1.3, "min_tokens": 5})
        assert resp.status_code == 200, resp.text
        resp = await c.post("/v1/chat/completions", json={
            "model": PUBLIC_MODEL, "messages": MSG, "max_tokens": 30, "ignore_eos": True,
            "top_k": -1})
        assert resp.status_code == 200, resp.text
    first, second = responder.requests
    assert (first.top_k, first.repetition_penalty, first.min_tokens, first.ignore_eos) == (7, 1.3, 5, False)
    assert hf_tokenizer.eos_token_id in first.eos_token_ids
    # ignore_eos: no token ends the request on the node, only max_tokens does.
    assert (second.ignore_eos, second.eos_token_ids, second.top_k) == (True, [], 0)
    assert (second.repetition_penalty, second.min_tokens) == (1.0, 0)


@pytest.mark.parametrize(("patch", "param"), [
    ({"top_k": -2}, "top_k"), ({"top_k": 2**31}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens (16 in these tests)
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"min_p": 1.1}, "min_p"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),  # stream is off
])
async def test_bad_extension_values_are_400(gateway, patch, param):
    async with api_client(gateway) as c:
        resp = await c.post("/v1/completions", json={"model": PUBLIC_MODEL, "prompt": "x", **patch})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_on_every_chunk(gateway, responder, path):
    output = responder.default_output("one two three four five")
    responder.script = lambda r: token_script(r, output, chunk=1, delay_s=0.002)
    body = {"model": PUBLIC_MODEL, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MSG})
    async with api_client(gateway) as c:
        resp = await c.post(path, json=body)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    prompt = len(responder.requests[0].prompt_token_ids)
    counts = []
    for event in events:
        use = event["usage"]
        assert use["prompt_tokens"] == prompt
        assert use["total_tokens"] == prompt + use["completion_tokens"]
        counts.append(use["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == len(output)
    assert events[-1]["choices"] == []  # include_usage's final usage chunk
    assert len(set(counts)) > 3  # the count grew along the stream, not only at the end


async def test_usage_null_on_chunks_without_continuous_usage(gateway, responder):
    async with api_client(gateway) as c:
        resp = await c.post("/v1/completions", json={
            "model": PUBLIC_MODEL, "prompt": "x", "stream": True,
            "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"]


async def test_guidellm_and_vllm_bench_bodies_are_served(gateway, responder):
    """The bodies as those tools build them (guidellm 0.8 and vLLM 0.32's benchmark clients)."""
    guidellm_stream = {"stream": True, "stream_options": {"include_usage": True,
                                                          "continuous_usage_stats": True}}
    bodies = [
        ("/v1/completions", {"model": PUBLIC_MODEL, **guidellm_stream, "max_tokens": 32,
                             "stop": None, "ignore_eos": True, "prompt": "a b c"}),
        ("/v1/chat/completions", {"model": PUBLIC_MODEL, **guidellm_stream,
                                  "max_completion_tokens": 32, "stop": None, "ignore_eos": True,
                                  "messages": [{"role": "user", "content": [
                                      {"type": "text", "text": "a b c"}]}]}),
        ("/v1/completions", {"model": PUBLIC_MODEL, "prompt": "a b c", "repetition_penalty": 1.0,
                             "max_tokens": 32, "logprobs": None, "stream": True,
                             "stream_options": {"include_usage": True}, "ignore_eos": True}),
        ("/v1/chat/completions", {"model": PUBLIC_MODEL, "messages": MSG,
                                  "max_completion_tokens": 32, "stream": True,
                                  "stream_options": {"include_usage": True}, "ignore_eos": True,
                                  "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}),
    ]
    async with api_client(gateway) as c:
        for path, body in bodies:
            resp = await c.post(path, json=body)
            assert resp.status_code == 200, (body, resp.text)
            assert sse_events(resp.text)[-1]["usage"]["completion_tokens"] > 0
    assert all(r.ignore_eos and r.max_tokens == 32 for r in responder.requests)
