"""The placer's side of burst scale-out (services/placer/burst.py, settings): the setting read at
the edge, and the arrivals record the core's rate comes from. (Carried out on a real stack:
tests/multicast/test_burst_scaleout.py.)"""

from __future__ import annotations

import time

import pytest

from services.placer.burst import BurstStarter
from services.placer.settings import burst_from_env
from shared.core.burst import recent_rate
from shared.core.config import CoreConfig
from shared.schemas import InferenceRequest


def _req(rid: str, model: str = "m", resumed: list[int] | None = None) -> InferenceRequest:
    return InferenceRequest(rid, "t", model, [1, 2, 3], 4, time.time(), 30.0, 0.5,
                            resumed_token_ids=resumed or [])


def test_burst_scale_out_is_off_unless_asked_for_and_its_knobs_are_checked():
    core = CoreConfig()
    assert not burst_from_env(core, env={}).burst_scaleout
    on = burst_from_env(core, env={"SLINFER_BURST_SCALEOUT": "true", "SLINFER_BURST_MAX": "3",
                                   "SLINFER_BURST_WINDOW_S": "2.5"})
    assert (on.burst_scaleout, on.burst_max, on.burst_window_s) == (True, 3, 2.5)
    assert on.burst_max_startup_s == core.burst_max_startup_s
    with pytest.raises(ValueError, match="SLINFER_BURST_MAX must be >= 1"):
        burst_from_env(core, env={"SLINFER_BURST_MAX": "0"})


def test_the_arrivals_record_keeps_the_window_of_new_requests_per_model():
    starter = BurstStarter(None, CoreConfig(burst_scaleout=True, burst_window_s=1.0), None, None)
    for i, at in enumerate([0.0, 0.5, 1.2, 1.4]):
        starter.note(_req(f"a{i}"), at)
    starter.note(_req("b0", model="other"), 1.4)
    starter.note(_req("a-resumed", resumed=[7]), 1.4)  # a copy coming back is no new arrival
    seen = starter._arrivals["m"]
    assert list(seen) == [0.5, 1.2, 1.4]  # 0.0 fell out of the window at 1.2
    assert recent_rate(seen, 1.4, 1.0) == 3.0  # per second, over (0.4, 1.4]
    assert list(starter._arrivals["other"]) == [1.4]
    off = BurstStarter(None, CoreConfig(), None, None)
    off.note(_req("c0"), 0.0)
    assert not off._arrivals  # nothing kept while burst scale-out is off
