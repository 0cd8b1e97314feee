"""LoRA adapters on the torch engine against peft: one backbone, unmerged adapters per request.

The reference for an adapter is the base model with that adapter merged into its weights by
peft (`PeftModel.from_pretrained(...).merge_and_unload()`), generating greedily with
transformers. The engine never merges: it must produce the same tokens by adding each request's
`scale · B (A x)` to the backbone's projections, alone and in batches that mix adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.node.engines.base import SamplingParams
from services.node.engines.torch_engine import TorchEngine
from shared.adaptergen import build_adapter
from shared.modelgen import EOS, SPECIAL_TOKENS

pytestmark = pytest.mark.integration

PROMPTS = [
    "Return the value of the attribute.",
    "def main():",
    "The quick brown fox jumps over the lazy dog, then writes a parser for configuration files",
]
N = 16  # tokens generated per request
# The tiny model's EOS ids (generation_config): held back until N tokens, as min_new_tokens does.
EOS_IDS = (SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index("<|end|>"))
# name -> build_adapter keyword arguments: full-rank-8 adapters on every projection, and one of
# another rank on the attention's q and v only (peft's classic default).
ADAPTERS = {
    "a1": dict(seed=1),
    "a2": dict(seed=2),
    "a3": dict(seed=3, rank=16, alpha=8.0),
    "qv": dict(seed=4, rank=4, alpha=8.0, targets=("q_proj", "v_proj")),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(tiny_model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapter_dirs, tokenizer, device):
    """name (None: the base) -> N greedy tokens per prompt, from transformers (+ peft merged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def greedy(model) -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=device)
            gen = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                 pad_token_id=2)
            out.append(gen[0, ids.shape[1]:].tolist())
        return out

    def base_model():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True) \
            .to(device).eval()

    refs = {None: greedy(base_model())}
    for name, path in adapter_dirs.items():
        merged = PeftModel.from_pretrained(base_model(), path).merge_and_unload()
        refs[name] = greedy(merged.eval())
    return refs


def params(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=N, min_tokens=N, eos_token_ids=EOS_IDS, adapter=adapter)


def prompt_ids(tokenizer, index: int) -> list[int]:
    return tokenizer(PROMPTS[index])["input_ids"]


def run_alone(engine: TorchEngine, rid: str, ids: list[int], adapter: str | None) -> list[int]:
    engine.add_request(rid, ids, params(adapter))
    out = [engine.prefill(rid).tokens[rid]]
    while len(out) < N:
        out.append(engine.decode([rid]).tokens[rid])
    engine.release(rid)
    return out


def loaded_engine(make_engine, adapter_dirs) -> TorchEngine:
    engine = make_engine()
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    return engine


def test_adapters_change_the_output(references):
    """The reference itself: every adapter is a different function from the base and the others
    (else matching it would prove nothing)."""
    outputs = [tuple(map(tuple, out)) for out in references.values()]
    assert len(set(outputs)) == len(outputs)
    for name in ADAPTERS:
        for index in range(len(PROMPTS)):
            assert references[name][index] != references[None][index], (name, index)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_matches_merged_peft(make_engine, adapter_dirs, references,
                                                tokenizer, name):
    engine = loaded_engine(make_engine, adapter_dirs)
    for index in range(len(PROMPTS)):
        got = run_alone(engine, f"{name}-{index}", prompt_ids(tokenizer, index), name)
        assert got == references[name][index], (name, index)
    # The backbone is untouched: the base still gives the base's output afterwards.
    assert run_alone(engine, "base", prompt_ids(tokenizer, 0), None) == references[None][0]


def test_mixed_batch_gives_each_request_its_own_reference(make_engine, adapter_dirs, references,
                                                          tokenizer):
    """Every adapter and the plain base, each on every prompt, in one decode batch; requests join
    at different steps (ragged lengths), and rows of one adapter are not adjacent on input."""
    engine = loaded_engine(make_engine, adapter_dirs)
    names = [None, *ADAPTERS]
    jobs = [(f"{name}-{index}", name, index) for index in range(len(PROMPTS)) for name in names]
    outputs: dict[str, list[int]] = {}
    running: list[str] = []
    biggest = 0
    for step in range(N + 2 * len(jobs)):
        if jobs and step % 2 == 0:  # a new request joins every other step
            rid, name, index = jobs.pop(0)
            engine.add_request(rid, prompt_ids(tokenizer, index), params(name))
            outputs[rid] = [engine.prefill(rid).tokens[rid]]
            running.append(rid)
        active = [rid for rid in running if len(outputs[rid]) < N]
        biggest = max(biggest, len({engine.requests[rid].params.adapter for rid in active}))
        for rid, token in engine.decode(active).tokens.items():
            outputs[rid].append(token)
    assert biggest == len(names)  # some step ran every adapter and the base together
    assert len(outputs) == len(names) * len(PROMPTS)
    for rid, tokens in outputs.items():
        name, index = rid.rsplit("-", 1)
        name = None if name == "None" else name
        assert tokens == references[name][int(index)], rid


