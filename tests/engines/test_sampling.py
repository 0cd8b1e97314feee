"""The vLLM sampling extensions (ignore_eos, min_tokens, top_k, repetition_penalty) in every
engine: their effect on the torch engine against Hugging Face on the same model, the parameter
mapping of the OpenVINO and vLLM engines, and one short real run of each of those two."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch

from services.node.engines.base import SamplingParams
from services.node.engines.torch_engine import _process_logits, _Request
from tests.engines import engine_checks as checks

PROMPT = list(range(100, 140))
N = 12


def generate(engine, params: SamplingParams, prompt: list[int] = PROMPT, rid: str = "r"
             ) -> list[int]:
    return checks.run_to_end(engine, rid, prompt, params)


def hf_greedy(hf_model, prompt: list[int], n: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt], device=hf_model.device)
    out = hf_model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def engine(make_engine):
    return make_engine(dtype="float32")


@pytest.fixture
def greedy(engine) -> list[int]:
    return checks.run_alone(engine, "greedy", PROMPT, N, SamplingParams(max_tokens=N))


# -- torch engine ---------------------------------------------------------------------------------


def test_ignore_eos_generates_max_tokens_through_a_sampled_eos(engine, greedy):
    eos = greedy[2]  # the third greedy token plays EOS
    stopped = generate(engine, SamplingParams(max_tokens=N, eos_token_ids=(eos,)))
    assert stopped == greedy[:greedy.index(eos) + 1]  # control: without ignore_eos it ends there
    ignored = generate(engine, SamplingParams(max_tokens=N, eos_token_ids=(eos,), ignore_eos=True))
    assert len(ignored) == N and ignored == greedy and eos in ignored


def test_min_tokens_holds_back_eos_as_hugging_face_does(engine, greedy, hf_model):
    eos = greedy[0]  # greedy would end at once
    assert generate(engine, SamplingParams(max_tokens=N, eos_token_ids=(eos,))) == [eos]
    held = generate(engine, SamplingParams(max_tokens=N, eos_token_ids=(eos,), min_tokens=4))
    assert eos not in held[:4] and len(held) >= 4
    reference = hf_greedy(hf_model, PROMPT, N, min_new_tokens=4, eos_token_id=eos)
    assert held == reference[:len(held)] and (held[-1] == eos or len(held) == N)


def test_min_tokens_counts_from_the_engine_request(engine, greedy):
    # After a migration the worker passes what is left of min_tokens; 0 lets EOS through at once.
    eos = greedy[0]
    assert generate(engine, SamplingParams(max_tokens=N, eos_token_ids=(eos,), min_tokens=0)) == [eos]


def test_top_k_1_equals_greedy_for_any_seed(engine, greedy):
    for seed in range(4):
        params = SamplingParams(max_tokens=N, temperature=1.5, top_k=1, seed=seed)
        assert checks.run_alone(engine, f"k1-{seed}", PROMPT, N, params) == greedy


def test_sampled_tokens_stay_in_the_top_k(engine, hf_model):
    k = 3
    params = SamplingParams(max_tokens=N, temperature=5.0, top_k=k, seed=11)  # nearly flat
    out = checks.run_alone(engine, "topk", PROMPT, N, params)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + out], device=hf_model.device)).logits[0]
    for step, token in enumerate(out):
        top = logits[len(PROMPT) - 1 + step].topk(k).indices.tolist()
        assert token in top, (step, token, top)
    unlimited = checks.run_alone(engine, "topk0", PROMPT, N, dataclasses.replace(params, top_k=0))
    assert unlimited != out  # the same draws without the limit leave the top 3 somewhere


def test_repetition_penalty_matches_hugging_face_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    tokens = [[1, 5, 5, 9, 49], [0, 2], [7, 8, 30]]
    penalties = [1.3, 0.7, 1.0]  # < 1 rewards repeats; 1 leaves the row alone
    requests = [_record(t, SamplingParams(max_tokens=1, repetition_penalty=p))
                for t, p in zip(tokens, penalties)]
    ours = _process_logits(logits.clone(), requests)
    for row, (ids, penalty) in enumerate(zip(tokens, penalties)):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[row:row + 1])
        assert torch.equal(ours[row], theirs[0]), row


def test_repetition_penalty_greedy_matches_hf_generate(engine, hf_model, greedy):
    # min_new_tokens=N in HF bans the model's EOS ids throughout: ours does the same.
    params = SamplingParams(max_tokens=N, repetition_penalty=1.8, min_tokens=N,
                            eos_token_ids=engine.eos_token_ids)
    ours = checks.run_alone(engine, "rep", PROMPT, N, params)
    assert ours == hf_greedy(hf_model, PROMPT, N, min_new_tokens=N, repetition_penalty=1.8)
    assert ours != greedy  # the penalty changed something on this prompt


def test_processing_leaves_the_model_output_alone():
    logits = torch.ones(1, 10)
    requests = [_record([1, 2], SamplingParams(max_tokens=4, repetition_penalty=2.0,
                                                    min_tokens=1, eos_token_ids=(3, 99)))]
    out = _process_logits(logits, requests)
    assert torch.equal(logits, torch.ones(1, 10))  # a copy was changed, not the input
    assert out[0, 1] == out[0, 2] == 0.5 and out[0, 3] == float("-inf") and out[0, 0] == 1


@pytest.mark.parametrize("bad", [{"top_k": -1}, {"min_tokens": -2}, {"repetition_penalty": 0.0}])
def test_engine_refuses_bad_sampling_values(engine, bad):
    with pytest.raises(ValueError, match="top_k|repetition_penalty"):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, **bad))


def _record(tokens: list[int], params: SamplingParams) -> _Request:
    """The engine's request record of a prompt `tokens`, before its first token."""
    return _Request(list(tokens), params, seed=0, prompt_len=len(tokens))


