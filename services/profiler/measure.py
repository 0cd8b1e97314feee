"""Measure a model's iteration times on a real engine (SLINFER §VI-B).

Prefill at input lengths 2^k and the midpoints 3 * 2^(k-1) (attention makes prefill convex in
the length, so a chord over a whole octave over-predicts its middle); decode at batch sizes 2^i x
average lengths 2^j.

Built for a noisy, shared machine: a burst of a neighbour's work must not land on all the
samples of one point. Prefill samples are taken in rounds over all lengths (round-robin), and the
decode grid is measured in `passes` separate sweeps, each point set up afresh in each; a point is
the median of all its samples. Every timed iteration is preceded by untimed ones of the same
shape (as in service, where an instance's iterations follow each other). `check` then replays
random workloads, measured the same way, and reports the mean relative error of the
interpolated predictions.

Unmerged LoRA (ServerlessLoRA §4.4) is measured on engines that serve adapters (`measure_lora`):
per adapter rank, a decode step of a batch whose rows run through random adapters of that rank
against the same batch without them, and a prefill through one against a plain one; stored as
the fractions they add (`Profile.lora`), which the core charges to batches with adapter requests.

Chunked prefill is measured on engines that chunk (`measure_chunks`): a chunk of `tokens` new
tokens after `done` already written, on a small grid inside the profiled range
(`ProfilePlan.chunk_done` x `chunk_tokens`), sampled in rounds like the prefill table; stored as
`Profile.chunks`, which `Profile.prefill_chunk_s` interpolates.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from services.node.engines.base import ChunksPrefill, Engine, SamplingParams, chunks_prefill
from shared.core.perf_model import ChunkTable, DecodeTable, LoraCost, PrefillTable, Profile
from shared.core.types import Hardware

GREEDY_ONE = SamplingParams(max_tokens=1 << 30, temperature=0.0)
LORA_CONTEXT = 128  # tokens of context in the LoRA measurement (see ProfilePlan.lora_len)
LORA_ADAPTERS = 4  # distinct adapters a measured decode batch is spread over (a mixed batch)


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
    repeats: int = 3  # timed samples of a point per pass (prefill: rounds)
    warmup: int = 1  # untimed iterations before them
    min_len: int = 16
    passes: int = 2  # separate sweeps of the decode grid (prefill: repeats * passes rounds)
    # Adapter ranks whose unmerged-LoRA cost is measured (engines that serve adapters only);
    # empty: not measured.
    lora_ranks: tuple[int, ...] = (8, 32)
    # Measure the chunk table on engines that chunk (a grid of 2 x 3 points, see chunk_done).
    chunks: bool = True

    @property
    def chunk_done(self) -> list[int]:
        """Tokens already in the cache before a measured chunk: a short and a long context."""
        return sorted({max(self.min_len, self.max_len // 8), max(self.min_len, self.max_len // 2)})

    @property
    def chunk_tokens(self) -> list[int]:
        """A measured chunk's new tokens: a small, a middling and a large chunk, all fitting
        after the longest `chunk_done` inside `max_len`."""
        return sorted({max(1, self.max_len // 16), max(1, self.max_len // 4),
                       max(1, self.max_len // 2)})

    @property
    def lengths(self) -> list[int]:
        return powers_of_two(self.min_len, self.max_len)

    @property
    def prefill_lengths(self) -> list[int]:
        mids = [3 * n // 2 for n in self.lengths[:-1]]
        return sorted({*self.lengths, *mids})

    @property
    def batches(self) -> list[int]:
        return powers_of_two(1, self.max_batch)

    @property
    def lora_len(self) -> int:
        """The context the LoRA overhead is measured at: a short one, where the backbone's own
        attention is cheapest and the adapters' share of a step largest (conservative)."""
        return max(self.min_len, min(self.max_len, LORA_CONTEXT))

    def points(self, lora: bool = False, chunks: bool = False) -> int:
        grid = len(self.prefill_lengths) + self.passes * len(self.lengths) * len(self.batches)
        chunked = len(self.chunk_done) * len(self.chunk_tokens) if chunks and self.chunks else 0
        return grid + chunked + (len(self.lora_ranks) * (len(self.batches) + 1) if lora else 0)



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


def time_chunk(engine: ChunksPrefill, ids: _Ids, done: int, tokens: int) -> float:
    """A chunk of `tokens` after `done` tokens written by an earlier chunk (untimed); it is the
    request's last chunk, so it samples a token as a chunk that ends a prefill does."""
    rid = ids.new()
    engine.add_request(rid, ids.prompt(done + tokens), GREEDY_ONE)
    try:
        engine.prefill_chunk(rid, done)
        return _time(lambda: engine.prefill_chunk(rid, tokens))
    finally:
        engine.release(rid)


