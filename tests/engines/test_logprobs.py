"""Log-probabilities on the torch engine (OpenAI's logprobs / top_logprobs): the sampled token's
and the k most likely, from the model's own distribution, checked against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from services.node.engines.base import SamplingParams

PROMPT = "Return the value of the attribute."


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's next-token logits after `ids`."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def test_greedy_logprobs_and_top_match_hf(make_engine, hf_model, tokenizer):
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    engine.add_request("r", ids, SamplingParams(max_tokens=8, logprobs=3))
    step = engine.prefill("r")
    seq = list(ids)
    for _ in range(6):
        token, got = step.tokens["r"], step.logprobs["r"]
        expected = hf_logprobs(hf_model, seq)
        assert got.logprob == pytest.approx(expected[token].item(), abs=1e-3)
        top_v, top_i = expected.topk(3)
        assert [t for t, _ in got.top] == top_i.tolist()
        assert [v for _, v in got.top] == pytest.approx(top_v.tolist(), abs=1e-3)
        assert got.top[0][0] == token  # greedy picks the most likely
        seq.append(token)
        step = engine.decode(["r"])


def test_logprobs_of_a_sampled_token_are_the_models_not_the_samplers(make_engine, hf_model,
                                                                     tokenizer):
    """Temperature and penalties shape the draw, not the reported distribution (vLLM's default
    raw log-probabilities)."""
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=1.7, top_k=5, seed=3,
                            repetition_penalty=1.3, logprobs=0)
    engine.add_request("r", ids, params)
    step = engine.prefill("r")
    token, got = step.tokens["r"], step.logprobs["r"]
    assert got.top == ()
    assert got.logprob == pytest.approx(hf_logprobs(hf_model, ids)[token].item(), abs=1e-3)


def test_only_requests_that_ask_get_logprobs_in_a_batch(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    engine.add_request("plain", ids, SamplingParams(max_tokens=8))
    engine.add_request("asks", ids, SamplingParams(max_tokens=8, logprobs=2))
    assert engine.prefill("plain").logprobs == {}
    alone = engine.prefill("asks").logprobs["asks"]
    assert len(alone.top) == 2
    step = engine.decode(["plain", "asks"])
    assert set(step.logprobs) == {"asks"}
    assert step.tokens["plain"] == step.tokens["asks"]  # same prompt, both greedy


@pytest.mark.parametrize("k", [-1, 21])
def test_top_logprobs_beyond_openais_range_are_refused(make_engine, tokenizer, k):
    engine = make_engine()
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("r", tokenizer(PROMPT)["input_ids"],
                           SamplingParams(max_tokens=4, logprobs=k))


def test_prompt_logprobs_match_hf_at_every_position(make_engine, hf_model, tokenizer,
                                                    monkeypatch):
    """echo's prompt logprobs: each prompt token after the first, given those before it, and
    the k likeliest there, as Hugging Face's log-softmax says; computed in slices of positions
    (a small slice here, so the prompt spans several), and the next token as without them."""
    import services.node.engines.sampling as sampling

    monkeypatch.setattr(sampling, "PROMPT_LOGPROBS_SLICE", 3)
    engine = make_engine()
    ids = tokenizer(PROMPT)["input_ids"]
    engine.add_request("echo", ids, SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=2))
    engine.add_request("plain", ids, SamplingParams(max_tokens=4))
    step = engine.prefill("echo")
    got = step.prompt_logprobs["echo"]
    assert len(got) == len(ids) - 1
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1).cpu()
    for position, entry in enumerate(got):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[ids[position + 1]].item(), abs=1e-3)
        top_v, top_i = row.topk(2)
        assert [t for t, _ in entry.top] == top_i.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_v.tolist(), abs=1e-3)
    assert step.logprobs["echo"].logprob == pytest.approx(expected[-1].max().item(), abs=1e-3)
    plain = engine.prefill("plain")
    assert plain.prompt_logprobs == {} and plain.tokens["plain"] == step.tokens["echo"]
