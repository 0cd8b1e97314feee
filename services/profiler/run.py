"""Profile one model directory on one engine and device; used by `slinfer profile`, `slinfer up`
and the test suite."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from services.node.engines import create_engine
from services.node.engines.base import chunks_prefill
from services.profiler.measure import CheckResult, ProfilePlan, check, measure
from shared.cluster import profile_from_json, profile_to_json
from shared.core.perf_model import Profile
from shared.core.types import Hardware


def profile_model(model_dir: Path, name: str, engine_name: str = "torch", device: str = "cpu",
                  plan: ProfilePlan = ProfilePlan(), check_n: int = 0, progress: bool = False,
                  on_progress: Callable[[float], None] | None = None
                  ) -> tuple[Profile, CheckResult | None]:
    """Load the model on `engine_name`, measure its tables (and check them on `check_n` random
    workloads); `on_progress` gets the fraction done after each measured point."""
    hardware = Hardware.GPU if device.startswith("cuda") else Hardware.CPU
    engine = create_engine(engine_name, model_dir, device=device)
    start = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - start
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    total = plan.points(lora=engine_name == "torch", chunks=chunks_prefill(engine)) + check_n
    bar = _bar(total, progress, f"profiling {name}")

    def tick() -> None:
        bar.update()
        if on_progress is not None:
            on_progress(min(1.0, bar.n / total))

    try:
        profile = measure(engine, name, hardware, plan, vocab, load_s, tick=tick,
                          model_dir=Path(model_dir))
        profile = replace(profile, engine_init_s=engine_init_s(engine, load_s))
        result = check(engine, profile, plan, vocab, check_n, tick=tick) if check_n else None
    finally:
        bar.close()
        engine.unload()
    return profile, result


def engine_init_s(engine, load_s: float) -> float:
    """The engine's start-up beside reading its checkpoint: the whole load less the loader's
    part (0 when the weights did not come through the node's loader). A node's cold-start
    estimate is this plus the checkpoint's bytes over the bandwidth of the tier holding it."""
    info = getattr(engine, "load_info", None) or {}
    if info.get("source") != "loader" or info.get("loader_seconds") is None:
        return 0.0
    return max(0.0, load_s - float(info["loader_seconds"]))


def _bar(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="pt")


def write_report(path: Path, profile: Profile, result: CheckResult | None) -> None:
    report = {"profile": json.loads(profile_to_json(profile))}
    if result is not None:
        report.update(asdict(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def read_report(path: Path) -> Profile:
    return profile_from_json(json.dumps(json.loads(path.read_text())["profile"]))
