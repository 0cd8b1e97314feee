"""The profiler on the real torch engine, and its clean-up of noisy points."""

import pytest

from services.profiler.measure import ProfilePlan, monotone
from services.profiler.run import profile_model
from shared.core.types import Hardware


def test_monotone_caps_noise_by_later_points():
    assert monotone([0.5, 0.4, 0.01, 0.02, 0.015, 0.03]) == [0.01, 0.01, 0.01, 0.015, 0.015, 0.03]
    assert monotone([1.0]) == [1.0]


@pytest.mark.integration
def test_profile_tiny_model_tables_are_sane(tmp_path):
    from shared.modelgen import ensure_demo_model

    model_dir = ensure_demo_model(tmp_path)
    plan = ProfilePlan(max_len=128, max_batch=4, repeats=2, warmup=1)
    profile, check = profile_model(model_dir, "tiny", plan=plan, check_n=3)
    assert profile.hardware is Hardware.CPU
    assert profile.prefill.lengths == [16, 32, 64, 128]
    assert profile.decode.batch_sizes == [1, 2, 4]
    assert all(t > 0 for t in profile.prefill.seconds)
    assert profile.prefill.seconds == sorted(profile.prefill.seconds)
    assert profile.load_s > 0 and profile.kv_scale_bytes_per_s > 0
    assert check is not None and check.samples == 3 and check.ttft_mean_rel_error >= 0
