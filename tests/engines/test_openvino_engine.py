"""OpenVINO engine (OpenVINO GenAI ContinuousBatchingPipeline) against HF generate in float32:
conversion and its cache, greedy equality, batching, resize by rebuild, evict/resume, KVCacheFull,
memory accounting. Runs for real: needs openvino-genai here and the exporter's .venv-openvino
(both made by `make install`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.node.engines import Engine, create_engine
from services.node.engines.openvino_engine import (BLOCK_SIZE, IR_MARKER, OpenVINOEngine,
                                                   ensure_ir, main)
from tests.engines import engine_checks as checks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ir_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A real conversion with optimum-intel into a fresh directory, once per module."""
    return ensure_ir(tiny_model_dir, tmp_path_factory.mktemp("ov-ir") / "tiny")


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    return checks.hf_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def make(tiny_model_dir: Path, ir_dir: Path):
    yield from checks.engine_factory(lambda **kwargs: OpenVINOEngine(
        tiny_model_dir, **{"dtype": "float32", "ir_dir": ir_dir, **kwargs}))


@pytest.fixture(scope="module")
def engine(make) -> OpenVINOEngine:
    return make()


def test_conversion_is_cached_and_has_a_cli(tiny_model_dir, ir_dir, capsys):
    assert (ir_dir / "openvino_model.xml").exists() and (ir_dir / IR_MARKER).exists()
    started = time.perf_counter()
    assert ensure_ir(tiny_model_dir, ir_dir) == ir_dir  # the marker's key matches: no export
    assert time.perf_counter() - started < 5
    assert main(["--model", str(tiny_model_dir), "--out", str(ir_dir)]) == 0
    assert capsys.readouterr().out.strip().endswith(str(ir_dir))
    assert main(["--model", str(ir_dir.parent / "missing")]) == 2


def test_protocol_and_factory(tiny_model_dir):
    engine = create_engine("openvino", tiny_model_dir)
    assert isinstance(engine, Engine) and engine.name == "openvino"
    with pytest.raises(RuntimeError, match="load"):
        engine.memory()
    with pytest.raises(ValueError):
        create_engine("openvino", tiny_model_dir, device="cuda")


def test_block_size_and_memory_match_the_pipeline(engine, tiny_model_dir):
    """The engine's own block accounting (BLOCK_SIZE tokens per block) agrees with the usage the
    pipeline reports after a step."""
    per_token = checks.per_token_f32(tiny_model_dir)
    assert engine.block_bytes == BLOCK_SIZE * per_token
    for n, blocks in ((BLOCK_SIZE, 1), (BLOCK_SIZE + 1, 2)):
        engine.add_request("p", list(range(3, 3 + n)), checks.GREEDY)
        engine.prefill("p")
        usage = engine.pipe.get_metrics().cache_usage  # percent of the pool, as scheduled
        assert round(usage * engine.num_blocks / 100) == blocks
        assert engine.memory().kv_used_bytes == blocks * engine.block_bytes
        engine.release("p")
    checks.check_memory(engine, per_token, BLOCK_SIZE)


def test_greedy_matches_hf_generate(engine, expected):
    checks.check_greedy(engine, expected)


def test_batching_with_joins_and_a_subset_decode(engine, expected):
    checks.check_batching(engine, expected)


def test_resize_by_rebuild_mid_generation(make, expected):
    engine = make()
    rebuilds = checks.check_resize(engine, engine.block_bytes, expected)
    assert all(r["build_s"] > 0 and r["recomputed_tokens"] > 0 for r in rebuilds)


def test_shrink_below_the_recompute_raises_and_keeps_state(engine, expected):
    checks.check_shrink_refused(engine, engine.block_bytes, expected[1])


def test_evict_and_resume_on_second_engine(engine, make, expected):
    checks.check_evict_and_resume(engine, make(), expected[0])


def test_kv_cache_full_prefill_and_decode(make):
    engine = make(kv_capacity_bytes=3 * BLOCK_SIZE * 2048 + 100)  # rounds down to 3 blocks
    checks.check_kv_full(engine, BLOCK_SIZE)


def test_validation(engine):
    checks.check_validation(engine)


def test_seeded_sampling_is_reproducible(engine):
    checks.check_seeded_sampling(engine)


def test_default_precision_runs_with_a_smaller_kv_cache(tiny_model_dir, ir_dir, engine):
    """dtype=None keeps the plugin's defaults (bf16 compute and a compressed KV cache on CPUs that
    have them); outputs are not compared with f32 there, only that it serves."""
    default = OpenVINOEngine(tiny_model_dir, ir_dir=ir_dir)
    default.load()
    try:
        assert default.memory().kv_bytes_per_token <= engine.memory().kv_bytes_per_token
        out = checks.run_alone(default, "d", checks.PROMPTS[0], 8)
        assert len(out) == 8 and all(0 <= t < 2048 for t in out)
    finally:
        default.unload()


def test_compiled_model_cache_is_written_then_used(tiny_model_dir, ir_dir, expected):
    """The first build compiles and writes OpenVINO's cache beside the IR; a fresh engine then
    imports it (warm) and still produces the reference tokens."""
    import shutil

    shutil.rmtree(ir_dir / "compiled", ignore_errors=True)
    cold = OpenVINOEngine(tiny_model_dir, dtype="float32", ir_dir=ir_dir)
    cold.load()
    cold.unload()
    assert not cold.load_info["compile_cache_warm"]
    assert list((ir_dir / "compiled").glob("*.blob"))
    warm = OpenVINOEngine(tiny_model_dir, dtype="float32", ir_dir=ir_dir)
    warm.load()
    try:
        assert warm.load_info["compile_cache_warm"] and warm.load_info["build_s"]
        assert checks.run_alone(warm, "w", checks.PROMPTS[0], checks.N_TOKENS) == expected[0]
    finally:
        warm.unload()
    off = OpenVINOEngine(tiny_model_dir, dtype="float32", ir_dir=ir_dir, compile_cache=False)
    assert "CACHE_DIR" not in off._properties()
