"""The built-in profiles against the paper's published numbers (their sources are in
sim/profiles.py)."""

from __future__ import annotations

import json

import pytest

from shared.core.types import Hardware
from sim import profiles as P


def cpu7():
    return P.cpu_profile(P.SHAPES["7b"])


def test_kv_bytes_per_token_from_model_shapes():
    assert P.SHAPES["7b"].kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524288
    assert P.SHAPES["13b"].kv_bytes_per_token == 2 * 40 * 40 * 128 * 2
    assert P.SHAPES["3b"].kv_bytes_per_token == 2 * 28 * 8 * 128 * 2  # GQA: 8 KV heads


@pytest.mark.parametrize("length,ms", [(256, 149), (1024, 567), (4096, 2748)])
def test_cpu_prefill_matches_table_1(length, ms):
    assert cpu7().prefill_s(length) == pytest.approx(ms / 1000, rel=0.02)


@pytest.mark.parametrize("batch,length,ms", [(1, 1024, 71), (32, 1024, 196), (1, 4096, 80), (32, 4096, 459)])
def test_cpu_decode_matches_table_1(batch, length, ms):
    assert cpu7().decode_s(batch, length) == pytest.approx(ms / 1000, rel=0.02)


def _max_batch(profile, length, tpot=0.25, slowdown=1.0):
    b = 0
    while profile.decode_s(b + 1, length) * slowdown <= tpot:
        b += 1
    return b


def test_cpu_concurrency_limits_match_table_2():
    p = cpu7()
    assert _max_batch(p, 2048) == pytest.approx(27, abs=1)
    assert _max_batch(p, 4096) == pytest.approx(15, abs=1)
    # half a node: the baselines' 2x slowdown
    assert _max_batch(p, 2048, slowdown=2.0) == pytest.approx(9, abs=1)
    assert _max_batch(p, 4096, slowdown=2.0) == pytest.approx(4, abs=1)
    # §IV: under a 100 ms TPOT SLO, batch 9 at 1K and 3 at 4K
    assert _max_batch(p, 1024, tpot=0.1) == pytest.approx(9, abs=1)
    assert _max_batch(p, 4096, tpot=0.1) == pytest.approx(3, abs=1)


def test_size_scaling_reproduces_the_deepseek_note_and_13b_limit():
    ds = P.cpu_profile(P.DEEPSEEK_7B)
    assert ds.prefill_s(1024) == pytest.approx(0.650, rel=0.08)
    assert ds.decode_s(1, 1024) == pytest.approx(0.074, rel=0.08)
    c13 = P.cpu_profile(P.SHAPES["13b"])
    # §IV: a 13B model on CPU meets the 8 s TTFT SLO up to ~5.6K tokens
    assert c13.prefill_s(5000) < 8.0 < c13.prefill_s(6400)


def test_gpu_kv_capacity_matches_table_2():
    shape = P.SHAPES["7b"]
    kv_tokens = (P.GPU_MEMORY_BYTES - shape.weight_bytes) // shape.kv_bytes_per_token
    assert kv_tokens // 2048 == pytest.approx(66, abs=2)
    assert kv_tokens // 4096 == pytest.approx(32, abs=2)


def test_gpu_is_faster_than_cpu_and_load_time_is_about_one_second_for_7b():
    g, c = P.gpu_profile(P.SHAPES["7b"]), cpu7()
    assert g.prefill_s(1024) < c.prefill_s(1024) / 4
    assert g.decode_s(1, 1024) < c.decode_s(1, 1024) / 3
    assert g.load_s == pytest.approx(1.0)
    assert P.gpu_profile(P.SHAPES["13b"]).load_s == pytest.approx(1.93, rel=0.01)


def test_kv_scaling_has_fig17_magnitudes():
    g = P.gpu_profile(P.SHAPES["7b"])
    down = g.kv_scale_s(32 * P.GB, 16 * P.GB)
    up = g.kv_scale_s(32 * P.GB, 64 * P.GB)
    assert 0.2 < down < 0.6 and 1.4 < up < 2.2


def test_measured_profiles_load_from_json(tmp_path):
    mine = P.gpu_profile(P.SHAPES["7b"])
    path = tmp_path / "p.json"
    P.dump_profiles([mine], path)
    loaded = P.load_profiles(path)
    assert len(loaded) == 1 and loaded[0].hardware is Hardware.GPU
    assert loaded[0].decode_s(8, 1000) == pytest.approx(mine.decode_s(8, 1000))
    book = P.ProfileBook(P.builtin_profiles())
    faster = json.loads(path.read_text())
    faster[0]["prefill"]["seconds"] = [s / 2 for s in faster[0]["prefill"]["seconds"]]
    path.write_text(json.dumps(faster))
    book.override(P.load_profiles(path))
    perf = book.perf_model({"m1": "llama-2-7b"})
    assert perf.get("m1", Hardware.GPU).prefill_s(1024) == pytest.approx(mine.prefill_s(1024) / 2)
