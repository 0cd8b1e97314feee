"""OpenAI's sampling parameters on the torch engine: presence and frequency penalties, logit_bias,
vLLM's min_p. The pure processors (services/node/engines/sampling.py) on hand-made logits, then
their effect on the tiny model against a step-by-step reference written independently here, and
which engines refuse what (shared/engine_features.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from services.node.engines import DEFAULT_ENGINES
from services.node.engines.base import RequestBook, SamplingParams
from services.node.engines.sampling import add_logit_bias, keep_min_p, penalize_output
from services.node.engines.torch_engine import _process_logits, _Request
from shared.engine_features import ALL_FEATURES, ENGINE_FEATURES, unsupported
from tests.engines import engine_checks as checks

PROMPT = list(range(100, 140))
N = 12

# -- the processors on hand-made logits -------------------------------------------------------------


def test_logit_bias_adds_to_the_named_tokens_only():
    logits = torch.zeros(6)
    add_logit_bias(logits, ((1, 2.5), (4, -100.0)))
    assert logits.tolist() == [0, 2.5, 0, 0, -100, 0]


def test_presence_counts_a_token_once_frequency_per_occurrence():
    logits = torch.zeros(5)
    penalize_output(logits, [1, 1, 1, 3], presence=0.5, frequency=0.25)
    assert logits.tolist() == pytest.approx([0, -(0.5 + 3 * 0.25), 0, -(0.5 + 0.25), 0])


def test_negative_penalties_reward_repeats_and_zero_changes_nothing():
    logits = torch.full((4,), 1.0)
    penalize_output(logits, [2, 2], presence=-1.0, frequency=-0.5)
    assert logits.tolist() == [1, 1, 3, 1]
    untouched = torch.full((4,), 1.0)
    penalize_output(untouched, [0, 1, 2], presence=0.0, frequency=0.0)
    assert untouched.tolist() == [1, 1, 1, 1]


def test_min_p_drops_tokens_below_its_share_of_the_likeliest_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    kept = keep_min_p(probs, torch.tensor([0.4, 1.0]))
    # row 0: floor 0.2 keeps 0.5 and 0.3; row 1: all tie with the likeliest, so all stay
    assert kept[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert kept[1].tolist() == pytest.approx([0.25] * 4)
    assert torch.equal(keep_min_p(probs, torch.zeros(2)), probs / probs.sum(-1, keepdim=True))


def test_penalties_count_the_output_not_the_prompt():
    """A token the prompt holds is not penalised until the model generates it; an output token
    carried over from before a migration (prior_output) counts as output."""
    params = SamplingParams(max_tokens=8, presence_penalty=1.0, frequency_penalty=0.5)
    fresh = _Request([3, 3, 5], params, seed=0, prompt_len=3)
    resumed = _Request([3, 3, 5], dataclasses.replace(params, prior_output=1), seed=0,
                       prompt_len=2)
    out = _process_logits(torch.zeros(2, 8), [fresh, resumed])
    assert out[0].tolist() == [0] * 8
    assert out[1].tolist() == [0, 0, 0, 0, 0, -1.5, 0, 0]


def test_processors_run_in_vllms_order_and_leave_the_input_alone():
    logits = torch.zeros(1, 6)
    params = SamplingParams(max_tokens=8, logit_bias=((2, 4.0), (5, 9.0)), min_tokens=2,
                            eos_token_ids=(5,), repetition_penalty=2.0, frequency_penalty=1.0)
    request = _Request([2, 2], params, seed=0, prompt_len=1)  # one prompt token, one output
    out = _process_logits(logits, [request])
    assert torch.equal(logits, torch.zeros(1, 6))
    # token 2: bias 4, repetition penalty /2 -> 2, one output occurrence -> 1; 5: EOS held back
    assert out[0].tolist() == [0, 0, 1.0, 0, 0, float("-inf")]


# -- on the model ------------------------------------------------------------------------------------


@pytest.fixture
def engine(make_engine):
    return make_engine(dtype="float32")


def reference_greedy(hf_model, prompt: list[int], n: int, presence: float, frequency: float,
                     bias: dict[int, float]) -> list[int]:
    """Greedy decoding with OpenAI's penalties and logit_bias, by hand on Hugging Face logits."""
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([seq], device=hf_model.device)).logits[0, -1]
        scores = logits.float().cpu().tolist()
        for token, b in bias.items():
            scores[token] += b
        for token in set(out):
            scores[token] -= presence + frequency * out.count(token)
        best = max(range(len(scores)), key=scores.__getitem__)
        out.append(best)
        seq.append(best)
    return out


