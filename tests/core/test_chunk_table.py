"""The measured chunk table (`Profile.chunks`): it crosses the wire and JSON unchanged,
`prefill_chunk_s` interpolates it where present and keeps the unmeasured assumption where not,
and the profiles derived from a measured one (calibration, activation hops) carry it along."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared import wire
from shared.cluster import profile_from_json, profile_to_json
from shared.core.calibration import calibrated
from shared.core.cost import HopCost, pipeline_profile
from shared.core.perf_model import ChunkTable, Profile
from shared.core.types import Hardware

from tests.core.factories import linear_profile

TABLE = ChunkTable([128, 512], [64, 256, 512], [[0.010, 0.030, 0.060], [0.014, 0.040, 0.080]])


def measured() -> Profile:
    return replace(linear_profile("m", Hardware.CPU, 1e-3, 0.05, 0.01), chunks=TABLE)


def test_the_table_round_trips_through_json_and_the_wire():
    profile = measured()
    assert profile_from_json(profile_to_json(profile)) == profile
    assert wire.decode(Profile, wire.encode(profile)) == profile
    plain = linear_profile("m", Hardware.CPU, 1e-3, 0.05, 0.01)
    assert profile_from_json(profile_to_json(plain)).chunks is None


def test_a_measured_chunk_is_priced_from_the_table():
    profile = measured()
    assert profile.prefill_chunk_s(128, 64) == pytest.approx(0.010)
    assert profile.prefill_chunk_s(512, 512) == pytest.approx(0.080)
    # Midway on both axes: bilinear.
    assert profile.prefill_chunk_s(320, 160) == pytest.approx((0.020 + 0.027) / 2)
    # Past the grid: extrapolated up, never below the last sample.
    assert profile.prefill_chunk_s(900, 700) >= 0.080
    # More context or more tokens never cost less inside the grid.
    assert profile.prefill_chunk_s(400, 300) <= profile.prefill_chunk_s(500, 300) \
        <= profile.prefill_chunk_s(500, 400)


def test_a_first_chunk_is_a_prefill_and_an_unmeasured_profile_keeps_the_assumption():
    profile = measured()
    assert profile.prefill_chunk_s(0, 300) == profile.prefill_through(300, 0)
    plain = replace(profile, chunks=None)
    assert plain.prefill_chunk_s(128, 64) == pytest.approx(
        max(plain.prefill_s(192) - plain.prefill_s(128), plain.decode_s(1, 192)))
    assert profile.prefill_chunk_s(128, 64) != plain.prefill_chunk_s(128, 64)


def test_derived_profiles_carry_the_table():
    profile = measured()
    slower = calibrated(profile, 2.0, 1.0)
    assert slower.prefill_chunk_s(128, 64) == pytest.approx(0.020)
    hop = HopCost(0.001, 1e9, 4096)
    piped = pipeline_profile(profile, 2, hop)
    assert piped.prefill_chunk_s(128, 64) == pytest.approx(0.010 + 2 * hop.seconds(64))