def measure_chunks(engine: ChunksPrefill, ids: _Ids, plan: ProfilePlan,
                   tick: Callable[[], None] = lambda: None) -> ChunkTable:
    """The median chunk time at each (done, tokens) of the plan's grid, sampled in `repeats`
    round-robin rounds, the first after `warmup` untimed chunks of each shape (each sample
    prefills its `done` tokens untimed too: warming every sample would double what the table
    adds to a profile's run); a row never falls with more tokens, nor a column with more done
    (attention reads more)."""
    points = [(d, t) for d in plan.chunk_done for t in plan.chunk_tokens]
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for round_ in range(plan.repeats):
        for d, t in points:
            for _ in range(plan.warmup if round_ == 0 else 0):
                time_chunk(engine, ids, d, t)
            samples[d, t].append(time_chunk(engine, ids, d, t))
    for _ in points:
        tick()
    width = len(plan.chunk_tokens)
    flat = [statistics.median(samples[p]) for p in points]
    grid = [monotone(flat[i * width:(i + 1) * width]) for i in range(len(plan.chunk_done))]
    columns = [monotone([row[j] for row in grid]) for j in range(width)]
    grid = [[columns[j][i] for j in range(width)] for i in range(len(plan.chunk_done))]
    return ChunkTable(plan.chunk_done, plan.chunk_tokens, grid)


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


def prefill_samples(engine: Engine, ids: _Ids, lengths: list[int], rounds: int, warmup: int,
                    tick: Callable[[], None] = lambda: None) -> list[float]:
    """The median prefill time at each length, sampled in round-robin rounds over the lengths;
    each sample right after `warmup` untimed prefills of the same length."""
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(rounds):
        for n in lengths:
            for _ in range(warmup):
                time_prefill(engine, ids, n)
            samples[n].append(time_prefill(engine, ids, n))
    for _ in lengths:
        tick()
    return [statistics.median(samples[n]) for n in lengths]


def decode_samples(engine: Engine, ids: _Ids, points: list[tuple[int, int]], passes: int,
                   repeats: int, warmup: int, tick: Callable[[], None] = lambda: None) -> list[float]:
    """The median decode step at each (batch, length), over `passes` sweeps of all the points,
    each point set up afresh in each sweep."""
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(passes):
        for batch, length in points:
            samples[batch, length] += time_decode(engine, ids, batch, length, warmup + repeats)[warmup:]
            tick()
    return [statistics.median(samples[p]) for p in points]


def measure(engine: Engine, model: str, hardware: Hardware, plan: ProfilePlan, vocab: int,
            load_s: float, seed: int = 0, tick: Callable[[], None] = lambda: None,
            model_dir: Path | None = None) -> Profile:
    """The profile's tables; with `model_dir` (random adapters are built for it) and an engine
    that serves adapters, also what unmerged LoRA costs per rank."""
    ids = _Ids(vocab, seed)
    block_slack = 64  # paged blocks round each request up
    ensure_kv(engine, plan.max_batch * (plan.max_len + plan.repeats + plan.warmup + block_slack))
    warm_up(engine, ids, plan)
    prefill = prefill_samples(engine, ids, plan.prefill_lengths, plan.repeats * plan.passes,
                              plan.warmup, tick)
    points = [(b, n) for b in plan.batches for n in plan.lengths]
    flat = decode_samples(engine, ids, points, plan.passes, plan.repeats, plan.warmup, tick)
    width = len(plan.lengths)
    grid = [monotone(flat[i * width:(i + 1) * width]) for i in range(len(plan.batches))]
    columns = [monotone([row[j] for row in grid]) for j in range(width)]
    grid = [[columns[j][i] for j in range(width)] for i in range(len(plan.batches))]
    lora = None
    if model_dir is not None and serves_adapters(engine) and plan.lora_ranks:
        pool = engine.memory().kv_capacity_bytes
        lora = measure_lora(engine, Path(model_dir), _Ids(vocab, seed + 11), plan, tick)
        if engine.memory().kv_capacity_bytes != pool:  # what follows (and `check`) runs as
            engine.resize_kv(pool)                     # the tables were measured
    chunks = measure_chunks(engine, _Ids(vocab, seed + 13), plan, tick) \
        if plan.chunks and chunks_prefill(engine) else None
    scale_fixed, scale_rate = measure_kv_scaling(engine, _Ids(vocab, seed + 7),
                                                 max_len=plan.max_len)
    return Profile(model, hardware, PrefillTable(plan.prefill_lengths, monotone(prefill)),
                   DecodeTable(plan.batches, plan.lengths, grid), load_s=load_s,
                   kv_scale_fixed_s=scale_fixed, kv_scale_bytes_per_s=scale_rate, lora=lora,
                   chunks=chunks,
                   source=f"measured by slinfer profile ({engine.name}, repeats={plan.repeats}, "
                          f"passes={plan.passes})")


def serves_adapters(engine: Engine) -> bool:
    return hasattr(engine, "load_adapter") and hasattr(engine, "unload_adapter")


