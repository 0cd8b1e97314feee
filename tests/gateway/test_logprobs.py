"""Logprobs and OpenAI's sampling parameters at the gateway: validated with OpenAI's ranges, sent to
the node in the InferenceRequest, refused by name for a model whose engine would not honour them,
and the node's per-token logprobs rendered in the chat and completions shapes, streamed and not
(the stand-in responder plays the node: each token at log(1/2), its alternatives below)."""

from __future__ import annotations

import dataclasses
import math

import openai
import pytest

from shared.schemas import FinishReason, TokenBias, TokenMessage
from tests.gateway.clients import api_client, sse_events
from tests.gateway.conftest import PUBLIC_MODEL
from tests.gateway.responder import scripted_logprobs, token_script

pytestmark = pytest.mark.integration

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
TEXT = "Hello, wörld — ✓ 日本"  # byte-level tokens that are parts of characters


# -- what reaches the node ---------------------------------------------------------------------------


async def test_the_parameters_travel_in_the_request(gateway, responder, hf_tokenizer):
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={
            "model": PUBLIC_MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 3,
            "presence_penalty": 0.5, "frequency_penalty": -1.5, "logit_bias": {"7": -100, "9": 2},
            "min_p": 0.05, "stop_token_ids": [11, 12, 11]})
        assert resp.status_code == 200, resp.text
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x", "logprobs": 0,
                                         "ignore_eos": True, "stop_token_ids": [11]})
        assert resp.status_code == 200, resp.text
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG,
                                        "logprobs": False, "top_logprobs": 0})
        assert resp.status_code == 200, resp.text
    chat, completion, plain = responder.requests
    assert chat.logprobs == 3 and completion.logprobs == 0 and plain.logprobs is None
    assert (chat.presence_penalty, chat.frequency_penalty, chat.min_p) == (0.5, -1.5, 0.05)
    assert chat.logit_bias == [TokenBias(7, -100.0), TokenBias(9, 2.0)]
    # stop_token_ids end the output as an EOS does; with ignore_eos they alone end it
    assert hf_tokenizer.eos_token_id in chat.eos_token_ids and chat.eos_token_ids[-2:] == [11, 12]
    assert completion.eos_token_ids == [11]
    assert (plain.presence_penalty, plain.logit_bias, plain.min_p) == (0.0, [], 0.0)


