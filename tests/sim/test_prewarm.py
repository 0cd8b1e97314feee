"""The simulator's --prewarm: SLINFER's placer keeps each model's idle-time histogram and starts
an instance shortly before the predicted next call (`shared.core.prewarm`); a run without it
reports what it always did."""

from __future__ import annotations

from sim.cli import config_from, parser
from sim.config import SimConfig, params_of

from tests.sim.helpers import run_requests


def test_the_flag_sets_the_core_setting_and_only_then_shows_in_the_report():
    on = config_from(parser().parse_args(["--prewarm", "--prewarm-bin-s", "2"]))
    off = config_from(parser().parse_args([]))
    assert on.core_config().prewarm and params_of(on)["prewarm_bin_s"] == 2.0
    assert on.prewarm_config().bin_s == 2.0 and on.prewarm_config().bins == 240
    assert not off.core_config().prewarm
    assert not [k for k in params_of(off) if k.startswith("prewarm")]
    assert not SimConfig().prewarm


def _run(prewarm: bool):
    # One model called every 20 s: after a few idle times the histogram says "18-19 s" (a call takes 1-2 s).
    calls = [(20.0 * i, 0, 64, 4) for i in range(14)]
    return run_requests("slinfer", "7b", 0, 1, 1, calls, prewarm=prewarm)


def test_a_regularly_called_model_is_prewarmed_before_its_calls():
    _, off_reqs, off, _ = _run(False)
    system, on_reqs, on, _ = _run(True)
    assert off.counters["cold_starts"] == 14  # the 1 s keep-alive: every call is cold
    assert on.counters.get("prewarms", 0) >= 5
    assert on.counters["cold_starts"] == 14 - on.counters["prewarms"]
    assert all(r.finished_at is not None for r in on_reqs + off_reqs)
    windows = system.idle.windows(on_reqs[0].model, 1.0)
    assert windows.predicted and 15.0 <= windows.prewarm_s < 19.0  # 10% before an 18-19 s gap