def measure_lora(engine: Engine, model_dir: Path, ids: _Ids, plan: ProfilePlan,
                 tick: Callable[[], None] = lambda: None) -> LoraCost:
    """Unmerged LoRA's extra cost per rank in `plan.lora_ranks`, on random adapters built for
    `model_dir` (loaded under `profile-lora-*` and unloaded afterwards).

    Decode: at each batch size, the batch's rows spread round-robin over `LORA_ADAPTERS`
    adapters of the rank, timed step for step against as many plain requests of the same context
    (the two alternate, so a neighbour's burst hits both); the overhead is the ratio of the
    medians, less one. Prefill: one request through an adapter against a plain one, alternating.
    Overheads are kept non-negative and non-decreasing in the rank (more rank, more work: a dip
    is noise)."""
    from shared.adaptergen import build_adapter

    ensure_kv(engine, 2 * plan.max_batch * (plan.lora_len + plan.passes * (plan.warmup + plan.repeats) + 64))
    decode: list[list[float]] = []
    prefill: list[float] = []
    with tempfile.TemporaryDirectory(prefix="slinfer-lora-profile-") as tmp:
        for rank in plan.lora_ranks:
            names = [f"profile-lora-r{rank}-{k}" for k in range(LORA_ADAPTERS)]
            try:
                for k, name in enumerate(names):
                    engine.load_adapter(name, build_adapter(model_dir, Path(tmp) / name, rank=rank,
                                                            seed=k + 1))
                decode.append(_lora_decode_overheads(engine, ids, plan, names, tick))
                prefill.append(_lora_prefill_overhead(engine, ids, plan, names[0]))
                tick()
            finally:
                for name in names:
                    engine.unload_adapter(name)
    return LoraCost(list(plan.lora_ranks), list(plan.batches), _rising(decode),
                    [row[0] for row in _rising([[p] for p in prefill])], adapters=LORA_ADAPTERS)


def _rising(rows: list[list[float]]) -> list[list[float]]:
    """Each column non-negative and non-decreasing down the rows (the ranks)."""
    out = [[max(0.0, v) for v in row] for row in rows]
    for i in range(1, len(out)):
        out[i] = [max(a, b) for a, b in zip(out[i], out[i - 1])]
    return out


def _lora_decode_overheads(engine: Engine, ids: _Ids, plan: ProfilePlan, adapters: list[str],
                           tick: Callable[[], None]) -> list[float]:
    plain_t: dict[int, list[float]] = {b: [] for b in plan.batches}
    lora_t: dict[int, list[float]] = {b: [] for b in plan.batches}
    for _ in range(plan.passes):
        plain = [ids.new() for _ in range(plan.max_batch)]
        through = [ids.new() for _ in range(plan.max_batch)]
        try:
            for k, (a, b) in enumerate(zip(plain, through)):
                engine.add_request(a, ids.prompt(plan.lora_len), GREEDY_ONE)
                engine.add_request(b, ids.prompt(plan.lora_len),
                                   replace(GREEDY_ONE, adapter=adapters[k % len(adapters)]))
                engine.prefill(a)
                engine.prefill(b)
            for batch in plan.batches:
                for step in range(plan.warmup + plan.repeats):
                    t_plain = _time(lambda: engine.decode(plain[:batch]))
                    t_lora = _time(lambda: engine.decode(through[:batch]))
                    if step >= plan.warmup:
                        plain_t[batch].append(t_plain)
                        lora_t[batch].append(t_lora)
        finally:
            for rid in (*plain, *through):
                engine.release(rid)
    for _ in plan.batches:
        tick()
    return [statistics.median(lora_t[b]) / statistics.median(plain_t[b]) - 1 for b in plan.batches]


def _lora_prefill_overhead(engine: Engine, ids: _Ids, plan: ProfilePlan, adapter: str) -> float:
    through = replace(GREEDY_ONE, adapter=adapter)
    plain_t: list[float] = []
    lora_t: list[float] = []
    for round_ in range(plan.warmup + plan.repeats * plan.passes):
        times = []
        for params in (GREEDY_ONE, through):
            rid = ids.new()
            engine.add_request(rid, ids.prompt(plan.lora_len), params)
            try:
                times.append(_time(lambda: engine.prefill(rid)))
            finally:
                engine.release(rid)
        if round_ >= plan.warmup:
            plain_t.append(times[0])
            lora_t.append(times[1])
    return statistics.median(lora_t) / statistics.median(plain_t) - 1


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
    """Random lengths and batches inside the profiled range, measured the way the profile was
    (interleaved, medians), against the interpolated predictions."""
    rng = random.Random(seed)
    ids = _Ids(vocab, seed + 1)
    lengths = [rng.randint(plan.min_len, plan.max_len) for _ in range(n)]
    points = [(rng.randint(1, plan.max_batch), rng.randint(plan.min_len, plan.max_len))
              for _ in range(n)]
    prefill = prefill_samples(engine, ids, lengths, plan.repeats * plan.passes, plan.warmup)
    decode = decode_samples(engine, ids, points, plan.passes, plan.repeats, plan.warmup, tick)
    ttft_err = [abs(m - profile.prefill_s(n)) / m for m, n in zip(prefill, lengths)]
    tpot_err = [abs(m - profile.decode_s(b, n)) / m for m, (b, n) in zip(decode, points)]
    return CheckResult(statistics.fmean(ttft_err), statistics.fmean(tpot_err), n)

