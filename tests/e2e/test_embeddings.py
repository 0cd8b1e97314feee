"""POST /v1/embeddings on the real stack with the default real model (SmolLM2-135M-Instruct),
through the openai client: the placer places each input and the node runs it as a prefill with no
decode. The vectors are the model's mean-pooled, normalised last hidden states, as Hugging Face
computes them on the same directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.default_model import NAME
from tests.e2e.clients import hf_model, openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
CAT = "The cat sat on the warm windowsill and purred."
KITTEN = "A kitten was sleeping in the sun by the window."
TAXES = "Quarterly tax filings are due to the revenue office in April."


def reference(model_dir: str, text: str) -> np.ndarray:
    """Hugging Face's last hidden state of `text` (tokenized as the gateway does), mean-pooled
    and L2-normalised."""
    tokenizer, model = hf_model(model_dir)
    ids = tokenizer(text)["input_ids"]
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden.mean(dim=0)
    return (vector / vector.norm()).numpy()


def cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_one_string_and_a_batch(real_stack, real_model_dir):
    client = openai_client(real_stack, timeout=120)
    one = client.embeddings.create(model=NAME, input=CAT)
    hidden = hf_model(str(real_model_dir))[1].config.hidden_size
    (item,) = one.data
    vector = np.array(item.embedding)
    assert vector.shape == (hidden,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-4)
    expected = reference(str(real_model_dir), CAT)
    assert cosine(vector, expected) > 0.9999
    np.testing.assert_allclose(vector, expected, atol=2e-3)
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0

    batch = client.embeddings.create(model=NAME, input=[CAT, KITTEN, TAXES])
    assert [d.index for d in batch.data] == [0, 1, 2]
    cat, kitten, taxes = (np.array(d.embedding) for d in batch.data)
    np.testing.assert_allclose(cat, vector, atol=1e-5)  # the same text, the same vector
    assert cosine(cat, kitten) > cosine(cat, taxes)  # related sentences are closer
    assert batch.usage.prompt_tokens > one.usage.prompt_tokens
    floats = client.embeddings.create(model=NAME, input=CAT, encoding_format="float")
    np.testing.assert_allclose(np.array(floats.data[0].embedding), vector, atol=1e-5)