def test_penalties_and_bias_match_a_reference_on_the_model(engine, hf_model):
    bias = {7: 3.0, 8: -100.0}
    params = SamplingParams(max_tokens=N, presence_penalty=0.8, frequency_penalty=0.6,
                            logit_bias=tuple(bias.items()))
    ours = checks.run_alone(engine, "pen", PROMPT, N, params)
    assert ours == reference_greedy(hf_model, PROMPT, N, 0.8, 0.6, bias)
    plain = checks.run_alone(engine, "plain", PROMPT, N, SamplingParams(max_tokens=N))
    assert ours != plain  # they changed something on this prompt


def test_a_large_logit_bias_forces_a_token_and_bans_another(engine):
    plain = checks.run_alone(engine, "plain", PROMPT, N, SamplingParams(max_tokens=N))
    forced = checks.run_alone(engine, "forced", PROMPT, N,
                              SamplingParams(max_tokens=N, logit_bias=((42, 100.0),)))
    assert forced == [42] * N
    banned = checks.run_alone(engine, "banned", PROMPT, N,
                              SamplingParams(max_tokens=N, logit_bias=((plain[0], -100.0),)))
    assert plain[0] not in banned


def test_min_p_one_samples_the_likeliest_token_for_any_seed(engine):
    greedy = checks.run_alone(engine, "greedy", PROMPT, N, SamplingParams(max_tokens=N))
    for seed in range(3):
        params = SamplingParams(max_tokens=N, temperature=1.5, min_p=1.0, seed=seed)
        assert checks.run_alone(engine, f"minp-{seed}", PROMPT, N, params) == greedy


def test_min_p_narrows_but_does_not_fix_a_draw(engine):
    """A small min_p leaves several tokens in play (different seeds give different outputs), and
    the ones it drops are never drawn: each token is at least min_p times the likeliest."""
    params = SamplingParams(max_tokens=N, temperature=1.0, min_p=0.3, logprobs=1)
    outputs = set()
    for seed in range(6):
        p = dataclasses.replace(params, seed=seed)
        engine.add_request("r", PROMPT, p)
        step, tokens = engine.prefill("r"), []
        for _ in range(N):
            lp = step.logprobs["r"]
            assert lp.logprob >= lp.top[0][1] + math.log(0.3) - 1e-4  # temperature 1: raw = drawn
            tokens.append(step.tokens["r"])
            step = engine.decode(["r"])
        engine.release("r")
        outputs.add(tuple(tokens))
    assert len(outputs) > 1


def test_a_resumed_request_continues_its_penalised_output_exactly(engine):
    """Evicted and re-added with its output as prior_output (what the node does on a migration),
    a penalised request goes on as if it had never moved."""
    params = SamplingParams(max_tokens=N, presence_penalty=1.2, frequency_penalty=0.7)
    whole = checks.run_alone(engine, "whole", PROMPT, N, params)
    engine.add_request("m", PROMPT, params)
    first = [engine.prefill("m").tokens["m"]]
    first += [engine.decode(["m"]).tokens["m"] for _ in range(4)]
    tokens = engine.evict("m")
    moved = dataclasses.replace(params, max_tokens=N - len(first), prior_output=len(first))
    rest = checks.run_alone(engine, "m", tokens, N - len(first), moved)
    assert first + rest == whole


# -- who honours what --------------------------------------------------------------------------------


class _Bare(RequestBook):
    name = "bare"

    def __init__(self) -> None:
        self.requests = {}


@pytest.mark.parametrize(("params", "named"), [
    (SamplingParams(max_tokens=4, logprobs=1), "logprobs"),
    (SamplingParams(max_tokens=4, presence_penalty=0.5, min_p=0.1), "presence_penalty, min_p"),
    (SamplingParams(max_tokens=4, logit_bias=((1, 1.0),)), "logit_bias"),
    (SamplingParams(max_tokens=4, prompt_logprobs=0), "echo"),
])
def test_an_engine_without_a_feature_refuses_it_by_name(params, named):
    with pytest.raises(ValueError, match=f"{named} not served by the bare engine"):
        _Bare().check_new("r", [1, 2], params, max_context=64, vocab_size=100)
    _Bare().check_new("r", [1, 2], SamplingParams(max_tokens=4), max_context=64, vocab_size=100)


@pytest.mark.parametrize(("bad", "match"), [
    ({"min_p": 1.5}, "min_p"), ({"logit_bias": ((2048, 1.0),)}, "logit_bias"),
    ({"prior_output": 99}, "prior_output"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_the_torch_engine_refuses_out_of_range_values(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, **bad))


def test_auto_honours_what_every_default_engine_honours():
    common = frozenset.intersection(*(ENGINE_FEATURES[e] for e in DEFAULT_ENGINES.values()))
    assert ENGINE_FEATURES["auto"] == common
    assert unsupported("torch", sorted(ALL_FEATURES)) == []
    assert unsupported("openvino", ["logprobs", "min_p", "echo"]) == ["logprobs", "min_p", "echo"]
    assert unsupported("no-such-engine", ["logit_bias"]) == ["logit_bias"]
