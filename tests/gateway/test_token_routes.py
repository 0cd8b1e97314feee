"""vLLM's /tokenize, /detokenize and /version on the real gateway app: the ids /tokenize gives
are the ones a completion or chat request with that prompt runs on."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.tokenization import encode_chat, encode_text
from tests.gateway.conftest import PRIVATE_A, PUBLIC_MODEL, SHORT_MODEL
from tests.gateway.responder import token_script

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_version_needs_no_key(gateway):
    resp = httpx.get(gateway.url + "/version", trust_env=False)
    assert resp.status_code == 200
    assert resp.json()["version"].count(".") >= 1


def test_tokenize_a_prompt_as_a_completion_would(client_a, hf_tokenizer):
    prompt = "Once upon a time, wörld"
    resp = client_a.post("/tokenize", json={"model": PUBLIC_MODEL, "prompt": prompt})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == encode_text(hf_tokenizer, prompt)
    assert body["tokens"][0] == hf_tokenizer.bos_token_id
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] is None
    resp = client_a.post("/tokenize", json={"model": SHORT_MODEL, "prompt": prompt,
                                            "add_special_tokens": False,
                                            "return_token_strs": True})
    body = resp.json()
    assert body["tokens"] == encode_text(hf_tokenizer, prompt)[1:]
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == 64


async def test_tokenize_messages_counts_what_the_chat_request_uses(gateway, responder,
                                                                   hf_tokenizer):
    responder.script = lambda r: token_script(r, responder.default_output("ok"))
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                                 timeout=20, trust_env=False) as client:
        counted = (await client.post("/tokenize", json={"model": PUBLIC_MODEL,
                                                        "messages": MESSAGES})).json()
        chat = await client.post("/v1/chat/completions", json={
            "model": PUBLIC_MODEL, "messages": MESSAGES, "max_tokens": 4})
    assert counted["tokens"] == encode_chat(hf_tokenizer, MESSAGES)
    assert counted["tokens"] == responder.requests[0].prompt_token_ids
    assert counted["count"] == chat.json()["usage"]["prompt_tokens"]


def test_detokenize_gives_the_text_back(client_a, hf_tokenizer):
    text = "Hello, wörld — ✓"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    resp = client_a.post("/detokenize", json={"model": PUBLIC_MODEL, "tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": PUBLIC_MODEL}, 400, "prompt"),
    ("/tokenize", {"model": PUBLIC_MODEL, "prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": PUBLIC_MODEL, "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": PRIVATE_A, "prompt": "x"}, 404, "model"),  # tenant-a's, not b's
    ("/detokenize", {"model": PUBLIC_MODEL, "tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"model": PUBLIC_MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": PUBLIC_MODEL, "tokens": ["a"]}, 400, "tokens[0]"),
])
def test_bad_requests_are_named(client_b, path, body, status, param):
    resp = client_b.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_key_is_needed(gateway):
    resp = httpx.post(gateway.url + "/tokenize", json={"model": PUBLIC_MODEL, "prompt": "x"},
                      trust_env=False)
    assert resp.status_code == 401
