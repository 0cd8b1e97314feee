"""The profiler on the real torch engine, and its defences against a noisy machine."""

import itertools
import math

import pytest

import services.profiler.measure as measure
from services.profiler.measure import ProfilePlan, monotone, prefill_samples
from services.profiler.run import profile_model
from shared.core.types import Hardware


def test_monotone_caps_noise_by_later_points():
    assert monotone([0.5, 0.4, 0.01, 0.02, 0.015, 0.03]) == [0.01, 0.01, 0.01, 0.015, 0.015, 0.03]
    assert monotone([1.0]) == [1.0]


@pytest.mark.integration
def test_profile_tiny_model_tables_are_sane(tmp_path, demo_model):
    model_dir = demo_model(tmp_path)
    # The LoRA cost has its own test below; here only the tables and their check, and a plan
    # without ranks records no LoRA cost.
    plan = ProfilePlan(max_len=128, max_batch=4, repeats=3, warmup=1, lora_ranks=())
    profile, check = profile_model(model_dir, "tiny", plan=plan, check_n=3)
    assert profile.lora is None
    assert profile.hardware is Hardware.CPU
    assert profile.prefill.lengths == [16, 24, 32, 48, 64, 96, 128]  # octaves and midpoints
    assert profile.decode.batch_sizes == [1, 2, 4] and profile.decode.lengths == [16, 32, 64, 128]
    assert profile.load_s > 0 and profile.kv_scale_bytes_per_s > 0
    # The check measured its random points and compared them. How well they agree is a
    # measurement of this box (bench/profile_check.py records it), not a test's to assert: a
    # parallel full run once read 15x on a point another worker's test slowed.
    assert check is not None and check.samples == 3
    assert all(math.isfinite(e) and e >= 0 for e in (check.ttft_mean_rel_error,
                                                     check.tpot_mean_rel_error))
    # The torch engine chunks: the chunk table is measured on its small grid, rising with the
    # chunk's tokens and its context, and priced by prefill_chunk_s.
    chunks = profile.chunks
    assert chunks is not None and chunks.done == [16, 64] and chunks.tokens == [8, 32, 64]
    assert all(0 < a <= b for row in chunks.seconds for a, b in zip(row, row[1:]))
    assert all(a <= b for a, b in zip(chunks.seconds[0], chunks.seconds[1]))
    assert profile.prefill_chunk_s(64, 32) == pytest.approx(chunks.seconds[1][1])


@pytest.mark.integration
def test_the_profile_records_what_unmerged_lora_costs_per_rank_on_the_real_engine(tmp_path,
                                                                                 demo_model):
    """Random adapters of each rank are loaded on the torch engine, a batch spread over them is
    timed against the same batch without them, and the overhead lands in the profile (and in
    its stored report); the adapters are gone from the engine afterwards."""
    from services.profiler.run import read_report, write_report

    model_dir = demo_model(tmp_path)
    plan = ProfilePlan(max_len=64, max_batch=4, repeats=3, warmup=1, lora_ranks=(4, 16))
    profile, _ = profile_model(model_dir, "tiny", plan=plan)
    lora = profile.lora
    assert lora is not None
    assert lora.ranks == [4, 16] and lora.batch_sizes == [1, 2, 4] and lora.adapters == 4
    assert len(lora.decode) == 2 and all(len(row) == 3 for row in lora.decode)
    assert all(v >= 0 for row in lora.decode for v in row) and min(lora.prefill) >= 0
    # Non-decreasing in the rank (a dip would be noise), and measured, not zero: the adapters'
    # extra matmuls cost the tiny model a visible share of its step.
    assert all(hi >= lo for lo, hi in zip(lora.decode[0], lora.decode[1]))
    assert max(max(row) for row in lora.decode) > 0
    assert profile.lora_decode_factor(16, 4) == pytest.approx(1 + lora.decode[1][2])
    write_report(tmp_path / "p.json", profile, None)
    assert read_report(tmp_path / "p.json").lora == lora


def test_lora_measurement_leaves_no_adapter_loaded(tmp_path, monkeypatch, demo_model):
    """The adapters it builds are unloaded even when a measurement fails."""
    model_dir = demo_model(tmp_path)
    loaded: set[str] = set()

    class Engine:
        def memory(self):
            from services.node.engines.base import MemoryReport
            return MemoryReport(0, 1 << 30, 0, 1)

        def load_adapter(self, name, path):
            loaded.add(name)
            return 1

        def unload_adapter(self, name):
            loaded.discard(name)

        def add_request(self, *args):
            raise RuntimeError("engine broke")

        def release(self, rid):
            pass

    with pytest.raises(RuntimeError, match="engine broke"):
        measure.measure_lora(Engine(), model_dir, measure._Ids(100, 0), ProfilePlan(max_batch=2))
    assert not loaded


class _FakeClockEngine:
    """Prefill takes 1 ms per 100 tokens of a fake clock; calls 3 to 8 (a neighbour's burst)
    take 10x as long."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.calls = clock, itertools.count()

    def add_request(self, *args) -> None:
        pass

    def release(self, request_id) -> None:
        pass

    def prefill(self, request_id) -> None:
        n = next(self.calls)
        self.clock[0] += self.tokens / 1e5 * (10 if 3 <= n < 9 else 1)


def test_a_burst_of_noise_is_spread_over_points_not_concentrated_on_one(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    engine = _FakeClockEngine(clock)

    class Ids(measure._Ids):
        def prompt(self, length):
            engine.tokens = length
            return [1] * length

    medians = prefill_samples(engine, Ids(100, 0), [100, 200, 400], rounds=5, warmup=0)
    # Round-robin: the burst hits at most two of each length's five samples; the medians hold.
    assert medians == pytest.approx([1e-3, 2e-3, 4e-3])
