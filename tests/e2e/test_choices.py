"""`n` choices through the whole stack (gateway -> placer -> node -> torch engine): each choice a
request of its own, sampled with the request's seed + its index, so the choices differ and the
same request again gives the same ones, streamed or not."""

from __future__ import annotations

import pytest

from tests.e2e.clients import openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 8  # output tokens per choice


def test_seeded_choices_differ_and_repeat(stack):
    client = openai_client(stack)
    args = dict(model=stack.model, prompt="Once upon a time", max_tokens=N, temperature=1.0,
                seed=1234, n=3, extra_body={"ignore_eos": True})
    first = client.completions.create(**args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # seed, seed + 1, seed + 2: different draws
    assert first.usage.completion_tokens == 3 * N
    again = client.completions.create(**args)
    assert [c.text for c in again.choices] == texts
    streamed = ["", "", ""]
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
