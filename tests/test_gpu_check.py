"""bench/gpu/check.py, the GPU check, in its CPU mode (tiny shapes): every part runs and records
what the GPU run will record, so the script cannot rot between the rare GPU loans. The stack
part is left out here (the suite starts whole stacks elsewhere); the bound arithmetic is checked
on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.bounds import ModelCost

ROOT = Path(__file__).resolve().parents[1]


def test_a_decode_bound_counts_the_weights_once_and_every_requests_cache():
    cost = ModelCost(weight_bytes=2_000, kv_bytes_per_token=10, matmul_params=900, layers=2,
                     hidden=4)
    # (2,000 + 4 requests x 50 tokens x 10 bytes) / 1,000 bytes/s
    assert cost.decode_bound_s(batch=4, context=50, bytes_per_s=1_000) == pytest.approx(4.0)
    # 2 x 900 x 8 + 2 x 2 layers x 64 x 4
    assert cost.prefill_flops(8) == pytest.approx(14_400 + 1_024)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    work = tmp_path_factory.mktemp("gpu-check-work")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/check.py"), "--device", "cpu", "--out", str(out),
         "--work", str(work), "--parts", "parity,speed,kv_resize,profile,loader"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (out / "gpu_check.log").read_text()  # the log travels back with the results
    return json.loads((out / "gpu_check.json").read_text())


def test_every_part_runs_and_passes_on_the_cpu(report):
    parts = report["parts"]
    assert set(parts) == {"parity", "speed", "kv_resize", "profile", "loader"}
    assert {name: p["ok"] for name, p in parts.items()} == dict.fromkeys(parts, True)


def test_the_engine_matches_generate_and_keeps_tokens_across_resizes(report):
    parity = report["parts"]["parity"]["result"]
    assert parity["float32"]["all_equal"]
    resize = report["parts"]["kv_resize"]["result"]
    assert resize["tokens_kept"]
    sizes = [(r["from_bytes"], r["to_bytes"]) for r in resize["resizes"]]
    start = resize["start_bytes"]
    assert [t / start for _, t in sizes] == pytest.approx([2, 1, 0.5], rel=0.05)


def test_speed_and_loader_figures_are_against_their_yardsticks(report):
    speed = report["parts"]["speed"]["result"]
    for row in speed["decode"].values():
        assert row["step_s"] > 0 and row["x_bound"] > 0
    assert 0 < speed["prefill"]["fraction_of_matmul_rate"]
    loader = report["parts"]["loader"]["result"]
    assert loader["warm"]["slinfer_loader_tier"] == "dram"
    assert loader["cold"]["slinfer_loader_tier"] != "dram"
    profile = report["parts"]["profile"]["result"]
    assert len(profile["runs"]) == 1 and profile["ttft_mean_rel_error_median"] >= 0
