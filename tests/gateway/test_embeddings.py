"""POST /v1/embeddings at the gateway: the body's checks (pure), and on the real app with a
stand-in node: each input one request that is a prefill with no decode, pooled as its model was
registered; the answer in OpenAI's shape, floats or base64; refusals by name."""

from __future__ import annotations

import base64
import dataclasses
import json

import httpx
import numpy as np
import pytest
from redis import Redis as SyncRedis

from services.gateway.embeddings import (EmbeddingBody, check_dimensions, embedding_inputs,
                                         render_vector)
from services.gateway.errors import APIError
from services.gateway.tokenization import encode_text
from services.gateway.validation import parse_body
from shared import wire
from shared.schemas import Embedding, InferenceRequest, ModelRecord
from shared.subjects import MODELS_HASH
from tests.gateway.conftest import PUBLIC_MODEL, SHORT_MODEL
from tests.gateway.responder import embedding_script, scripted_vector

integration = pytest.mark.integration


def body(**fields) -> EmbeddingBody:
    return parse_body(EmbeddingBody, json.dumps({"model": "m", **fields}).encode())


def refusal(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


# -- the body, pure -----------------------------------------------------------------------------

def test_every_input_shape_becomes_one_prompt_per_item():
    assert [(i.text, i.token_ids) for i in embedding_inputs(body(input="hi"))] == [("hi", None)]
    assert [i.text for i in embedding_inputs(body(input=["a", "b"]))] == ["a", "b"]
    assert [i.token_ids for i in embedding_inputs(body(input=[1, 2, 3]))] == [[1, 2, 3]]
    assert [i.token_ids for i in embedding_inputs(body(input=[[1], [2, 3]]))] == [[1], [2, 3]]


@pytest.mark.parametrize("value", ["", [], [""], ["a", ""], [[]], [[1], []], [-1]])
def test_empty_or_negative_inputs_are_a_400_naming_input(value):
    error = refusal(embedding_inputs, body(input=value))
    assert error.status == 400 and error.param == "input"


def test_mixed_or_wrongly_typed_inputs_are_refused_by_the_schema():
    for value in (["a", 1], [1, "a"], {"text": "a"}, [[1, "a"]], 3):
        with pytest.raises(APIError) as info:
            body(input=value)
        assert info.value.status == 400


def test_dimensions_only_for_a_matryoshka_model():
    plain = ModelRecord("m", "/x")
    check_dimensions(plain, None)
    error = refusal(check_dimensions, plain, 8)
    assert error.param == "dimensions" and error.code == "unsupported_parameter"
    assert "matryoshka" in error.message
    check_dimensions(dataclasses.replace(plain, matryoshka=True), 8)
    assert refusal(check_dimensions, dataclasses.replace(plain, matryoshka=True), 0).status == 400


def test_a_vector_is_cut_renormalised_and_encoded_as_asked():
    full = np.array([3.0, 4.0, 12.0], dtype="<f4")
    unit = full / np.linalg.norm(full)
    data = unit.astype("<f4").tobytes()
    assert render_vector(data, None, True, "float") == pytest.approx(unit.tolist())
    assert render_vector(data, 2, True, "float") == pytest.approx([0.6, 0.8])
    assert render_vector(full.tobytes(), 2, False, "float") == pytest.approx([3.0, 4.0])
    encoded = render_vector(data, None, True, "base64")
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == unit.tolist()
    assert refusal(render_vector, data, 4, True, "float").param == "dimensions"


# -- on the real app, with a stand-in node ----------------------------------------------------------

@pytest.fixture
def client(gateway):
    return httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                             timeout=20, trust_env=False)


