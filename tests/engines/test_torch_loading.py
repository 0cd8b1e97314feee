"""The torch engine's weights through the node loader, the Qwen2 architecture, and the grouped
decode gather (real engines, tiny shapes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.node.engines import create_engine
from services.node.engines.base import SamplingParams
from services.node.engines.torch_engine import TorchEngine
from services.node.engines.torch_kernel import Workspace, plan_groups
from services.node.loader import CheckpointLoader, LoaderSettings, convert_checkpoint
from shared.modelgen import ensure_model

GREEDY = SamplingParams(max_tokens=64)
PROMPTS = [list(range(5, 12)), list(range(100, 160)), [7, 9, 7], list(range(300, 333))]


def run_alone(engine, rid: str, ids: list[int], n: int) -> list[int]:
    engine.add_request(rid, ids, GREEDY)
    out = [engine.prefill(rid).tokens[rid]]
    while len(out) < n:
        out.append(engine.decode([rid]).tokens[rid])
    engine.release(rid)
    return out


def hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.fixture
def converted_tiny(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model with a converted checkpoint (the session's model stays HF-only)."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model_dir, model)
    convert_checkpoint(model)
    return model


@pytest.mark.integration
def test_loader_weights_equal_hf_weights_and_outputs(converted_tiny, tiny_model_dir):
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    via_loader = create_engine("torch", converted_tiny, loader=loader)
    via_hf = TorchEngine(tiny_model_dir)
    via_loader.load()
    via_hf.load()
    try:
        assert via_loader.load_info["source"] == "loader"
        assert via_loader.load_info["tier"] == "registry"
        assert via_hf.load_info["source"] == "hf"
        hf_state = via_hf.model.state_dict()
        assert set(via_loader.model.state_dict()) == set(hf_state)
        for name, tensor in via_loader.model.state_dict().items():
            assert torch.equal(tensor, hf_state[name]), name
        for name, buffer in via_hf.model.named_buffers():  # rotary frequencies rebuilt
            assert torch.equal(dict(via_loader.model.named_buffers())[name], buffer), name
        assert via_loader.model.lm_head.weight is via_loader.model.model.embed_tokens.weight \
            or not via_loader.config.tie_word_embeddings
        assert via_loader.memory() == via_hf.memory()
        assert via_loader.eos_token_ids == via_hf.eos_token_ids
        for i, ids in enumerate(PROMPTS[:2]):
            assert run_alone(via_loader, f"l{i}", ids, 16) == hf_greedy(tiny_model_dir, ids, 16)
        # A second instance of the model on the node is a DRAM hit.
        second = create_engine("torch", converted_tiny, loader=loader)
        second.load()
        assert second.load_info["tier"] == "dram"
        second.unload()
    finally:
        via_loader.unload()
        via_hf.unload()
        loader.close()


@pytest.mark.integration
def test_loader_path_converts_dtype_on_request(converted_tiny):
    engine = TorchEngine(converted_tiny, dtype="bfloat16")
    engine.load()
    try:
        assert engine.load_info["source"] == "loader"
        assert engine.dtype == torch.bfloat16
        assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
        assert len(run_alone(engine, "b", PROMPTS[0], 4)) == 4
    finally:
        engine.unload()


@pytest.mark.integration
def test_qwen2_architecture_matches_hf_generate(data_dir):
    """q/k/v biases and Qwen2's rotary module, through both weight paths."""
    model = ensure_model(data_dir, "tiny-qwen2", "tiny-qwen2")
    expected = [hf_greedy(model, ids, 16) for ids in PROMPTS[:2]]
    engine = TorchEngine(model)
    engine.load()
    try:
        assert [run_alone(engine, f"q{i}", ids, 16) for i, ids in enumerate(PROMPTS[:2])] \
            == expected
    finally:
        engine.unload()
    converted = data_dir / "tiny-qwen2-converted"
    shutil.copytree(model, converted, dirs_exist_ok=True)
    convert_checkpoint(converted)
    engine = TorchEngine(converted)
    engine.load()
    try:
        assert engine.load_info["source"] == "loader"
        assert run_alone(engine, "c", PROMPTS[0], 16) == expected[0]
    finally:
        engine.unload()


def test_plan_groups_bounds_padding_and_keeps_every_row():
    widths = [1, 9, 2, 9, 513, 3]
    groups = plan_groups(widths, budget_blocks=40)
    assert sorted(i for g in groups for i in g) == list(range(len(widths)))
    for group in groups:
        widest = max(widths[i] for i in group)
        assert len(group) * widest <= 40 or len(group) == 1
    assert [4] in groups  # the long row alone
    assert plan_groups(widths, budget_blocks=10**6) == [[0, 2, 5, 1, 3, 4]]  # one group, sorted
    assert plan_groups([], 10) == []


def test_decode_in_several_gather_groups_matches_each_alone(make_engine):
    """A workspace budget of a few blocks forces one gather group per request or two; the batch
    must still produce exactly the tokens each request produces alone."""
    engine = make_engine()
    alone = [run_alone(engine, f"a{i}", ids, 12) for i, ids in enumerate(PROMPTS)]
    engine._workspace = Workspace(engine.cache, 6 * 2 * engine.cache.layer_block_bytes)
    out = {}
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"b{i}", ids, GREEDY)
        out[f"b{i}"] = [engine.prefill(f"b{i}").tokens[f"b{i}"]]
    while len(out["b0"]) < 12:
        for rid, token in engine.decode(list(out)).tokens.items():
            out[rid].append(token)
    assert [out[f"b{i}"] for i in range(len(PROMPTS))] == alone
    # The widest request (60 tokens: 4-5 blocks of 16) fits the budget alone; the workspace
    # never grew past the budget.
    assert engine._workspace.nbytes <= 6 * 2 * engine.cache.layer_block_bytes


@pytest.mark.integration
def test_auto_engine_is_the_device_default(tiny_model_dir):
    from services.node.engines import DEFAULT_ENGINES, default_engine, resolve_engine

    assert resolve_engine("auto", "cpu") == DEFAULT_ENGINES["cpu"] == default_engine("cpu")
    assert resolve_engine("auto", "cuda:1") == DEFAULT_ENGINES["cuda"]
    assert resolve_engine("openvino", "cpu") == "openvino"
    assert create_engine("auto", tiny_model_dir).name == DEFAULT_ENGINES["cpu"]
    with pytest.raises(ValueError):
        default_engine("tpu")
