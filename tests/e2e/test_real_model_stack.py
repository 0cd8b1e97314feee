"""`slinfer up`'s default model on the real stack (gateway, placer, node worker as processes),
asked the way applications ask: the plain openai client with no max_tokens, a field the gateway
does not know (OpenWebUI's num_ctx), and lm-evaluation-harness's log-likelihood requests."""

from __future__ import annotations

import pytest
import torch

from shared.default_model import NAME
from tests.e2e.clients import hf_model, openai_client

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


CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = (" Paris", " Berlin", " Madrid", " Rome")


def test_log_likelihoods_as_lm_eval_asks_for_them(real_stack, real_model_dir):
    """lm-evaluation-harness's `local-completions` scores a choice with the context and the
    choice as token ids, echo, logprobs 1 and max_tokens 1, and sums token_logprobs[ctxlen:-1]
    (the generated token left out); OpenAI's legacy scoring asks with max_tokens 0 and gets no
    generated token. Both sums are Hugging Face's, and the right capital is the likeliest."""
    tokenizer, model = hf_model(str(real_model_dir))
    client = openai_client(real_stack, timeout=120)
    ctx = tokenizer(CONTEXT, add_special_tokens=False).input_ids
    sums = {}
    for choice in CHOICES:
        ids = ctx + tokenizer(choice, add_special_tokens=False).input_ids
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = sum(reference[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
        asked = dict(model=NAME, prompt=[ids], echo=True, logprobs=1, temperature=0, seed=1234)
        lm_eval = client.completions.create(**asked, max_tokens=1).choices[0]
        assert len(lm_eval.logprobs.token_logprobs) == len(ids) + 1
        sums[choice] = sum(lm_eval.logprobs.token_logprobs[len(ctx):-1])
        assert sums[choice] == pytest.approx(expected, abs=1e-3)
        scored = client.completions.create(**asked, max_tokens=0)
        assert (scored.choices[0].finish_reason, scored.usage.completion_tokens) == ("length", 0)
        assert scored.choices[0].text == tokenizer.decode(ids)
        assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
            lm_eval.logprobs.token_logprobs[1:len(ids)], abs=1e-4)
    assert max(sums, key=sums.__getitem__) == " Paris", sums
