"""Online calibration (pure part): the correction converges on a steady drift, ignores noise,
and the corrected profile changes the shadow validation's answer."""

from __future__ import annotations

import math
import random

import pytest

from shared.core.admission import AdmitReason
from shared.core.calibration import (DECODE, PREFILL, CalibrationConfig, Calibrator, aged,
                                     calibrated)
from shared.core.config import CoreConfig
from shared.core.shadow import shadow_validate
from shared.core.types import SLO, Hardware, InstanceView, RequestView

from tests.core.factories import linear_profile, model


def _feed(cal: Calibrator, slowdown: float, n: int, rng: random.Random, noise: float = 0.0,
          start: float = 1000.0) -> int:
    """`n` decode iterations 0.1 s apart from `start` (a busy model: no pause to fade over)."""
    changes = 0
    for k in range(n):
        base = rng.uniform(0.01, 0.2)
        actual = base * slowdown * math.exp(rng.gauss(0.0, noise))
        changes += cal.observe("m", DECODE, base, actual, now=start + 0.1 * k)
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


def test_a_loaded_boxs_scatter_rarely_corrects_and_a_real_slowdown_under_it_is_learned():
    """One iteration's time varying by ~20% (a busy 2-core box): the factor stays within a
    few percent of the truth and corrects at most 20 times in 1,000 iterations, not every
    tenth one as before (each correction is a publish, a profile reload and a log line); a 2x
    slowdown under the same scatter is still found, within 10%."""
    cal = Calibrator()
    assert _feed(cal, 1.0, 1000, random.Random(3), noise=0.2) <= 20
    assert cal.factor("m", DECODE) == pytest.approx(1.0, rel=0.1)
    slow = Calibrator()
    _feed(slow, 2.0, 400, random.Random(4), noise=0.2)
    assert slow.factor("m", DECODE) == pytest.approx(2.0, rel=0.1)


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


def test_a_correction_holds_while_iterations_confirm_it_and_fades_without_them():
    """A factor that makes a model look infeasible stops every request for it, and with them the
    samples that could lower it: unconfirmed, it must fade back toward the measured profile."""
    cfg = CalibrationConfig()
    cal = Calibrator(cfg)
    _feed(cal, 8.0, 400, random.Random(3), start=1000.0)  # busy for 40 s, 8x slower
    last = 1000.0 + 0.1 * 399
    held = cal.factor("m", DECODE, now=last + cfg.hold_s)
    assert held == cal.factor("m", DECODE) == pytest.approx(8.0, rel=0.06)
    one = cal.factor("m", DECODE, now=last + cfg.hold_s + cfg.half_life_s)
    assert one == pytest.approx(math.sqrt(held))  # the log halved
    assert cal.factor("m", DECODE, now=last + cfg.hold_s + 10 * cfg.half_life_s) < 1.01
    assert aged(1 / 8, cfg.hold_s + cfg.half_life_s, cfg) == pytest.approx(1 / math.sqrt(8))
    # Iterations after a long pause are judged against the faded factor: a slowdown that has
    # passed leaves no correction behind, one that has not is learnt again.
    later = last + cfg.hold_s + 10 * cfg.half_life_s
    _feed(cal, 1.0, 200, random.Random(4), start=later)
    assert cal.factor("m", DECODE) == pytest.approx(1.0, rel=0.06)
    _feed(cal, 8.0, 400, random.Random(5), start=later + 100.0)
    assert cal.factor("m", DECODE) == pytest.approx(8.0, rel=0.06)
