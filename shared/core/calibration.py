"""Online calibration of the timing profiles (beyond SLINFER §VI-B).

The profile is measured once, offline; the node then runs for days beside other tenants, other
engines' threads, thermal limits and new library versions. Every iteration the node executes is a
free measurement: its actual time against the profile's prediction. The calibrator keeps, per
model and iteration kind (prefill, decode), an exponentially weighted mean of log(actual /
predicted) and, once it has enough samples and has drifted past a threshold, folds it into a
correction factor that multiplies that kind's table. Decisions (the node's re-check, the placer's
plan, the shadow validation) then use the corrected profile, and the next samples are judged
against it, so a steady slowdown converges to one factor instead of compounding.

A correction needs iterations to stay true, and a large one can stop them: a factor that makes
the model look too slow for its SLO gets every request for it refused, so no sample ever shows
that the slowdown (another tenant's burst, say) has passed. So a correction fades toward the
measured profile while nothing confirms it: once `hold_s` has passed since the last iteration of
that kind, its log halves every `half_life_s` (`aged`). While iterations keep coming, the factor
holds (the node republishes when it last saw one, for the placers).

Pure: time and measurements come in as arguments; the caller stores and publishes the factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shared.core.cost import contention, own_profile
from shared.core.iteration import IterationChoice, predict_seconds
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import InstanceView

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class CalibrationConfig:
    weight: float = 0.1  # EWMA weight of a new sample (about the last 10-20 iterations count)
    threshold: float = 0.05  # |log drift| past which the factor is corrected (about 5%)
    # ...and only when the drift stands out of the samples' own scatter by this many standard
    # errors: on a loaded box one iteration's time varies by ~20%, and a mean of 8 such samples
    # crossed 5% by chance about every 10 iterations (each a publish, a profile reload, a log).
    significance: float = 3.0
    min_samples: int = 8  # samples of a kind before its drift may correct the factor
    max_factor: float = 50.0  # a bound on the correction either way (a broken clock, not drift)
    hold_s: float = 10.0  # a correction holds while iterations come at least this often
    half_life_s: float = 60.0  # past that, an unconfirmed correction's log halves this often

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        if self.threshold <= 0 or self.min_samples < 1 or self.max_factor <= 1 \
                or self.half_life_s <= 0 or self.hold_s < 0 or self.significance < 0:
            raise ValueError("threshold > 0, min_samples >= 1, max_factor > 1, half_life_s > 0, "
                             "hold_s >= 0, significance >= 0")


@dataclass
class _Drift:
    factor: float = 1.0  # correction in force (published)
    log_drift: float = 0.0  # EWMA of log(actual / predicted with `factor`), started at 0
    log_square: float = 0.0  # EWMA of its square (the samples' scatter), started at 0
    samples: int = 0  # since the last correction
    last_error: float = 0.0  # the latest sample's relative error, (actual - predicted) / predicted
    seen: float = 0.0  # when the latest sample came (the factor fades from then on)


@dataclass
class Calibrator:
    config: CalibrationConfig = field(default_factory=CalibrationConfig)
    _drift: dict[tuple[str, str], _Drift] = field(default_factory=dict)

    def observe(self, model: str, kind: str, base_predicted_s: float, actual_s: float,
                now: float) -> bool:
        """One executed iteration at `now`; `base_predicted_s` is what the measured (uncorrected)
        profile says, judged here with this calibrator's own factor as it stands then. True when
        the factor of this model and kind changed (publish it)."""
        d = self._drift.setdefault((model, kind), _Drift())
        if d.seen and now - d.seen > self.config.hold_s:
            # After a pause the faded factor is what the next samples are judged against (the
            # samples before the pause were judged against the old one: start afresh).
            d.factor = aged(d.factor, now - d.seen, self.config)
            d.log_drift, d.log_square, d.samples = 0.0, 0.0, 0
        d.seen = now
        predicted_s = base_predicted_s * d.factor
        if predicted_s <= 0 or actual_s <= 0:
            return False
        d.last_error = actual_s / predicted_s - 1.0
        w, x = self.config.weight, math.log(actual_s / predicted_s)
        d.log_drift = (1 - w) * d.log_drift + w * x
        d.log_square = (1 - w) * d.log_square + w * x * x
        d.samples += 1
        # The means start at 0: divide out that start's weight (as Adam does), so the first
        # correction is the drift seen, not a fraction of it.
        start = 1 - (1 - w) ** d.samples
        drift = d.log_drift / start
        if d.samples < self.config.min_samples or abs(drift) < self.config.threshold \
                or abs(drift) < self.config.significance * _standard_error(d, drift, start, w):
            return False
        bound = self.config.max_factor
        d.factor = min(bound, max(1 / bound, d.factor * math.exp(drift)))
        d.log_drift, d.log_square, d.samples = 0.0, 0.0, 0
        return True

    def factor(self, model: str, kind: str, now: float | None = None) -> float:
        """The correction in force (faded to `now` when given)."""
        d = self._drift.get((model, kind))
        if d is None:
            return 1.0
        return d.factor if now is None or not d.seen else aged(d.factor, now - d.seen, self.config)

    def seen(self, model: str) -> dict[str, float]:
        """Per iteration kind: when the latest iteration of `model` was observed."""
        return {kind: d.seen for (m, kind), d in self._drift.items() if m == model}

    def corrected(self, model: str) -> bool:
        """Has a correction of `model` been made (one worth publishing)?"""
        return any(d.factor != 1.0 for (m, _), d in self._drift.items() if m == model)

    def last_error(self, model: str, kind: str) -> float:
        d = self._drift.get((model, kind))
        return d.last_error if d else 0.0

    def factors(self, model: str) -> dict[str, float]:
        return {PREFILL: self.factor(model, PREFILL), DECODE: self.factor(model, DECODE)}

    def models(self) -> set[str]:
        return {m for m, _ in self._drift}


def _standard_error(d: _Drift, drift: float, start: float, w: float) -> float:
    """How far the weighted mean `drift` may sit from the true drift by chance: the samples'
    variance over the mean's effective sample count (an EWMA of weight w averages about
    (2 - w) / w samples once it has seen that many)."""
    variance = max(0.0, d.log_square / start - drift * drift)
    return math.sqrt(variance / min(d.samples, (2 - w) / w))


def baseline_s(choice: IterationChoice, inst: InstanceView, profile: Profile,
               stage_load: float) -> float:
    """The prediction an executed iteration is judged against (`Calibrator.observe`'s
    `base_predicted_s`): what the measured, uncorrected `profile` says it takes as the core
    decides with it, i.e. with the hops of the instance's layout or pipeline
    (`cost.own_profile`) and on a node whose hosted stages take `stage_load` of its compute,
    1 / (1 - load) as long (`cost.contention`). Left out, a stage host would learn that
    contention as drift and the core would then apply it a second time (issue 22 #10)."""
    return predict_seconds(choice, inst, own_profile(profile, inst)) * contention(stage_load)


def aged(factor: float, age_s: float, config: CalibrationConfig) -> float:
    """A correction `age_s` after the last iteration that confirmed it: held for `hold_s`, then
    its log halves every `half_life_s` (x8 is x2.8 one half-life later, x1.07 five later)."""
    faded = age_s - config.hold_s
    if faded <= 0 or factor == 1.0:
        return factor
    return math.exp(math.log(factor) * 0.5 ** (faded / config.half_life_s))


def calibrated(profile: Profile, prefill_factor: float, decode_factor: float) -> Profile:
    """The profile with its prefill and decode tables scaled by the correction factors."""
    if prefill_factor == 1.0 and decode_factor == 1.0:
        return profile
    prefill = PrefillTable(profile.prefill.lengths, [s * prefill_factor for s in profile.prefill.seconds])
    decode = DecodeTable(profile.decode.batch_sizes, profile.decode.lengths,
                         [[s * decode_factor for s in row] for row in profile.decode.seconds])
    note = f"{profile.source}; calibrated online x{prefill_factor:.3f} prefill, x{decode_factor:.3f} decode"
    chunks = None if profile.chunks is None else profile.chunks.scaled(prefill_factor)
    return replace(profile, prefill=prefill, decode=decode, chunks=chunks,
                   source=note.lstrip("; "))