# -- OpenVINO and vLLM: the mapping (cheap) -------------------------------------------------------


def test_openvino_generation_config_mapping():
    pytest.importorskip("openvino_genai")
    from services.node.engines.openvino_engine import OpenVINOEngine

    params = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=5,
                            repetition_penalty=1.2, min_tokens=6, eos_token_ids=(2, 7))
    config = OpenVINOEngine._generation_config(None, params, seed=3, max_new=100, generated=2)
    assert (config.do_sample, config.top_k) == (True, 5)
    assert config.repetition_penalty == pytest.approx(1.2)  # a C++ float
    assert config.min_new_tokens == 4 and config.stop_token_ids == {2, 7} and config.ignore_eos
    greedy = OpenVINOEngine._generation_config(None, dataclasses.replace(params, temperature=0),
                                               seed=3, max_new=3)
    assert not greedy.do_sample and greedy.repetition_penalty == pytest.approx(1.2)
    assert greedy.min_new_tokens == 3  # never above what the submission may produce
    greedy.validate()
    config.validate()


def test_vllm_sampling_kwargs_are_accepted_by_vllm():
    from services.node.engines.vllm_engine import (_params_from_json, _params_to_json,
                                                   vllm_python, vllm_sampling_kwargs)

    params = SamplingParams(max_tokens=9, temperature=0.8, top_k=5, repetition_penalty=1.2,
                            min_tokens=6, eos_token_ids=(2, 7), ignore_eos=True, seed=1)
    assert _params_from_json(json.loads(json.dumps(_params_to_json(params)))) == params
    kwargs = vllm_sampling_kwargs(params, seed=4, generated=2, max_tokens=100)
    assert kwargs["top_k"] == 5 and kwargs["min_tokens"] == 4 and kwargs["seed"] == 4
    assert kwargs["stop_token_ids"] == []  # ignore_eos: no EOS of ours ends it in vLLM either
    greedy = vllm_sampling_kwargs(dataclasses.replace(params, temperature=0, ignore_eos=False),
                                  4, 0, 3)
    assert (greedy["top_k"], greedy["seed"], greedy["min_tokens"]) == (0, None, 3)
    assert greedy["stop_token_ids"] == [2, 7]  # what vLLM's min_tokens holds back
    done_min = vllm_sampling_kwargs(dataclasses.replace(params, ignore_eos=False), 4, 6, 100)
    assert done_min["min_tokens"] == 0 and done_min["stop_token_ids"] == []
    python = vllm_python()
    if not Path(python).exists():
        pytest.skip(".venv-vllm is not built")
    script = ("import json, sys; from vllm import SamplingParams as S; "
              "[print(repr(S(**k))) for k in json.loads(sys.argv[1])]")
    done = subprocess.run([str(python), "-c", script, json.dumps([kwargs, greedy])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "repetition_penalty=1.2" in done.stdout and "min_tokens=4" in done.stdout


# -- OpenVINO and vLLM: one short real run each, against the torch engine -------------------------


def _extensions_params(greedy: list[int]) -> SamplingParams:
    """Greedy with a penalty, and the greedy first token as an EOS held back for 3 tokens."""
    return SamplingParams(max_tokens=N, repetition_penalty=1.8, min_tokens=3,
                          eos_token_ids=(greedy[0],))


def _check_same_as_torch(other, engine, greedy) -> None:
    params = _extensions_params(greedy)
    expected = generate(engine, params, rid="torch")  # to max_tokens or the first EOS allowed
    assert greedy[0] not in expected[:3] and len(expected) > 3
    assert checks.run_alone(other, "other", PROMPT, len(expected), params) == expected


@pytest.mark.integration
@pytest.mark.slow
def test_openvino_honours_the_extensions(engine, greedy, tiny_model_dir, tmp_path):
    pytest.importorskip("openvino_genai")
    from services.node.engines.openvino_engine import OpenVINOEngine, ensure_ir

    other = OpenVINOEngine(tiny_model_dir, dtype="float32", ir_dir=ensure_ir(tiny_model_dir))
    other.load()
    try:
        _check_same_as_torch(other, engine, greedy)
    finally:
        other.unload()


@pytest.mark.integration
@pytest.mark.slow
def test_vllm_honours_the_extensions(engine, greedy, tiny_model_dir):
    from services.node.engines.vllm_engine import VllmEngine, vllm_python

    if not Path(vllm_python()).exists():
        pytest.skip(".venv-vllm is not built")
    other = VllmEngine(tiny_model_dir, dtype="float32")
    other.load()
    try:
        _check_same_as_torch(other, engine, greedy)
    finally:
        other.unload()
