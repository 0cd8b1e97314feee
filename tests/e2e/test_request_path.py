"""The whole request path with the official openai client: gateway -> JetStream -> placer ->
node worker -> torch engine -> token stream -> gateway."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_completion_streams_tokens(stack):
    stream = _client(stack).chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert finish and finish[-1] in ("stop", "length")
    assert usage and 0 < usage[-1].completion_tokens <= 12 and usage[-1].prompt_tokens > 0
    assert isinstance(text, str)


def test_completion_non_streaming_is_deterministic_at_temperature_zero(stack):
    client = _client(stack)
    first = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=8,
                                      temperature=0)
    second = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens <= 8
    assert first.choices[0].finish_reason in ("stop", "length")


async def test_async_client_concurrent_requests_all_complete(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"request number {i}" for i in range(6)]
    results = await asyncio.gather(*[
        client.completions.create(model=stack.model, prompt=p, max_tokens=10, temperature=0)
        for p in prompts])
    assert all(r.usage.completion_tokens >= 1 for r in results)
    await client.close()


def test_instance_visible_in_admin_api(stack):
    _client(stack).completions.create(model=stack.model, prompt="hi", max_tokens=2)
    nodes = httpx.get(f"{stack.url}/admin/nodes").json()
    assert any(n.get("node_id") == "node-0" for n in nodes.get("data", nodes if isinstance(nodes, list) else []))


def test_bad_input_then_good_request(stack):
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": stack.model, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    ok = _client(stack).completions.create(model=stack.model, prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def _requests_on_node(stack) -> set[str]:
    data = httpx.get(f"{stack.url}/admin/instances").json()["data"]
    return {rid for inst in data for rid in inst["requests"]}


async def test_client_disconnect_cancels_on_the_node_and_frees_its_kv(stack):
    import json

    import nats

    from shared import wire
    from shared.schemas import FinishReason, TokenMessage
    from shared.subjects import token_subject

    nc = await nats.connect(stack.nats_url)
    finals: asyncio.Queue = asyncio.Queue()

    async def on_token(msg):
        message = wire.decode(TokenMessage, msg.data)
        if message.finished:
            await finals.put(message)

    body = {"model": stack.model, "prompt": "a long story", "max_tokens": 2000, "stream": True,
            "temperature": 0.7, "seed": 1}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
            # Read the first chunk without `async for ... break`: that would close the line
            # iterator and with it the stream, i.e. disconnect before the test means to.
            lines = r.aiter_lines()
            line = await anext(lines)
            while not line.startswith("data: "):
                line = await anext(lines)
            request_id = json.loads(line[6:])["id"]
            await nc.subscribe(token_subject(request_id), cb=on_token)
            for _ in range(40):  # the admin view is the node's heartbeat snapshot: give it a beat
                if request_id in _requests_on_node(stack):
                    break
                await asyncio.sleep(0.05)
            assert request_id in _requests_on_node(stack)  # generating on the node right now
        # leaving the block closed the connection mid-stream
    final = await asyncio.wait_for(finals.get(), timeout=15)
    await nc.close()
    assert final.finish_reason is FinishReason.CANCELLED  # the node stopped it, not max_tokens
    assert len(final.output_token_ids) < 2000
    for _ in range(40):  # the admin view is the node's heartbeat snapshot: give it a beat
        if request_id not in _requests_on_node(stack):
            break
        await asyncio.sleep(0.05)
    assert request_id not in _requests_on_node(stack)  # and dropped it (its KV blocks with it)
