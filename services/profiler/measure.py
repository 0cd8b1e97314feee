"""Measure a model's iteration times on a real engine (SLINFER §VI-B).

Prefill at input lengths 2^k; decode at batch sizes 2^i x average lengths 2^j; each point the
median of `repeats` timed runs after `warmup` untimed ones (this machine is noisy). `check` then
replays random workloads and reports the mean relative error of the interpolated predictions.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.node.engines.base import Engine, SamplingParams
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware

GREEDY_ONE = SamplingParams(max_tokens=1 << 30, temperature=0.0)


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


@dataclass(frozen=True)
class ProfilePlan:
    max_len: int = 1024
    max_batch: int = 32
    repeats: int = 3
    warmup: int = 1
    min_len: int = 16

    @property
    def lengths(self) -> list[int]:
        return powers_of_two(self.min_len, self.max_len)

    @property
    def batches(self) -> list[int]:
        return powers_of_two(1, self.max_batch)

    def points(self) -> int:
        return len(self.lengths) * (1 + len(self.batches))


class _Ids:
    """Fresh request ids and random prompts within the vocabulary."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng, self.n = vocab, random.Random(seed), 0

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(length)]

    def new(self) -> str:
        self.n += 1
        return f"profile-{self.n}"


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_prefill(engine: Engine, ids: _Ids, length: int) -> float:
    rid = ids.new()
    engine.add_request(rid, ids.prompt(length), GREEDY_ONE)
    try:
        return _time(lambda: engine.prefill(rid))
    finally:
        engine.release(rid)


def time_decode(engine: Engine, ids: _Ids, batch: int, length: int, steps: int) -> list[float]:
    """Prefill `batch` requests of `length` tokens (untimed), then time `steps` decode steps."""
    rids = [ids.new() for _ in range(batch)]
    try:
        for rid in rids:
            engine.add_request(rid, ids.prompt(length), GREEDY_ONE)
            engine.prefill(rid)
        return [_time(lambda: engine.decode(rids)) for _ in range(steps)]
    finally:
        for rid in rids:
            engine.release(rid)


def ensure_kv(engine: Engine, tokens: int) -> None:
    per_token = engine.memory().kv_bytes_per_token
    if engine.memory().kv_capacity_bytes < tokens * per_token:
        engine.resize_kv(tokens * per_token)


def monotone(values: list[float]) -> list[float]:
    """Longer inputs (or bigger batches) never run faster: a point above a later one is noise
    (a warm-up, a neighbour's burst), so each point is capped by the minimum after it."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def warm_up(engine: Engine, ids: _Ids, plan: ProfilePlan) -> None:
    """First calls pay one-time costs (allocator, thread pools, kernel selection) that no
    iteration in service pays; run a few of each kind before timing anything."""
    for length in (plan.min_len, plan.max_len):
        for _ in range(2):
            time_prefill(engine, ids, length)
    time_decode(engine, ids, min(4, plan.max_batch), plan.min_len, 3)


def measure(engine: Engine, model: str, hardware: Hardware, plan: ProfilePlan, vocab: int,
            load_s: float, seed: int = 0, tick: Callable[[], None] = lambda: None) -> Profile:
    ids = _Ids(vocab, seed)
    block_slack = 64  # paged blocks round each request up
    ensure_kv(engine, plan.max_batch * (plan.max_len + plan.repeats + plan.warmup + block_slack))
    warm_up(engine, ids, plan)
    prefill = []
    for length in plan.lengths:
        runs = [time_prefill(engine, ids, length) for _ in range(plan.warmup + plan.repeats)]
        prefill.append(statistics.median(runs[plan.warmup:]))
        tick()
    grid = []
    for batch in plan.batches:
        row = []
        for length in plan.lengths:
            runs = time_decode(engine, ids, batch, length, plan.warmup + plan.repeats)
            row.append(statistics.median(runs[plan.warmup:]))
            tick()
        grid.append(monotone(row))
    columns = [monotone([row[j] for row in grid]) for j in range(len(plan.lengths))]
    grid = [[columns[j][i] for j in range(len(plan.lengths))] for i in range(len(plan.batches))]
    scale_fixed, scale_rate = measure_kv_scaling(engine, _Ids(vocab, seed + 7),
                                                 max_len=plan.max_len)
    return Profile(model, hardware, PrefillTable(plan.lengths, monotone(prefill)),
                   DecodeTable(plan.batches, plan.lengths, grid), load_s=load_s,
                   kv_scale_fixed_s=scale_fixed, kv_scale_bytes_per_s=scale_rate,
                   source=f"measured by slinfer profile ({engine.name}, repeats={plan.repeats})")


def measure_kv_scaling(engine: Engine, ids: _Ids, rounds: int = 3,
                       max_len: int = 256) -> tuple[float, float]:
    """Fit seconds = fixed + new_bytes / rate from resizes of the pool to 2x and 4x its size,
    with requests in flight holding about a quarter of it (so an engine that resizes by
    rebuilding, openvino and vllm, pays its recompute here as it would in service; the torch
    engine copies their blocks). Each time is the median of `rounds`; the pool returns to its
    size after each round."""
    report = engine.memory()
    base = max(report.kv_capacity_bytes, 1 << 20)
    per_token = max(report.kv_bytes_per_token, 1)
    length = max(1, min(max_len, base // per_token // 16))
    rids = [ids.new() for _ in range(4)]
    times: dict[int, list[float]] = {2: [], 4: []}
    try:
        for rid in rids:
            engine.add_request(rid, ids.prompt(length), GREEDY_ONE)
            engine.prefill(rid)
        for _ in range(rounds):
            for factor in (2, 4):
                times[factor].append(_time(lambda f=factor: engine.resize_kv(f * base)))
            engine.resize_kv(base)
    finally:
        for rid in rids:
            engine.release(rid)
    engine.resize_kv(base)
    t2, t4 = statistics.median(times[2]), statistics.median(times[4])
    if t4 <= t2:  # the size does not show through the noise: all of it is fixed cost
        return t4, 1e12
    rate = 2 * base / (t4 - t2)
    return max(0.0, t2 - 2 * base / rate), rate


@dataclass(frozen=True)
class CheckResult:
    ttft_mean_rel_error: float
    tpot_mean_rel_error: float
    samples: int


def check(engine: Engine, profile: Profile, plan: ProfilePlan, vocab: int, n: int,
          seed: int = 1, tick: Callable[[], None] = lambda: None) -> CheckResult:
    """Random lengths and batches inside the profiled range: measured vs interpolated."""
    rng = random.Random(seed)
    ids = _Ids(vocab, seed + 1)
    ttft_err, tpot_err = [], []
    for _ in range(n):
        length = rng.randint(plan.min_len, plan.max_len)
        measured = statistics.median(time_prefill(engine, ids, length) for _ in range(plan.repeats))
        ttft_err.append(abs(measured - profile.prefill_s(length)) / measured)
        batch = rng.randint(1, plan.max_batch)
        dlen = rng.randint(plan.min_len, plan.max_len)
        runs = time_decode(engine, ids, batch, dlen, plan.warmup + plan.repeats)[plan.warmup:]
        measured = statistics.median(runs)
        tpot_err.append(abs(measured - profile.decode_s(batch, dlen)) / measured)
        tick()
    return CheckResult(statistics.fmean(ttft_err), statistics.fmean(tpot_err), n)