def test_evicted_adapter_request_resumes_on_another_engine(make_engine, adapter_dirs, references,
                                                           tokenizer):
    first = loaded_engine(make_engine, adapter_dirs)
    second = loaded_engine(make_engine, adapter_dirs)
    ids = prompt_ids(tokenizer, 2)
    first.add_request("r", ids, params("a2"))
    out = [first.prefill("r").tokens["r"]]
    for _ in range(5):
        out.append(first.decode(["r"]).tokens["r"])
    tokens = first.evict("r")
    resumed = SamplingParams(max_tokens=N - len(out), min_tokens=N - len(out),
                             eos_token_ids=EOS_IDS, adapter="a2")
    second.add_request("r", tokens[:-1], resumed)
    # Re-adding recomputes the KV of prompt + generated; the last sampled token comes out again.
    assert second.prefill("r").tokens["r"] == out[-1]
    while len(out) < N:
        out.append(second.decode(["r"]).tokens["r"])
    assert out == references["a2"][2]


def adapter_file_bytes(path: Path) -> int:
    """The bytes of an adapter's tensors as stored (float32, the tiny model's dtype)."""
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def test_memory_is_one_backbone_plus_adapter_bytes(make_engine, adapter_dirs, tiny_model_dir,
                                                   tmp_path):
    """N adapters = one backbone + N x adapter bytes: the backbone's tensors are the same
    tensors (same storage, same values) however many adapters are loaded, and the engine reports
    exactly the adapters' A/B bytes beside them."""
    engine = make_engine()
    before = engine.memory()
    params_before = {n: (p.data_ptr(), p.detach().clone()) for n, p in
                     engine.model.named_parameters()}
    per_adapter = adapter_file_bytes(adapter_dirs["a1"])
    assert per_adapter > 0
    extra = [build_adapter(tiny_model_dir, tmp_path / f"x{i}", seed=100 + i) for i in range(6)]
    for i, path in enumerate(extra):
        assert engine.load_adapter(f"x{i}", path) == per_adapter
        report = engine.memory()
        assert report.weight_bytes == before.weight_bytes
        assert report.adapter_bytes == (i + 1) * per_adapter
        assert report.kv_capacity_bytes == before.kv_capacity_bytes
    assert before.adapter_bytes == 0
    # A small fraction of the backbone: 6% on the tiny shape (rank 8 of 128/352-wide layers).
    assert per_adapter < before.weight_bytes / 10
    for name, p in engine.model.named_parameters():
        ptr, value = params_before[name]
        assert p.data_ptr() == ptr and torch.equal(p, value), name
    engine.unload_adapter("x0")
    assert engine.memory().adapter_bytes == 5 * per_adapter
    for i in range(1, 6):
        engine.unload_adapter(f"x{i}")
    assert engine.memory() == before


def test_adapter_lifecycle_and_refusals(make_engine, adapter_dirs, tokenizer, tmp_path):
    engine = make_engine()
    ids = prompt_ids(tokenizer, 0)
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("r", ids, params("a1"))
    assert "r" not in engine.requests
    engine.load_adapter("a1", adapter_dirs["a1"])
    assert engine.load_adapter("a1", adapter_dirs["a1"]) > 0  # same directory: a no-op
    engine.add_request("r", ids, params("a1"))
    with pytest.raises(ValueError, match="in flight"):
        engine.unload_adapter("a1")
    with pytest.raises(ValueError, match="in flight"):
        engine.load_adapter("a1", adapter_dirs["a2"])  # replacing it under a request
    engine.prefill("r")
    engine.release("r")
    engine.load_adapter("a1", adapter_dirs["a2"])  # now it may be replaced
    engine.unload_adapter("a1")
    engine.unload_adapter("a1")  # unknown: a no-op
    assert engine.adapters == {} and engine.memory().adapter_bytes == 0

    # Adapters the engine cannot apply exactly are refused, with the reason.
    other = tmp_path / "other-base"  # a base of another width: its adapter cannot fit
    other.mkdir()
    config = json.loads((Path(engine.model_dir) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(ValueError, match="do not fit"):
        engine.load_adapter("wrong", build_adapter(other, tmp_path / "wrong", seed=1))
    dora = build_adapter(Path(engine.model_dir), tmp_path / "dora", seed=5)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        engine.load_adapter("dora", dora)
    with pytest.raises(ValueError, match="adapter_config"):
        engine.load_adapter("none", tmp_path)
    assert engine.adapters == {}