@pytest.mark.parametrize(("path", "patch", "param"), [
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.01}, "frequency_penalty"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
    (CHAT, {"logit_bias": {"five": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"-5": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"99999": 1}}, "logit_bias"),  # beyond the vocabulary
    (CHAT, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (CHAT, {"min_p": 1.5}, "min_p"),
    (CHAT, {"min_p": -0.1}, "min_p"),
    (CHAT, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (CHAT, {"stop_token_ids": [99999]}, "stop_token_ids"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
    (COMPL, {"logprobs": 21}, "logprobs"),
    (COMPL, {"logprobs": -1}, "logprobs"),
    (COMPL, {"logprobs": True}, "logprobs"),  # the completions API's is a number
])
async def test_out_of_range_values_are_400_by_name(gateway, path, patch, param):
    body = {"model": PUBLIC_MODEL, **({"messages": MSG} if path == CHAT else {"prompt": "x"}),
            **patch}
    async with api_client(gateway) as c:
        resp = await c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error


@pytest.mark.parametrize(("path", "patch", "param"), [
    (CHAT, {"logprobs": True}, "logprobs"),
    (COMPL, {"logprobs": 2}, "logprobs"),
    (CHAT, {"presence_penalty": 0.1}, "presence_penalty"),
    (CHAT, {"frequency_penalty": 0.1}, "frequency_penalty"),
    (COMPL, {"logit_bias": {"5": 1}}, "logit_bias"),
    (COMPL, {"min_p": 0.1}, "min_p"),
])
async def test_an_engine_that_cannot_honour_a_parameter_refuses_it_by_name(
        gateway, responder, openvino_model, path, patch, param):
    body = {"model": openvino_model, **({"messages": MSG} if path == CHAT else {"prompt": "x"})}
    async with api_client(gateway) as c:
        resp = await c.post(path, json={**body, **patch})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
        assert "openvino" in error["message"] and param in error["message"]
        # neutral values are no request for the feature: served
        neutral = await c.post(path, json={**body, "presence_penalty": 0, "min_p": 0,
                                           "logit_bias": {}, "stop_token_ids": [5]})
        assert neutral.status_code == 200, neutral.text
    assert [r.model for r in responder.requests] == [openvino_model]  # only the neutral one


# -- the chat shape ------------------------------------------------------------------------------------


async def test_chat_logprobs_whole_and_streamed(gateway, responder, hf_tokenizer):
    output = responder.default_output(TEXT)
    responder.script = lambda r: token_script(r, output, chunk=1)
    body = {"model": PUBLIC_MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 2,
            "max_tokens": 40}
    async with api_client(gateway) as c:
        whole = (await c.post(CHAT, json=body)).json()
        streamed = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
    choice = whole["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert len(content) == len(output) == whole["usage"]["completion_tokens"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]
    for token, entry in zip(output, content):
        assert entry["logprob"] == pytest.approx(math.log(0.5))
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [math.log(0.5), math.log(0.25)])
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # the token itself leads
        assert entry["token"] == bytes(entry["bytes"]).decode(errors="replace")
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert streamed[0]["choices"][0]["logprobs"] is None  # the role chunk has no token
    pieces = [e["choices"][0]["logprobs"]["content"] for e in streamed[1:]
              if e["choices"][0]["logprobs"] is not None]
    assert [entry for piece in pieces for entry in piece] == content
    # a chunk whose text was held back (half a character) sent nothing: its tokens' entries
    # came with the next chunk that had text
    assert any(len(piece) > 1 for piece in pieces)
    assert streamed[-1]["choices"][0]["logprobs"] is None  # the closing chunk: no token left
    for event in streamed[1:-1]:
        delta = event["choices"][0]
        text = b"".join(bytes(e["bytes"]) for e in delta["logprobs"]["content"])
        assert text.decode() == delta["delta"]["content"]


async def test_no_logprobs_unless_asked(gateway, responder):
    async with api_client(gateway) as c:
        whole = (await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG})).json()
        streamed = sse_events((await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x",
                                                      "stream": True})).text)
    assert whole["choices"][0]["logprobs"] is None
    assert all(e["choices"][0]["logprobs"] is None for e in streamed)
    assert all(r.logprobs is None for r in responder.requests)


# -- the completions shape -----------------------------------------------------------------------------


async def test_completion_logprobs_whole_and_streamed(gateway, responder):
    output = responder.default_output(TEXT)
    responder.script = lambda r: token_script(r, output, chunk=3)
    body = {"model": PUBLIC_MODEL, "prompt": "x", "logprobs": 3, "max_tokens": 40}
    async with api_client(gateway) as c:
        whole = (await c.post(COMPL, json=body)).json()
        streamed = sse_events((await c.post(COMPL, json={**body, "stream": True})).text)
    choice = whole["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(output) == whole["usage"]["completion_tokens"]
    assert lp["token_logprobs"] == pytest.approx([math.log(0.5)] * len(output))
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert top[token] == pytest.approx(math.log(0.5))  # the chosen token is always there
        assert 1 <= len(top) <= 4
        assert sorted(top.values(), reverse=True) == list(top.values())
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    # a whole token's text starts at its offset (parts of one character share the offset)
    for token, offset in zip(lp["tokens"], offsets):
        if "\ufffd" not in token:
            assert text[offset:offset + len(token)] == token
    merged = {key: [v for e in streamed if e["choices"][0]["logprobs"] is not None
                    for v in e["choices"][0]["logprobs"][key]] for key in lp}
    assert merged == lp
    assert "".join(e["choices"][0]["text"] for e in streamed) == text


async def test_stop_token_ids_end_the_text_without_their_own(gateway, responder, hf_tokenizer):
    output = responder.default_output("one two three")
    stop = output[-1]
    responder.script = lambda r: token_script(r, output, chunk=1, finish=FinishReason.STOP)
    async with api_client(gateway) as c:
        resp = (await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "x", "logprobs": 1,
                                          "stop_token_ids": [stop]})).json()
    choice = resp["choices"][0]
    shown = hf_tokenizer.decode(output[:-1])
    assert choice["text"] == shown and choice["finish_reason"] == "stop"
    assert resp["usage"]["completion_tokens"] == len(output)  # the stop token is output
    assert len(choice["logprobs"]["tokens"]) == len(output)
    assert choice["logprobs"]["text_offset"][-1] == len(shown)


