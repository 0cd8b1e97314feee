"""`slinfer up`'s default model on the real stack (gateway, placer, node worker as processes),
asked the way applications ask: the plain openai client with no max_tokens, and a field the
gateway does not know (OpenWebUI's num_ctx)."""

from __future__ import annotations

import pytest

from shared.default_model import NAME
from tests.e2e.clients import openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_chat_without_max_tokens_answers_and_stops_by_itself(real_stack):
    raw = openai_client(real_stack, timeout=120).chat.completions.with_raw_response.create(
        model=NAME, messages=QUESTION, temperature=0, extra_body={"num_ctx": 4096})
    assert raw.headers["x-slinfer-ignored-fields"] == "num_ctx"
    resp = raw.parse()
    choice = resp.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # EOS, not a 256-token cut
    assert resp.usage.completion_tokens < 64


def test_a_streamed_answer(real_stack):
    chunks = list(openai_client(real_stack, timeout=120).chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert "Paris" in text and finish == ["stop"], (text, finish)