@integration
async def test_each_input_is_a_prefill_with_no_decode(client, responder, hf_tokenizer):
    texts = ["The cat sat.", "A dog barked at the moon."]
    async with client:
        resp = await client.post("/v1/embeddings", json={"model": PUBLIC_MODEL, "input": texts,
                                                         "user": "u-1"})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    requests = sorted(responder.requests, key=lambda r: r.request_id)
    assert [r.prompt_token_ids for r in requests] == [encode_text(hf_tokenizer, t) for t in texts]
    for req in requests:
        assert req.max_tokens == 0 and req.embedding == Embedding("mean", True)
        assert req.eos_token_ids == [] and req.logprobs is None
    assert answer["object"] == "list" and answer["model"] == PUBLIC_MODEL
    assert [d["index"] for d in answer["data"]] == [0, 1]
    for d, req in zip(answer["data"], requests):
        assert d["object"] == "embedding"
        assert d["embedding"] == pytest.approx(scripted_vector(req).tolist(), abs=1e-7)
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    assert answer["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}
    assert "x-slinfer-ignored-fields" not in resp.headers  # `user` is known, and ignored


@integration
async def test_token_ids_and_base64(client, responder):
    async with client:
        resp = await client.post("/v1/embeddings", json={
            "model": PUBLIC_MODEL, "input": [5, 6, 7], "encoding_format": "base64",
            "num_ctx": 9})
    assert resp.status_code == 200, resp.text
    (req,) = responder.requests
    assert req.prompt_token_ids == [5, 6, 7]
    data = base64.b64decode(resp.json()["data"][0]["embedding"])
    assert np.frombuffer(data, dtype="<f4").tolist() == scripted_vector(req).tolist()
    assert resp.headers["x-slinfer-ignored-fields"] == "num_ctx"


@integration
async def test_the_models_pooling_rides_the_request(client, responder, redis_url, seeded_models):
    record = dataclasses.replace(seeded_models[PUBLIC_MODEL], name="tiny-last",
                                 pooling="last", normalize=False, matryoshka=True)
    r = SyncRedis.from_url(redis_url)
    r.hset(MODELS_HASH, record.name, wire.encode(record))
    r.close()
    async with client:
        resp = await client.post("/v1/embeddings", json={"model": "tiny-last", "input": "hi",
                                                         "dimensions": 3})
    assert resp.status_code == 200, resp.text
    (req,) = responder.requests
    assert req.embedding == Embedding("last", False)
    assert resp.json()["data"][0]["embedding"] == pytest.approx(scripted_vector(req)[:3].tolist())


@integration
async def test_refusals_by_name(client, responder, openvino_model):
    long_text = " ".join(["word"] * 100)
    cases = [
        ({"model": openvino_model, "input": "hi"}, "embeddings", "unsupported_parameter"),
        ({"model": PUBLIC_MODEL, "input": "hi", "dimensions": 4}, "dimensions",
         "unsupported_parameter"),
        ({"model": SHORT_MODEL, "input": ["ok", long_text]}, "input", "context_length_exceeded"),
        ({"model": PUBLIC_MODEL, "input": [[1], [10**7]]}, "input", "invalid_value"),
        ({"model": PUBLIC_MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format",
         None),
    ]
    async with client:
        for payload, param, code in cases:
            resp = await client.post("/v1/embeddings", json=payload)
            assert resp.status_code == 400, (payload, resp.text)
            error = resp.json()["error"]
            assert error["param"] == param, error
            if code is not None:
                assert error["code"] == code, error
        missing = await client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert missing.status_code == 404
    assert responder.requests == []  # nothing refused was queued


@integration
async def test_a_failed_input_fails_the_request_and_cancels_the_others(client, responder):
    def script(req: InferenceRequest) -> list:
        if req.request_id.endswith("-1"):
            return embedding_script(req, error="engine error: boom")
        return [30.0]  # the other input's node is slow: it is cancelled
    responder.script = script
    async with client:
        resp = await client.post("/v1/embeddings", json={"model": PUBLIC_MODEL,
                                                         "input": ["a", "b"]})
    assert resp.status_code == 500 and "boom" in resp.json()["error"]["message"]
    cancel = await responder.wait_cancel()
    assert cancel.request_id.endswith("-0")


@integration
async def test_a_final_message_without_its_vector_is_an_error(client, responder):
    responder.script = lambda req: embedding_script(req, vector=b"")
    async with client:
        resp = await client.post("/v1/embeddings", json={"model": PUBLIC_MODEL, "input": "a"})
    assert resp.status_code == 500
    assert "embedding was lost" in resp.json()["error"]["message"]


@integration
def test_pooling_is_chosen_at_registration(client_a, tenant_models):
    path = str(tenant_models / "tenant-a" / "tiny")
    resp = client_a.post("/admin/models", json={"name": "embedder", "path": path,
                                                "pooling": "cls", "normalize": False})
    assert resp.status_code == 201, resp.text
    record = resp.json()
    assert (record["pooling"], record["normalize"], record["matryoshka"]) == ("cls", False, False)
    bad = client_a.post("/admin/models", json={"name": "embedder2", "path": path,
                                               "pooling": "max"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pooling"
    assert client_a.delete("/admin/models/embedder").status_code == 200
