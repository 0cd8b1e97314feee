"""Serverless multi-model workloads: who calls which model when, and how long each request is.

Arrival model (synthetic), after SLINFER §IX-A and ServerlessLLM §7:
- Popularity. Serverless invocation rates are heavy-tailed: in the Azure Functions trace a few
  hot functions carry most requests, and SLINFER §IV-C reports that the top 1% of functions
  alone contribute 26% of requests. We give model i the weight exp(SIGMA * z_i), z_i the
  (i+0.5)/N quantile of a standard normal (a log-normal popularity, sampled at its quantiles so
  that a given N always has the same popularity curve; the seed only decides which model gets
  which rank). With SIGMA = 1.7 the top 1% of a large population carries 1 - Phi(2.326 - 1.7)
  = 26.6% of the traffic; for 128 models the rates span about 3.5 orders of magnitude.
- Burstiness. Each model's arrivals are a renewal process with Gamma inter-arrival times of
  coefficient of variation 8 (ServerlessLLM §7, after AlpaServe): shape k = 1/CV^2 = 1/64,
  scale = 1 / (k * rate). Most gaps are tiny (bursts), a few are very long (silences).
- Load. `rps` is the total request rate over all models. The default, RPS_PER_MODEL per model,
  grows the load with N like sampling more functions from a trace does (SLINFER Fig. 21).

Arrivals from a file: the Azure Functions per-minute format (HashOwner, HashApp, HashFunction,
Trigger, 1..1440 invocation counts), e.g. `sim/data/azure_functions_100x30min.csv`, the sample
SLINFER's evaluation used (§IX-A). One function is one model: N functions with traffic in the
window are sampled uniformly (seeded) and mapped to the N models. When N exceeds the functions
in the file (128 models from 100 functions), the extra models replay randomly chosen functions
with their minute series rotated by a random offset: the same shape of popularity and
burstiness, not the same minutes. Within a minute, arrivals are Poisson (the minute's count at
uniformly random instants; the trace's own within-minute CV is about 1). `rps` rescales the counts.

Lengths: (input, output) pairs drawn jointly, with replacement, from an Azure LLM inference trace
CSV (TIMESTAMP, ContextTokens, GeneratedTokens).
"""

from __future__ import annotations

import csv
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LENGTHS_CSV = Path(__file__).parent / "data" / "AzureLLMInferenceTrace_conv.csv"

POPULARITY_SIGMA = 1.7  # log-normal sigma; top 1% of functions -> ~26% of requests (§IV-C)
ARRIVAL_CV = 8.0  # ServerlessLLM §7: Gamma inter-arrivals with CV 8
RPS_PER_MODEL = 0.02  # default load per deployed model: puts 32 x 7B near the paper's operating
# point (SLINFER ~0.9 GPUs, ~99% SLO at CV 2); see bench/BENCHMARKS.md


@dataclass(frozen=True)
class Arrival:
    time: float  # seconds from the start of the run
    model: str
    input_len: int
    output_len: int  # tokens the request will generate (>= 1), known to the simulator only


