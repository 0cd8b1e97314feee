"""How well a measured profile predicts the engine: `slinfer profile --check` run several times.

    .venv/bin/python bench/profile_check.py [--shape small|default] [--runs 3] [--check 50]

Each run profiles a fresh random-weight model of `shared.modelgen`'s --shape (or, with `--shape
default`, the real default model `make run` serves, `shared.default_model`) on the torch CPU
engine with the CLI's defaults (the way a new user runs it), then replays --check random
workloads inside the profiled range and compares the measured TTFT and TPOT with the profile's
interpolated prediction (mean relative error, as SLINFER §VI-B reports it: 5.9% TTFT, 3.9% TPOT).
The recorded figure is the median over the runs; each run's load average is kept, since on a
shared box the error tracks the neighbours. Writes bench/results/profile_check_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared.default_model import NAME as DEFAULT_NAME  # noqa: E402
from shared.default_model import ensure_default_model  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

TARGET = 0.10  # the shadow validation's margin assumes errors below it


def one_run(model_dir: Path, name: str, check: int) -> dict:
    started = time.perf_counter()
    _, result = profile_model(model_dir, name, "torch", "cpu", ProfilePlan(), check)
    return {"ttft_mean_rel_error": round(result.ttft_mean_rel_error, 4),
            "tpot_mean_rel_error": round(result.tpot_mean_rel_error, 4),
            "samples": result.samples, "wall_s": round(time.perf_counter() - started, 1),
            "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def record(args: argparse.Namespace, runs: list[dict]) -> dict:
    """The result file, written after every run (a stopped benchmark keeps the runs it did)."""
    ttft = statistics.median(r["ttft_mean_rel_error"] for r in runs)
    tpot = statistics.median(r["tpot_mean_rel_error"] for r in runs)
    plan = ProfilePlan()
    result = {
        "command": "python bench/profile_check.py " + " ".join(sys.argv[1:]),
        "equivalent_cli": f"slinfer profile --model <{args.shape}> --engine torch --check {args.check}"
                          f" (defaults: max_len {plan.max_len}, max_batch {plan.max_batch}, repeats "
                          f"{plan.repeats}, passes {plan.passes})",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        "shape": args.shape, "runs_done": len(runs), "runs_planned": args.runs,
        "ttft_mean_rel_error_median": ttft, "tpot_mean_rel_error_median": tpot,
        "target": TARGET, "met": ttft <= TARGET and tpot <= TARGET,
        "paper": {"ttft": 0.059, "tpot": 0.039},
        "runs": runs,
    }
    out = ROOT / "bench" / "results" / f"profile_check_{args.shape}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _model(tmp: Path, shape: str) -> tuple[Path, str]:
    if shape == "default":  # the real model, converted once into the user's cache
        return ensure_default_model(tmp), DEFAULT_NAME
    name = f"{shape}-check"
    return Path(ensure_model(tmp, shape, name)), name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--check", type=int, default=50)
    args = p.parse_args()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = _model(Path(tmp), args.shape)
        for i in range(args.runs):
            runs.append(one_run(model_dir, name, args.check))
            result = record(args, runs)
            print(f"run {i + 1}: {runs[-1]}", flush=True)
    print(json.dumps({k: result[k] for k in ("ttft_mean_rel_error_median",
                                             "tpot_mean_rel_error_median", "met")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
