"""bench/sim/table.py's section for issue 26's ablation: gains are taken seed by seed against
the baselines of the same seed, and the section appears only once its runs exist."""

from __future__ import annotations

import pytest

from bench.sim.reproduce import plan
from bench.sim.table import Runs, past_section


def _row(met: int, attainment: float = 0.9, cold: int = 10) -> dict:
    return {"slo_met": met, "slo_attainment": attainment, "cold_starts": cold}


def test_gains_pair_each_seed_with_its_own_baseline():
    runs = Runs({"runs": {
        "headline/7b/128/sllm/s0": _row(100), "headline/7b/128/sllm/s1": _row(200),
        "past/7b/128/slinfer-both/s0": _row(150), "past/7b/128/slinfer-both/s1": _row(500),
        "past/7b/128/slinfer-both/s2": _row(999)}})  # no baseline of s2: left out
    assert runs.ratio("past/7b/128/slinfer-both", "headline/7b/128/sllm") == pytest.approx([50, 150])


def test_the_section_waits_for_its_runs_and_then_reports_every_variant():
    rows = {"headline/7b/128/sllm/s0": _row(100), "headline/7b/128/slinfer/s0": _row(160)}
    assert past_section(Runs({"runs": rows})) == ""
    rows.update({f"past/7b/128/slinfer-{v}/s0": _row(190, 0.95) for v in ("chunked", "prewarm", "both")})
    text = past_section(Runs({"runs": rows}))
    assert "| 7b | off | 160 | - |" in text and "| 7b | both | 190 | +19% | 0.950 | +90% (met)" in text
    assert "aim >= 0.9: met" in text


def test_the_plan_runs_every_seed_at_every_size_and_the_start_up_on_the_first():
    keys = plan([0, 1], {"past"}, sensitivity_seeds=1)
    assert len([k for k in keys if k.startswith("past/")]) == 3 * 3 * 2
    assert {k.rsplit("/", 1)[1] for k in keys if k.startswith("past-startup/")} == {"s0"}
    assert keys["past/13b/128/slinfer-both/s1"].prewarm
    assert keys["past/13b/128/slinfer-both/s1"].prefill_chunk_tokens == 64


def test_the_ablation_keeps_its_own_command_and_runs_out_of_the_reproductions():
    import json
    from pathlib import Path

    from bench.sim.table import section
    summary = json.loads(Path("bench/results/sim/summary.json").read_text())
    summary["runs"] = {k: v for k, v in summary["runs"].items() if not k.startswith("past")}
    before = section(Runs(summary)).split("Command:")[1].split("\n\n")[0]
    summary["runs"]["past/7b/128/slinfer-both/s0"] = {**_row(190), "wall_s": 7200}
    summary["meta_past"] = {"command": "reproduce --groups past", "date": "2026-11-28"}
    runs = Runs(summary)
    # the reproduction's command, run count and CPU-hours unchanged
    assert section(runs).split("Command:")[1].split("\n\n")[0] == before
    assert "Command: `reproduce --groups past`" in past_section(runs)
    assert "(1 runs, 2.0 CPU-hours, 2026-11-28)" in past_section(runs)


def test_the_note_is_kept_out_of_the_command():
    import argparse

    from bench.sim.reproduce import _meta
    args = argparse.Namespace(seeds=[0], jobs=2, sensitivity_seeds=1, note="niced")
    meta = _meta(args, ["--groups", "past", "--note", "niced", "--jobs", "2"], 1.0)
    assert meta["command"] == "python -m bench.sim.reproduce --groups past --jobs 2"
    assert meta["note"] == "niced"