@dataclass(frozen=True)
class LengthSampler:
    pairs: list[tuple[int, int]]  # (input tokens, output tokens) rows of the trace

    @classmethod
    def from_csv(cls, path: str | Path = DEFAULT_LENGTHS_CSV) -> LengthSampler:
        pairs: list[tuple[int, int]] = []
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                pairs.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        if not pairs:
            raise ValueError(f"{path}: no rows")
        return cls(pairs)

    def sample(self, rng: random.Random, max_context: int) -> tuple[int, int]:
        """One (input, output) pair, clipped so input + output fits the served context."""
        inp, out = self.pairs[rng.randrange(len(self.pairs))]
        out = max(1, min(out, max_context // 2))
        inp = max(1, min(inp, max_context - out))
        return inp, out


def popularity(n: int, rng: random.Random, sigma: float = POPULARITY_SIGMA) -> list[float]:
    """Normalized weights (sum 1) for n models; see the module docstring."""
    dist = statistics.NormalDist()
    weights = [math.exp(sigma * dist.inv_cdf((i + 0.5) / n)) for i in range(n)]
    rng.shuffle(weights)
    total = sum(weights)
    return [w / total for w in weights]


def gamma_arrivals(rate: float, duration: float, rng: random.Random,
                   cv: float = ARRIVAL_CV) -> list[float]:
    """Arrival times in [0, duration) of a Gamma renewal process with the given mean rate."""
    if rate <= 0:
        return []
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (shape * rate)
    # Start from a random phase of the process (an equilibrium-ish start) rather than a burst at 0.
    t = rng.random() * rng.gammavariate(shape, scale)
    times: list[float] = []
    while t < duration:
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return times


def synthetic_arrivals(models: list[str], duration: float, rps: float, seed: int,
                       cv: float = ARRIVAL_CV) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    weights = popularity(len(models), rng)
    out: list[tuple[float, str]] = []
    for model, w in zip(models, weights):
        model_rng = random.Random(rng.getrandbits(64))
        out.extend((t, model) for t in gamma_arrivals(rps * w, duration, model_rng, cv))
    return out


def read_function_trace(path: str | Path) -> list[list[int]]:
    """Per-minute counts of every function in an Azure Functions invocation file."""
    rows: list[list[int]] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header[:4] != ["HashOwner", "HashApp", "HashFunction", "Trigger"]:
            raise ValueError(f"{path}: not the Azure Functions per-minute format (header {header[:4]})")
        for row in reader:
            rows.append([int(float(v or 0)) for v in row[4:]])
    return rows


DEFAULT_FUNCTIONS_CSV = Path(__file__).parent / "data" / "azure_functions_100x30min.csv"


def trace_arrivals(path: str | Path, models: list[str], duration: float, rps: float | None,
                   seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    minutes = max(1, math.ceil(duration / 60.0))
    window = [row[:minutes] for row in read_function_trace(path)]
    active = [row for row in window if sum(row) > 0]
    if not active:
        raise ValueError(f"{path}: no function has traffic in the first {minutes} minutes")
    chosen = rng.sample(active, min(len(models), len(active)))
    while len(chosen) < len(models):  # more models than functions: rotated replays
        row, shift = rng.choice(active), rng.randrange(1, minutes) if minutes > 1 else 0
        chosen.append(row[shift:] + row[:shift])
    scale = 1.0
    if rps is not None:
        total = sum(sum(r) for r in chosen)
        scale = rps * minutes * 60.0 / total
    out: list[tuple[float, str]] = []
    for model, counts in zip(models, chosen):
        for minute, count in enumerate(counts):
            n = _scaled_count(count, scale, rng)
            out.extend((t, model) for t in _spread(minute * 60.0, 60.0, n, rng, cv=1.0) if t < duration)
    return out


def _scaled_count(count: int, scale: float, rng: random.Random) -> int:
    x = count * scale
    return int(x) + (1 if rng.random() < x - int(x) else 0)


def _spread(start: float, width: float, n: int, rng: random.Random,
            cv: float = ARRIVAL_CV) -> list[float]:
    """n arrivals inside [start, start+width) with Gamma(CV) gaps (CV 1: Poisson)."""
    if n == 0:
        return []
    shape = 1.0 / (cv * cv)
    gaps = [rng.gammavariate(shape, 1.0) for _ in range(n + 1)]
    total = sum(gaps) or 1.0
    out, acc = [], 0.0
    for g in gaps[:-1]:
        acc += g
        out.append(start + width * acc / total)
    return out


def build_workload(models: list[str], max_context: dict[str, int], duration: float,
                   rps: float | None, seed: int, lengths: LengthSampler,
                   arrivals: str = "synthetic", cv: float = ARRIVAL_CV) -> list[Arrival]:
    """All arrivals of a run, sorted by time (ties by model name), with sampled lengths."""
    if arrivals == "synthetic":
        rate = rps if rps is not None else RPS_PER_MODEL * len(models)
        times = synthetic_arrivals(models, duration, rate, seed, cv)
    else:
        path = DEFAULT_FUNCTIONS_CSV if arrivals == "functions" else arrivals
        times = trace_arrivals(path, models, duration, rps, seed)
    times.sort()
    rng = random.Random(seed ^ 0x5EED)
    out = []
    for t, model in times:
        inp, outp = lengths.sample(rng, max_context[model])
        out.append(Arrival(time=t, model=model, input_len=inp, output_len=outp))
    return out