def _losing(output: list[int], lose_in: set[int]):
    """The node's part, one token a message from where the attempt starts; in the attempts in
    `lose_in` the message of the attempt's second token is lost (the final one fills its id,
    not its logprobs)."""
    def script(r):
        start = len(r.resumed_token_ids)
        assert r.resumed_token_ids == output[:start]
        steps = [TokenMessage(r.request_id, start + i, [tok], attempt=r.attempt,
                              logprobs=scripted_logprobs(r, [tok]))
                 for i, tok in enumerate(output[start:])
                 if not (r.attempt in lose_in and i == 1)]
        return [*steps, TokenMessage(r.request_id, len(output), [], finished=True,
                                     finish_reason=FinishReason.LENGTH, attempt=r.attempt,
                                     output_token_ids=list(output), node_id="fake-node",
                                     prompt_tokens=len(r.prompt_token_ids))]
    return script


async def test_tokens_whose_logprobs_were_lost_are_asked_again_from_a_new_attempt(
        gateway, responder):
    """The final message fills a lost token, not its logprobs: the client has not seen that
    token yet, so the request goes on from the token before it as a new attempt, which sends
    the rest with their logprobs (a token message lost while NATS restarts)."""
    output = responder.default_output("one two three four five six")
    responder.script = _losing(output, lose_in={0})
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG, "logprobs": True,
                                        "max_tokens": len(output)})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["logprobs"]["content"]) == len(output)
    mine = [r for r in responder.requests if r.request_id == responder.requests[-1].request_id]
    assert [(r.attempt, r.resumed_token_ids) for r in mine] == [(0, []), (1, output[:1])]


async def test_logprobs_lost_on_every_attempt_fail_the_request_by_name(gateway, responder):
    """...a bounded number of times (the watchdog's resumes); then the answer says so rather
    than leave a hole in the list. Without logprobs the final message fills the gap."""
    output = responder.default_output("one two three four five six")
    responder.script = _losing(output, lose_in={0, 1, 2, 3, 4, 5})
    async with api_client(gateway) as c:
        resp = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG, "logprobs": True,
                                        "max_tokens": len(output)})
        plain = await c.post(CHAT, json={"model": PUBLIC_MODEL, "messages": MSG,
                                         "max_tokens": len(output)})
    assert resp.status_code == 500, resp.text
    assert "logprobs" in resp.json()["error"]["message"]
    assert plain.status_code == 200, plain.text


# -- the openai client reads them ----------------------------------------------------------------------


