"""OpenAI's `n` at the gateway: n choices, each a request of its own to the cluster (its id the
response's with `-i`, a seeded request's seed + i), merged into one answer or interleaved in one
stream; usage counts the prompt once; one failing choice fails the request and cancels the
others, as a client that goes away cancels them all (the stand-in responder plays the nodes)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from services.gateway.service import choice_id, choice_seed
from shared.schemas import FinishReason, InferenceRequest, TokenMessage
from tests.gateway.clients import api_client, sse_events
from tests.gateway.conftest import PUBLIC_MODEL
from tests.gateway.responder import Hang, token_script

pytestmark = pytest.mark.integration

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
WORDS = ["zero", "one one", "two two two"]  # choice i answers WORDS[i]: outputs of their own


def _index(req: InferenceRequest) -> int:
    return int(req.request_id.rsplit("-", 1)[1])


def _client(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="key-a", max_retries=0,
                              timeout=20, http_client=httpx.AsyncClient(trust_env=False))


def test_choice_ids_and_seeds():
    assert choice_id("cmpl-x", 0, 1) == "cmpl-x"  # one choice: the response's own id
    assert [choice_id("cmpl-x", i, 3) for i in range(3)] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None  # unseeded: each node draws its own
    assert choice_seed(2**64 - 1, 2) == 1  # wraps within 64 bits
    assert choice_seed(-(2**63), 1) == -(2**63) + 1


@pytest.mark.parametrize("temperature", [1.0, 0.0])
async def test_each_choice_is_a_request_of_its_own(gateway, responder, temperature):
    outputs = [responder.default_output(w) for w in WORDS]
    responder.script = lambda r: token_script(r, outputs[_index(r)], finish=FinishReason.STOP)
    whole = await _client(gateway).chat.completions.create(
        model=PUBLIC_MODEL, messages=MSG, n=3, seed=7, temperature=temperature, max_tokens=20)
    reqs = sorted(await responder.wait_requests(3), key=lambda r: r.request_id)
    assert [r.request_id for r in reqs] == [f"{whole.id}-{i}" for i in range(3)]
    assert [r.seed for r in reqs] == [7, 8, 9]
    assert {r.temperature for r in reqs} == {temperature}  # greedy choices are allowed too
    assert all(r.prompt_token_ids == reqs[0].prompt_token_ids for r in reqs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == WORDS
    assert [c.finish_reason for c in whole.choices] == ["stop"] * 3
    # the prompt once, as OpenAI counts it; every choice's output
    assert whole.usage.prompt_tokens == len(reqs[0].prompt_token_ids)
    assert whole.usage.completion_tokens == sum(len(o) for o in outputs)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


async def test_unseeded_choices_leave_the_seed_to_the_nodes(gateway, responder):
    async with api_client(gateway) as c:
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x", "n": 2})
    assert resp.status_code == 200, resp.text
    assert [ch["index"] for ch in resp.json()["choices"]] == [0, 1]
    assert [r.seed for r in responder.requests] == [None, None]


async def test_completion_choices_stream_interleaved(gateway, responder):
    """Choice 0 starts late: the others' chunks come first, not held behind it; each choice
    closes with its own finish_reason; one usage chunk sums them."""
    outputs = [responder.default_output(w) for w in WORDS]

    def script(r: InferenceRequest) -> list:
        i = _index(r)
        steps = token_script(r, outputs[i], chunk=1, finish=FinishReason.STOP if i else
                             FinishReason.LENGTH)
        return [0.5, *steps] if i == 0 else steps

    responder.script = script
    async with api_client(gateway) as c:
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x", "n": 3,
                                         "max_tokens": 20, "stream": True, "logprobs": 1,
                                         "stream_options": {"include_usage": True}})
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(map(len, outputs))
    assert all(len(e["choices"]) == 1 and e["usage"] is None for e in chunks)
    order = [e["choices"][0]["index"] for e in chunks]
    assert order[0] != 0 and order[-1] == 0  # interleaved as they came
    for i, words in enumerate(WORDS):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert "".join(ch["text"] for ch in mine) == words
        assert [ch["finish_reason"] for ch in mine][-1] == ("length" if i == 0 else "stop")
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
        # each chunk carries its own choice's logprobs
        tokens = [t for ch in mine if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        assert len(tokens) == len(outputs[i])
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert {e["created"] for e in events} == {events[0]["created"]}


async def test_chat_choices_stream_with_the_openai_client(gateway, responder):
    outputs = [responder.default_output(w) for w in WORDS]
    responder.script = lambda r: token_script(r, outputs[_index(r)], chunk=1, delay_s=0.01,
                                              finish=FinishReason.STOP)
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [None, None, None]
    async for chunk in await _client(gateway).chat.completions.create(
            model=PUBLIC_MODEL, messages=MSG, n=3, stream=True, max_tokens=20):
        (choice,) = chunk.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == WORDS and roles == [1, 1, 1] and finishes == ["stop"] * 3


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_choice_fails_the_request_and_cancels_the_others(gateway, responder,
                                                                        stream):
    """Non-streamed, or streamed before any output: the error's own status."""
    responder.script = lambda r: (token_script(r, [], finish=FinishReason.DROPPED)
                                  if _index(r) == 1 else [Hang()])
    async with api_client(gateway) as c:
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x", "n": 3,
                                         "stream": stream})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "request_dropped"
    reqs = sorted(await responder.wait_requests(3), key=lambda r: r.request_id)
    for req in (reqs[0], reqs[2]):
        notice = await responder.wait_cancel(req.request_id)
        assert notice.reason == "a choice of the request failed"
    await responder.settle()
    assert reqs[1].request_id not in {c.request_id for c in responder.cancels}  # it had ended


async def test_a_choice_failing_mid_stream_is_an_error_event(gateway, responder):
    output = responder.default_output("some text")

    def script(r: InferenceRequest) -> list:
        if _index(r) == 0:
            return token_script(r, output, final=False) + [0.05, TokenMessage(
                r.request_id, len(output), [], finished=True, finish_reason=FinishReason.ERROR,
                error="engine blew up")]
        return token_script(r, output[:1], final=False) + [Hang()]

    responder.script = script
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG, "n": 2,
                                        "stream": True, "max_tokens": 20})
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert "engine blew up" in events[-1]["error"]["message"]
    other = next(r for r in responder.requests if _index(r) == 1)
    assert (await responder.wait_cancel(other.request_id)).reason == \
        "a choice of the request failed"


async def test_a_client_that_goes_away_cancels_every_choice(gateway, responder):
    output = responder.default_output("one two three four")
    responder.script = lambda r: token_script(r, output[:2], chunk=1, final=False) + [Hang()]
    async with api_client(gateway) as c:
        async with c.stream("POST", CHAT, json={"model": PUBLIC_MODEL, "messages": MSG, "n": 3,
                                                "stream": True, "max_tokens": 20}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # leaving the block closes the connection mid-stream
    for req in await responder.wait_requests(3):
        assert (await responder.wait_cancel(req.request_id)).reason == "client disconnected"


async def test_a_client_that_goes_away_before_the_answer_cancels_every_choice(gateway,
                                                                             responder):
    responder.script = lambda r: [Hang()]
    async with api_client(gateway) as c:
        task = asyncio.create_task(c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x",
                                                       "n": 2}))
        reqs = await responder.wait_requests(2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for req in reqs:
        assert (await responder.wait_cancel(req.request_id)).reason == "client disconnected"
