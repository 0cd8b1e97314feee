"""Online calibration (pure part): the correction converges on a steady drift, ignores noise,
and the corrected profile changes the shadow validation's answer."""

from __future__ import annotations

import math
import random

import pytest

from shared.core.admission import AdmitReason
from shared.core.calibration import DECODE, PREFILL, CalibrationConfig, Calibrator, calibrated
from shared.core.config import CoreConfig
from shared.core.shadow import shadow_validate
from shared.core.types import SLO, Hardware, InstanceView, RequestView

from tests.core.factories import linear_profile, model


def _feed(cal: Calibrator, slowdown: float, n: int, rng: random.Random, noise: float = 0.0) -> int:
    changes = 0
    for _ in range(n):
        base = rng.uniform(0.01, 0.2)
        actual = base * slowdown * math.exp(rng.gauss(0.0, noise))
        changes += cal.observe("m", DECODE, base, actual)
    return changes


@pytest.mark.parametrize("slowdown", [0.5, 1.3, 3.0, 8.0])
def test_a_steady_drift_converges_to_one_factor(slowdown):
    cal = Calibrator()
    rng = random.Random(0)
    _feed(cal, slowdown, 400, rng)
    assert cal.factor("m", DECODE) == pytest.approx(slowdown, rel=0.06)
    assert _feed(cal, slowdown, 200, rng) == 0  # settled: no more corrections
    assert cal.factor("m", PREFILL) == 1.0  # the other kind is untouched


def test_noise_around_the_profile_changes_nothing():
    cal = Calibrator()
    assert _feed(cal, 1.0, 2000, random.Random(1), noise=0.05) == 0
    assert cal.factor("m", DECODE) == 1.0


def test_the_correction_is_bounded():
    cal = Calibrator(CalibrationConfig(max_factor=4.0))
    _feed(cal, 100.0, 200, random.Random(2))
    assert cal.factor("m", DECODE) == 4.0


def test_the_corrected_profile_changes_the_admission():
    """A node whose engine became 5x slower than its profile: with the stale profile a request
    is admitted that cannot make its TTFT; with the calibrated one it is refused."""
    spec = model("m")
    stale = linear_profile("m", Hardware.CPU, per_token_prefill=1e-3)
    busy = InstanceView("a", spec, "n", requests=[
        RequestView(f"r{k}", "m", 800, 0.0, SLO(10.0, 0.25)) for k in range(3)])
    newcomer = RequestView("new", "m", 800, 0.0, SLO(4.0, 0.25))
    cfg = CoreConfig()
    assert shadow_validate([busy], {"a": stale}, "a", newcomer, 0.0, 0.0, cfg) is AdmitReason.ADMITTED
    fixed = calibrated(stale, 5.0, 5.0)
    assert fixed.prefill_s(800) == pytest.approx(5 * stale.prefill_s(800))
    assert fixed.decode_s(4, 900) == pytest.approx(5 * stale.decode_s(4, 900))
    assert shadow_validate([busy], {"a": fixed}, "a", newcomer, 0.0, 0.0, cfg) is AdmitReason.TTFT_MISS
    assert calibrated(stale, 1.0, 1.0) is stale
