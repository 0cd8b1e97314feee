"""The token path with the official openai client: gateway -> JetStream -> (stand-in responder)
-> token subject -> gateway, streamed and not, sync and async."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import httpx
import openai
import pytest
from redis.asyncio import Redis

from services.gateway.tokenization import encode_chat
from shared import wire
from shared.adaptergen import build_adapter
from shared.core.types import slo_for_class
from shared.model_state import ModelState, get_status
from shared.schemas import FinishReason, TokenMessage
from shared.subjects import MODELS_HASH
from tests.gateway.conftest import PUBLIC_MODEL
from tests.gateway.responder import Hang, token_script

TEXT = "Hello, wörld — ✓ 日本"  # multi-byte characters split over byte-level tokens
pytestmark = pytest.mark.integration


def sync_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="key-a", max_retries=0, timeout=20,
                         http_client=httpx.Client(trust_env=False))


def async_client(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="key-a", max_retries=0, timeout=20,
                              http_client=httpx.AsyncClient(trust_env=False))


@pytest.mark.parametrize("order", ["in_order", "shuffled", "gap"])
async def test_chat_non_stream_reorders_and_fills_gaps(gateway, responder, hf_tokenizer, order):
    output = responder.default_output(TEXT)
    responder.script = lambda r: token_script(r, output, chunk=2, order=order, finish=FinishReason.STOP)
    client = sync_client(gateway)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    resp = await asyncio.to_thread(client.chat.completions.create, model=PUBLIC_MODEL,
                                   messages=messages, max_tokens=40)
    assert resp.choices[0].message.content == TEXT
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    prompt_ids = encode_chat(hf_tokenizer, messages)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(output)
    assert resp.usage.total_tokens == len(prompt_ids) + len(output)
    # What the placer receives.
    (req,) = responder.requests
    assert req.prompt_token_ids == prompt_ids
    assert req.model == PUBLIC_MODEL and req.tenant == "tenant-a" and req.max_tokens == 40
    slo = slo_for_class("standard", len(prompt_ids))
    assert (req.ttft_slo_s, req.tpot_slo_s) == (slo.ttft_s, slo.tpot_s)
    assert req.eos_token_ids and hf_tokenizer.eos_token_id in req.eos_token_ids
    assert responder.headers[0]["Nats-Msg-Id"] == req.request_id
    assert resp.id == req.request_id
    await responder.settle()  # a cancel the gateway sent would have arrived by now
    assert responder.cancels == []  # finished by the node: nothing to cancel


@pytest.mark.parametrize("order", ["in_order", "shuffled", "gap"])
async def test_chat_stream_async(gateway, responder, order):
    output = responder.default_output(TEXT)
    responder.script = lambda r: token_script(r, output, chunk=1, order=order, delay_s=0.005)
    client = async_client(gateway)
    stream = await client.chat.completions.create(
        model=PUBLIC_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=len(output),
        stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                assert "\ufffd" not in choice.delta.content  # never half a character
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == TEXT
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == len(output)
    assert usage.prompt_tokens == len(responder.requests[0].prompt_token_ids)


async def test_completion_sync_stream_and_async_non_stream(gateway, responder):
    output = responder.default_output(TEXT)
    responder.script = lambda r: token_script(r, output, chunk=3, order="shuffled")

    def run_sync_stream() -> tuple[str, str | None]:
        text, finish = "", None
        for chunk in sync_client(gateway).completions.create(model=PUBLIC_MODEL, prompt="Once upon",
                                                            max_tokens=30, stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    assert await asyncio.to_thread(run_sync_stream) == (TEXT, "length")
    resp = await async_client(gateway).completions.create(model=PUBLIC_MODEL, prompt="Once upon",
                                                          max_tokens=30)
    assert resp.choices[0].text == TEXT and resp.choices[0].finish_reason == "length"
    assert resp.object == "text_completion"
    assert resp.usage.completion_tokens == len(output)
    assert responder.requests[0].prompt_token_ids[0] == responder.tokenizer.bos_token_id


async def test_completion_token_id_prompt_and_default_max_tokens(gateway, responder):
    resp = await async_client(gateway).completions.create(model=PUBLIC_MODEL, prompt=[5, 17, 42])
    assert resp.choices[0].text == TEXT
    (req,) = responder.requests
    assert req.prompt_token_ids == [5, 17, 42]
    assert req.max_tokens == gateway.settings.default_max_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_sequence_cuts_text_and_cancels(gateway, responder, stream):
    output = responder.default_output("alpha beta STOP gamma delta")
    responder.script = lambda r: token_script(r, output[:-2], chunk=1, delay_s=0.01, final=False) + [Hang()]
    client = async_client(gateway)
    if stream:
        text, finish = "", None
        async for chunk in await client.completions.create(model=PUBLIC_MODEL, prompt="x", max_tokens=50,
                                                          stop=["STOP", "never"], stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    else:
        resp = await client.completions.create(model=PUBLIC_MODEL, prompt="x", max_tokens=50, stop="STOP")
        text, finish = resp.choices[0].text, resp.choices[0].finish_reason
    assert text == "alpha beta "
    assert finish == "stop"
    notice = await responder.wait_cancel(responder.requests[0].request_id)
    assert notice.reason == "stop sequence"


async def test_stop_sequence_split_across_tokens_is_held_back(gateway, responder):
    # Single-character tokens: "ST" arrives before "OP"; the client must never see "ST".
    output = [t for ch in "ab STOP cd" for t in responder.tokenizer.encode(ch, add_special_tokens=False)]
    responder.script = lambda r: token_script(r, output, chunk=1, delay_s=0.01)
    chunks = []
    async for chunk in await async_client(gateway).completions.create(
            model=PUBLIC_MODEL, prompt="x", max_tokens=50, stop="STOP", stream=True):
        chunks.append(chunk.choices[0].text)
    assert "".join(chunks) == "ab "
    assert not any("S" in c for c in chunks)


async def test_dropped_request_is_503_before_the_stream_starts(gateway, responder):
    responder.script = lambda r: token_script(r, [], finish=FinishReason.DROPPED)
    client = async_client(gateway)
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model=PUBLIC_MODEL, messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503
    assert err.value.body["type"] == "server_overloaded" and err.value.body["code"] == "request_dropped"
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model=PUBLIC_MODEL, stream=True,
                                             messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503


async def test_error_after_the_stream_started_is_an_error_event(gateway, responder):
    output = responder.default_output("some text")
    responder.script = lambda r: token_script(r, output, final=False) + [0.02, TokenMessage(
        r.request_id, len(output), [], finished=True, finish_reason=FinishReason.ERROR,
        error="engine blew up")]
    got = ""
    with pytest.raises(openai.APIError) as err:
        async for chunk in await async_client(gateway).completions.create(
                model=PUBLIC_MODEL, prompt="x", max_tokens=30, stream=True):
            got += chunk.choices[0].text
    assert "engine blew up" in str(err.value)
    assert got == "some text"


async def test_timeout_is_504_and_cancels(make_settings, seeded_models, nats_url, hf_tokenizer):
    """The node never answers, so the request times out whatever the timeout and the box's
    speed; the test waits for events (the request reaching the responder, the cancel notice)
    instead of assuming what happened within the 0.5 s."""
    from tests.gateway.conftest import start_gateway
    from tests.gateway.responder import Responder

    gw = start_gateway(make_settings(request_timeout_s=0.5))
    r = Responder(nats_url, hf_tokenizer, script=lambda req: [Hang()])
    await r.start()
    try:
        with pytest.raises(openai.APIStatusError) as err:
            await async_client(gw).completions.create(model=PUBLIC_MODEL, prompt="x", max_tokens=5)
        assert err.value.status_code == 504 and err.value.body["code"] == "request_timeout"
        # The responder may pull the request only after the gateway gave up (a slow box).
        (req,) = await r.wait_requests(1, timeout_s=30)
        assert (await r.wait_cancel(req.request_id, timeout_s=30)).reason == "timeout"
    finally:
        await r.stop()
        await asyncio.to_thread(gw.stop)


async def test_client_disconnect_mid_stream_publishes_cancel(gateway, responder):
    output = responder.default_output("one two three four five six")
    # A few tokens, then the node keeps the request running (no final message).
    responder.script = lambda r: token_script(r, output[:4], chunk=1, final=False) + [Hang()]
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=10,
                                 headers={"Authorization": "Bearer key-a"}) as client:
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": PUBLIC_MODEL, "stream": True, "max_tokens": 50,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            seen = 0
            async for line in lines:
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    seen += 1
                    if seen == 2:
                        break
    # Leaving the context closed the connection mid-stream.
    notice = await responder.wait_cancel(responder.requests[0].request_id)
    assert notice.reason == "client disconnected"


async def test_client_disconnect_while_waiting_publishes_cancel(gateway, responder):
    """Non-streaming, and before any token: the gateway notices the closed socket itself."""
    responder.script = lambda r: [Hang()]
    body = (b'{"model": "%s", "prompt": "hello", "max_tokens": 5}' % PUBLIC_MODEL.encode())
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await responder.wait_requests(1)
    writer.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
    writer.close()
    notice = await responder.wait_cancel(responder.requests[0].request_id)
    assert notice.reason == "client disconnected"


@pytest.mark.parametrize("broken", [True, False])
async def test_a_dropped_request_for_a_broken_adapter_is_model_failed(
        gateway, responder, redis_url, seeded_models, model_dir, tmp_path, broken):
    """Issue 24: a request through an adapter no node holds, dropped for load (a busy box's
    calibrated profile makes the adapter's load break the TTFT), is answered by the adapter's
    broken files - 500 model_failed, its lifecycle failed - not as overload; a whole adapter's
    drop stays a 503."""
    name = f"drop-adapter-{broken}"
    directory = build_adapter(model_dir, tmp_path / name, seed=3)
    record = dataclasses.replace(seeded_models[PUBLIC_MODEL], name=name, path=str(directory),
                                 base_model=PUBLIC_MODEL, lora_rank=8)
    redis = Redis.from_url(redis_url)
    await redis.hset(MODELS_HASH, name, wire.encode(record))
    if broken:
        (directory / "adapter_config.json").write_text("{ not json")
    responder.script = lambda r: token_script(r, [], finish=FinishReason.DROPPED)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20, trust_env=False,
                                 headers={"Authorization": "Bearer key-a"}) as http:
        answers = [await http.post("/v1/completions", json={"model": name, "prompt": "x",
                                                            "max_tokens": 2, "stream": stream})
                   for stream in (True, False)]
    status = await get_status(redis, name)
    await redis.aclose()
    for r in answers:
        error = r.json()["error"]
        if not broken:
            assert (r.status_code, error["code"]) == (503, "request_dropped"), r.text
            continue
        assert (r.status_code, error["code"]) == (500, "model_failed"), r.text
        assert f"{name!r}" in error["message"] and "missing or unreadable" in error["message"]
        assert str(directory) not in error["message"]
    if broken:
        assert status.state is ModelState.FAILED and str(directory) in status.kind("cpu").reason
    else:
        assert status is None