async def test_the_openai_client_parses_the_logprobs(gateway, responder):
    output = responder.default_output("one two three")
    responder.script = lambda r: token_script(r, output, chunk=1)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="key-a", max_retries=0)
    chat = await client.chat.completions.create(model=PUBLIC_MODEL, messages=MSG, logprobs=True,
                                                top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
               for t in content)
    stream = await client.chat.completions.create(model=PUBLIC_MODEL, messages=MSG,
                                                  logprobs=True, stream=True)
    tokens = [t.token async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]
    completion = await client.completions.create(model=PUBLIC_MODEL, prompt="x", logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.token_logprobs == pytest.approx([math.log(0.5)] * len(output))
    await client.close()


# -- echo (completions) ----------------------------------------------------------------------------


async def test_echo_repeats_the_prompt_before_the_text(gateway, responder, hf_tokenizer):
    output = responder.default_output("one two")
    responder.script = lambda r: token_script(r, output, chunk=1)
    ids = hf_tokenizer.encode("Über den Fluss", add_special_tokens=False)
    body = {"model": PUBLIC_MODEL, "prompt": "Say it: ", "echo": True, "max_tokens": 8}
    async with api_client(gateway) as c:
        whole = (await c.post(COMPL, json=body)).json()
        streamed = sse_events((await c.post(COMPL, json={**body, "stream": True})).text)
        by_ids = (await c.post(COMPL, json={**body, "prompt": ids})).json()
    assert whole["choices"][0]["text"] == "Say it: one two"
    assert whole["choices"][0]["logprobs"] is None
    assert streamed[0]["choices"][0]["text"] == "Say it: "  # the prompt first, then the output
    assert "".join(e["choices"][0]["text"] for e in streamed) == "Say it: one two"
    assert by_ids["choices"][0]["text"] == "Über den Flussone two"  # token ids: decoded
    assert whole["usage"]["completion_tokens"] == len(output)  # the prompt is not output
    assert all(r.prompt_logprobs is None for r in responder.requests)  # no logprobs asked


async def test_echo_with_logprobs_scores_the_prompt(gateway, responder, hf_tokenizer):
    """OpenAI's shape: the prompt's tokens then the output's, the first prompt token with null
    logprobs; text offsets over prompt + output. The node's prompt logprobs ride the first
    token message (the stand-in scores each prompt token at log(1/2))."""
    output = responder.default_output("one two")
    responder.script = lambda r: token_script(r, output, chunk=1)
    prompt = "Hello, wörld — ✓ says the prompt"
    prompt_ids = hf_tokenizer.encode(prompt)
    body = {"model": PUBLIC_MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
            "max_tokens": 8, "n": 2}
    async with api_client(gateway) as c:
        whole = (await c.post(COMPL, json=body)).json()
        streamed = sse_events((await c.post(COMPL, json={**body, "stream": True})).text)
    assert [r.prompt_logprobs for r in responder.requests] == [2] * 4
    for choice in whole["choices"]:
        lp, text = choice["logprobs"], choice["text"]
        assert text == prompt + "one two"
        assert len(lp["tokens"]) == len(prompt_ids) + len(output)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(
            [math.log(0.5)] * (len(prompt_ids) - 1 + len(output)))
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[len(prompt_ids)] == len(prompt)
        for token, offset in zip(lp["tokens"], offsets):
            # BOS is listed (it was scored as context) but adds no text, as in the output
            if "\ufffd" not in token and token not in hf_tokenizer.all_special_tokens:
                assert text[offset:offset + len(token)] == token
    for index in (0, 1):
        mine = [e["choices"][0] for e in streamed if e["choices"][0]["index"] == index]
        assert mine[0]["text"] == prompt
        assert mine[0]["logprobs"]["tokens"] == whole["choices"][index]["logprobs"]["tokens"][
            :len(prompt_ids)]
        merged = {key: [v for ch in mine if ch["logprobs"] for v in ch["logprobs"][key]]
                  for key in ("tokens", "token_logprobs", "text_offset")}
        assert merged == {key: whole["choices"][index]["logprobs"][key] for key in merged}


async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(
        gateway, responder, hf_tokenizer):
    """OpenAI's legacy scoring mode (lm-evaluation-harness's log-likelihood request, vLLM's
    echo without generation): the prompt and its logprobs, no output token, finish_reason
    "length". The node makes one token, which carries the prompt's logprobs back; here it is an
    EOS, whose "stop" the answer must not show either."""
    eos = hf_tokenizer.eos_token_id
    responder.script = lambda r: token_script(r, [eos], chunk=1, finish=FinishReason.STOP)
    prompt = "The capital of France is Paris"
    prompt_ids = hf_tokenizer.encode(prompt)
    body = {"model": PUBLIC_MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
            "max_tokens": 0, "temperature": 0}
    async with api_client(gateway) as c:
        whole = (await c.post(COMPL, json=body)).json()
        streamed = sse_events((await c.post(COMPL, json={**body, "stream": True})).text)
        by_ids = (await c.post(COMPL, json={**body, "prompt": [prompt_ids]})).json()
    assert [(r.max_tokens, r.prompt_logprobs) for r in responder.requests] == [(1, 1)] * 3
    for answer in (whole, by_ids):
        choice = answer["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (prompt, "length")
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(prompt_ids)
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx([math.log(0.5)] * (len(prompt_ids) - 1))
        assert answer["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                                   "total_tokens": len(prompt_ids)}
    choices = [e["choices"][0] for e in streamed]
    assert "".join(ch["text"] for ch in choices) == prompt
    assert [ch["finish_reason"] for ch in choices][-1] == "length"
    assert [t for ch in choices if ch["logprobs"] for t in ch["logprobs"]["tokens"]] == \
        whole["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # nothing to answer
    (COMPL, {"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
    (COMPL, {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    (COMPL, {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),  # chat echoes nothing
])
async def test_max_tokens_0_only_with_echo(gateway, responder, path, body, param):
    async with api_client(gateway) as c:
        resp = await c.post(path, json={"model": PUBLIC_MODEL, **body})
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param,
                                                                             "invalid_value")
    assert responder.requests == []


def _first_message_lost(output: list[int], lose_in: set[int]):
    """The node's part in chunks of two, as `r.attempt`; in the attempts in `lose_in` the first
    chunk (with the prompt's logprobs) is lost: the final message fills its tokens only."""
    def script(r):
        steps = [dataclasses.replace(s, attempt=r.attempt) if isinstance(s, TokenMessage) else s
                 for s in token_script(r, output, chunk=2)]
        return steps[1:] if r.attempt in lose_in else steps
    return script


async def test_prompt_logprobs_lost_with_the_first_message_are_asked_again(gateway, responder):
    output = responder.default_output("one two three four five six")
    responder.script = _first_message_lost(output, lose_in={0})
    async with api_client(gateway) as c:
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "a b c", "echo": True,
                                         "logprobs": 0, "max_tokens": len(output)})
    assert resp.status_code == 200, resp.text
    mine = [r for r in responder.requests if r.request_id == responder.requests[-1].request_id]
    assert [(r.attempt, r.resumed_token_ids) for r in mine] == [(0, []), (1, [])]
    assert resp.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the prompt's first


async def test_prompt_logprobs_lost_on_every_attempt_fail_the_request(gateway, responder):
    output = responder.default_output("one two three four five six")
    responder.script = _first_message_lost(output, lose_in=set(range(8)))
    async with api_client(gateway) as c:
        resp = await c.post(COMPL, json={"model": PUBLIC_MODEL, "prompt": "a b c", "echo": True,
                                         "logprobs": 0, "max_tokens": len(output)})
    assert resp.status_code == 500, resp.text
    assert "logprobs" in resp.json()["error"]["message"]


async def test_an_engine_without_prompt_logprobs_refuses_echo_with_logprobs(
        gateway, responder, openvino_model):
    body = {"model": openvino_model, "prompt": "x", "echo": True}
    async with api_client(gateway) as c:
        refused = await c.post(COMPL, json={**body, "logprobs": 0})
        served = await c.post(COMPL, json=body)  # echo alone is the gateway's own work
    error = refused.json()["error"]
    assert (refused.status_code, error["code"]) == (400, "unsupported_parameter")
    assert "'echo'" in error["message"] and "openvino" in error["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith("x")
