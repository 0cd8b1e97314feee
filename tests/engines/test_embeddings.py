"""Embedding requests on the torch engine (POST /v1/embeddings): the prefill's last hidden states
pooled into a vector instead of a token, checked against Hugging Face's own forward pass; the
engines that cannot compute them refuse them by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.node.engines.base import RequestBook, SamplingParams
from shared.engine_features import ENGINE_FEATURES
from shared.schemas import Embedding

PROMPT = "Return the value of the attribute."


def hf_hidden(hf_model, ids: list[int]) -> np.ndarray:
    """Hugging Face's last hidden state (after the final norm) [positions, hidden]."""
    with torch.inference_mode():
        out = hf_model.model(torch.tensor([ids], device=hf_model.device))
    return out.last_hidden_state[0].float().cpu().numpy()


def embed(engine, ids: list[int], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
    engine.add_request("e", ids, SamplingParams(max_tokens=0,
                                                embedding=Embedding(pooling, normalize)))
    step = engine.prefill("e")
    assert step.tokens == {} and set(step.embeddings) == {"e"}  # no token: not a generation
    engine.release("e")
    return np.frombuffer(step.embeddings["e"], dtype="<f4")


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooled_hidden_states_match_hf(make_engine, hf_model, tokenizer, pooling):
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    hidden = hf_hidden(hf_model, ids)
    expected = {"mean": hidden.mean(axis=0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    raw = embed(engine, ids, pooling, normalize=False)
    assert raw.shape == (hf_model.config.hidden_size,)
    np.testing.assert_allclose(raw, expected, rtol=1e-3, atol=1e-4)
    unit = embed(engine, ids, pooling)
    assert np.linalg.norm(unit) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(unit, expected / np.linalg.norm(expected), atol=1e-4)


def test_its_kv_is_freed_on_release_and_generations_beside_it_run_on(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    engine.add_request("g", ids, SamplingParams(max_tokens=4))
    first = engine.prefill("g").tokens["g"]
    used = engine.cache.used_blocks
    embed(engine, ids)
    assert engine.cache.used_blocks == used  # the embedding's blocks went back
    assert engine.decode(["g"]).tokens["g"] >= 0 and first >= 0


def test_an_embedding_request_asks_for_no_output(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    for params in (SamplingParams(max_tokens=1, embedding=Embedding()),
                   SamplingParams(max_tokens=0, embedding=Embedding("max")),
                   SamplingParams(max_tokens=0, logprobs=1, embedding=Embedding())):
        with pytest.raises(ValueError, match="embedding request"):
            engine.add_request("e", ids, params)


@pytest.mark.parametrize("engine_name", ["openvino", "vllm"])
def test_engines_without_the_feature_refuse_it_by_name(engine_name):
    book = RequestBook()
    book.requests, book.features, book.name = {}, ENGINE_FEATURES[engine_name], engine_name
    params = SamplingParams(max_tokens=0, embedding=Embedding())
    with pytest.raises(ValueError, match=f"embeddings not served by the {engine_name} engine"):
        book.check_new("e", [1, 2, 3], params, max_context=64, vocab_size=100)
