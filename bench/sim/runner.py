"""The resumable run loop the simulator benchmarks share (`reproduce`, `lora`, `scaleout`).

A benchmark plans its runs (key -> `SimConfig`), says what a run's summary row holds (`RowFn`)
and what its summary's `meta` says; `run_plan` simulates the runs that summary.json does not
hold yet in a process pool, writes every report to OUT/<key>.json and the summary after every
run, so a stopped invocation goes on where it stopped when started again (a full reproduction
takes hours on two cores).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.build import SimOutcome
    from sim.config import SimConfig

# A run's summary row from its key, config and outcome (module-level: it goes to the workers).
RowFn = Callable[[str, "SimConfig", "SimOutcome"], dict]
# Extra per-run data kept beside the rows: (summary section, value) or None.
AttachFn = Callable[[str, "SimOutcome"], "tuple[str, Any] | None"]


@dataclass(frozen=True)
class Job:
    key: str
    cfg: SimConfig
    out: str
    row: RowFn
    attach: AttachFn | None = None
    wall_digits: int = 2


def run_one(job: Job) -> tuple[str, dict, tuple[str, Any] | None]:
    """Simulate one run, write its report, return (key, row with wall_s, attachment)."""
    from sim.report import dumps  # imported here: a table-only invocation needs no simulator
    from sim.simulate import simulate

    t0 = time.perf_counter()
    outcome = simulate(job.cfg)
    wall = time.perf_counter() - t0
    path = Path(job.out) / f"{job.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(outcome.report))
    row = job.row(job.key, job.cfg, outcome)
    row["wall_s"] = round(wall, job.wall_digits)
    attached = job.attach(job.key, outcome) if job.attach is not None else None
    return job.key, row, attached


def load_summary(path: Path, fresh: bool, sections: tuple[str, ...] = ("runs",)) -> dict:
    summary = json.loads(path.read_text()) if path.exists() and not fresh else {}
    for section in sections:
        summary.setdefault(section, {})
    return summary


def run_plan(runs: dict[str, SimConfig], out: Path, *, jobs: int, fresh: bool, row: RowFn,
             meta: Callable[[float, tuple[float, ...]], dict],
             describe: Callable[[dict], str], order: Callable[[str], Any] | None = None,
             attach: AttachFn | None = None, sections: tuple[str, ...] = ("runs",),
             wall_digits: int = 2, meta_key: str = "meta") -> dict:
    """Run what summary.json lacks (all with `fresh`), slowest first by `order`; after each run
    store its row (and attachment), `meta(seconds since start, load average before)` as the
    summary's `meta_key` (an invocation of extra groups keeps the main one's meta), and print
    `describe(row)`. Returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = load_summary(summary_path, fresh, sections)
    todo = [k for k in runs if k not in summary["runs"]]
    if order is not None:
        todo.sort(key=order)
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} already in {summary_path}",
          flush=True)
    work = [Job(k, runs[k], str(out), row, attach, wall_digits) for k in todo]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for i, (key, result, attached) in enumerate(pool.map(run_one, work)):
            summary["runs"][key] = result
            if attached is not None:
                section, value = attached
                summary.setdefault(section, {})[key] = value
            summary[meta_key] = meta(time.perf_counter() - started, load_before)
            summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
            print(f"[{i + 1}/{len(todo)}] {key:45s} {describe(result)}", flush=True)
    return summary
