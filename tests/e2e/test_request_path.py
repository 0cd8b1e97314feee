"""The whole request path with the official openai client: gateway -> JetStream -> placer ->
node worker -> torch engine -> token stream -> gateway."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from services.gateway.tokenization import encode_chat, encode_text
from tests.polling import until
from tests.e2e.clients import hf_model, openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _reference(model_dir, max_tokens: int, *, prompt: str | None = None,
               messages: list[dict[str, str]] | None = None) -> tuple[str, int]:
    """(text, completion tokens) of Hugging Face's own greedy generation on the stack's model,
    from the prompt tokens the gateway makes: what temperature 0 must answer."""
    import torch

    tokenizer, model = hf_model(str(model_dir))
    ids = encode_chat(tokenizer, messages) if messages is not None else encode_text(tokenizer, prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(new)


@asynccontextmanager
async def _generating(stack, **body):
    """A streamed completion that runs for the whole block (ignore_eos, close to the model's
    context), yielding its request id once its first chunk arrived; leaving the block closes the
    connection mid-stream."""
    body = {"model": stack.model, "prompt": "a long story", "max_tokens": 2000, "stream": True,
            "temperature": 0.7, "seed": 1, "ignore_eos": True, **body}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
            # Read the first chunk without `async for ... break`: that would close the line
            # iterator and with it the stream, i.e. disconnect before the test means to.
            lines = r.aiter_lines()
            line = await anext(lines)
            while not line.startswith("data: "):
                line = await anext(lines)
            yield json.loads(line[6:])["id"]


def test_chat_completion_streams_tokens(stack, demo_model_dir):
    stream = openai_client(stack).chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert finish and finish[-1] in ("stop", "length")
    assert usage and 0 < usage[-1].completion_tokens <= 12 and usage[-1].prompt_tokens > 0
    # Greedy on the real engine must say exactly what Hugging Face's greedy generation says.
    assert (text, usage[-1].completion_tokens) == _reference(
        demo_model_dir, 12, messages=[{"role": "user", "content": "Hello there"}])


def test_completion_non_streaming_is_deterministic_at_temperature_zero(stack, demo_model_dir):
    client = openai_client(stack)
    first = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=8,
                                      temperature=0)
    second = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert (first.choices[0].text, first.usage.completion_tokens) == _reference(
        demo_model_dir, 8, prompt="The quick brown fox")
    assert first.choices[0].finish_reason in ("stop", "length")


async def test_async_client_concurrent_requests_all_complete(stack, demo_model_dir):
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"request number {i}" for i in range(6)]
    results = await asyncio.gather(*[
        client.completions.create(model=stack.model, prompt=p, max_tokens=10, temperature=0)
        for p in prompts])
    await client.close()
    # Batched together on the node, each still says what it says alone (no crossed KV or outputs).
    got = [(r.choices[0].text, r.usage.completion_tokens) for r in results]
    assert got == [_reference(demo_model_dir, 10, prompt=p) for p in prompts]


async def test_the_serving_instance_is_visible_in_the_admin_api(stack):
    async with _generating(stack) as request_id:
        async def shown() -> bool:
            async with httpx.AsyncClient(timeout=10) as c:
                instances = (await c.get(f"{stack.url}/admin/instances")).json()["data"]
                nodes = (await c.get(f"{stack.url}/admin/nodes")).json()["data"]
            serving = [i for i in instances if request_id in i["requests"]]
            if len(serving) != 1:
                return False  # the view is the node's heartbeat snapshot: wait for the next one
            inst = serving[0]
            assert inst["node_id"] == "node-0" and inst["model"] == stack.model
            assert inst["batch_size"] >= 1 and inst["weight_bytes"] > 0
            if inst["status"] != "ready":  # the first chunk may come before a cold start ends
                assert inst["status"] == "loading"
                return False
            assert inst["kv_bytes"] > 0
            (node,) = [n for n in nodes if n["node_id"] == "node-0"]
            return inst["instance_id"] in {i["instance_id"] for i in node["instances"]}

        await until(shown, 30.0, what="the request on its instance in /admin/instances and /admin/nodes")


def test_bad_input_then_good_request(stack):
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": stack.model, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    ok = openai_client(stack).completions.create(model=stack.model, prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def _requests_on_node(stack) -> set[str]:
    data = httpx.get(f"{stack.url}/admin/instances").json()["data"]
    return {rid for inst in data for rid in inst["requests"]}


async def test_client_disconnect_cancels_on_the_node_and_frees_its_kv(stack):
    import nats

    from shared import wire
    from shared.schemas import FinishReason, TokenMessage
    from shared.subjects import token_subject

    nc = await nats.connect(stack.nats_url)
    messages: list[TokenMessage] = []
    finals: asyncio.Queue = asyncio.Queue()

    async def on_token(msg):
        message = wire.decode(TokenMessage, msg.data)
        messages.append(message)
        if message.finished:
            await finals.put(message)

    # ignore_eos and 2000 tokens: the request cannot end on its own before the client leaves, so
    # a CANCELLED final below is the disconnect's doing whatever this box's speed.
    async with _generating(stack) as request_id:
        await nc.subscribe(token_subject(request_id), cb=on_token)

        async def streaming_on_the_node() -> bool:
            return any(m.node_id == "node-0" and m.token_ids for m in messages)

        await until(streaming_on_the_node, 30.0, what="a token from the node")
    # leaving the block closed the connection mid-stream
    final = await asyncio.wait_for(finals.get(), timeout=30)
    await nc.close()
    assert final.finish_reason is FinishReason.CANCELLED  # the node stopped it, not max_tokens
    assert len(final.output_token_ids) < 2000

    async def dropped() -> bool:  # with its KV blocks (the view is the node's heartbeat snapshot)
        return request_id not in _requests_on_node(stack)

    await until(dropped, 30.0, what="the request to leave the node")
