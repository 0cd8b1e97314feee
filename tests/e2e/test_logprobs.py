"""Logprobs and OpenAI's sampling parameters through the whole stack (gateway -> placer -> node ->
torch engine -> token messages -> gateway), with the official openai client: the shapes, the
numbers against Hugging Face's own distribution, and the sampling parameters' effect."""

from __future__ import annotations

import math

import pytest
import torch

from services.gateway.tokenization import encode_chat, encode_text
from tests.e2e.clients import hf_model, openai_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]
N = 10


def _hf_first_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """Hugging Face's log-distribution of the first output token after the prompt `ids`."""
    _, model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_chat_entries(content, k: int) -> None:
    """Each entry: a probability, its k alternatives likeliest first with at most the whole
    mass, and under greedy decoding the chosen token is the likeliest, at the same logprob."""
    for entry in content:
        assert 0 < math.exp(entry.logprob) <= 1
        tops = entry.top_logprobs
        assert len(tops) == k
        values = [t.logprob for t in tops]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
        assert (tops[0].token, tops[0].bytes) == (entry.token, entry.bytes)
        assert tops[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def test_chat_logprobs_streamed_and_not_agree_with_the_model(stack, demo_model_dir):
    client = openai_client(stack)
    args = dict(model=stack.model, messages=MESSAGES, max_tokens=N, temperature=0,
                logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == N
    _check_chat_entries(content, 5)
    streamed = [t for chunk in client.chat.completions.create(**args, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    # the numbers are the model's: the first token's against Hugging Face's distribution
    tokenizer, _ = hf_model(str(demo_model_dir))
    reference = _hf_first_logprobs(demo_model_dir, encode_chat(tokenizer, MESSAGES))
    top_v, _ = reference.topk(5)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(top_v.tolist(),
                                                                          abs=1e-3)


def test_completion_logprobs_streamed_and_not(stack, demo_model_dir):
    client = openai_client(stack)
    args = dict(model=stack.model, prompt="The quick brown fox", max_tokens=N, temperature=0,
                logprobs=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob, abs=1e-6) and 3 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    tokenizer, _ = hf_model(str(demo_model_dir))
    ids = encode_text(tokenizer, "The quick brown fox")
    reference = _hf_first_logprobs(demo_model_dir, ids)
    assert lp.token_logprobs[0] == pytest.approx(reference.max().item(), abs=1e-3)
    chunks = list(client.completions.create(**args, stream=True))
    merged = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert merged == lp.tokens
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def _hf_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    """n argmax steps on Hugging Face's logits, through EOS (what ignore_eos serves)."""
    _, model = hf_model(str(model_dir))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_sampling_parameters_reach_the_engine(stack, demo_model_dir):
    """logit_bias +100 forces a token; presence and frequency penalties change a greedy output;
    a stop token id ends the output where it first appears, its text not shown."""
    client = openai_client(stack)
    prompt = "The quick brown fox"
    base = dict(model=stack.model, prompt=prompt, max_tokens=N, temperature=0, logprobs=0)
    tokenizer, _ = hf_model(str(demo_model_dir))
    greedy = _hf_greedy(demo_model_dir, encode_text(tokenizer, prompt), N)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True})
    forced = client.completions.create(**base, logit_bias={"42": 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == [tokenizer.decode([42])] * N
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True})
    assert penalised.choices[0].logprobs.tokens != plain.choices[0].logprobs.tokens
    stop = greedy[4]
    stopped = client.completions.create(**base, extra_body={"ignore_eos": True,
                                                            "stop_token_ids": [stop]})
    shown = greedy[:greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == len(shown) + 1
    assert stopped.choices[0].text == tokenizer.decode(shown, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=False)


def test_echo_scores_the_prompt_as_the_model_does(stack, demo_model_dir):
    """echo with logprobs (lm-evaluation-harness's log-likelihood request): each prompt token's
    log-probability given those before it, and its alternatives, against Hugging Face's
    log-softmax at every position; the first token has none."""
    client = openai_client(stack)
    prompt = "The quick brown fox jumps over the lazy dog"
    tokenizer, model = hf_model(str(demo_model_dir))
    ids = encode_text(tokenizer, prompt)
    whole = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1,
                                      temperature=0, logprobs=2, echo=True)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [reference[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-3)
    for i, top in enumerate(lp.top_logprobs[1:len(ids)]):  # the likeliest leads each
        assert max(top.values()) == pytest.approx(reference[i].max().item(), abs=1e-3)
    assert lp.text_offset[len(ids)] == len(prompt)
    streamed = list(client.completions.create(model=stack.model, prompt=prompt, max_tokens=1,
                                              temperature=0, logprobs=2, echo=True, stream=True))
    assert streamed[0].choices[0].text == prompt
    assert streamed[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected,
                                                                              abs=1e-3)
