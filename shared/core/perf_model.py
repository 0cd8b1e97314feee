"""Iteration-time prediction from profile tables (SLINFER §VI-B).

Prefill time is linear in input length: 1-D linear interpolation over sampled lengths (2^k).
Decode time depends on batch size (FFN) and total context (attention): 2-D bilinear
interpolation over a grid of batch sizes 2^i x average lengths 2^j. Past the last sample point
both extrapolate linearly from the last segment (never below the last value), so a 6K prompt on a
table that stops at 4K is predicted slower than 4K rather than clamped to it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.core.types import Hardware


def _segment(xs: list[float], x: float) -> int:
    """Index i of the segment [xs[i], xs[i+1]] used for x (clamped to the first/last one)."""
    i = bisect.bisect_right(xs, x) - 1
    return 0 if i < 0 else (len(xs) - 2 if i > len(xs) - 2 else i)


def _on_segment(xs: list[float] | list[int], ys: list[float], i: int, x: float) -> float:
    """The line through (xs[i], ys[i]) and (xs[i+1], ys[i+1]) at x, bounded past the ends."""
    x0 = xs[i]
    y0 = ys[i]
    y = y0 + (ys[i + 1] - y0) * (x - x0) / (xs[i + 1] - x0)
    if x > xs[-1]:
        return max(y, ys[-1])  # extrapolate up, never down
    if x < xs[0]:
        return min(max(y, 0.0), ys[0])  # below the first sample: shrink toward 0, not below
    return y


def interp1(xs: list[float] | list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    return _on_segment(xs, ys, _segment(xs, x), x)


@dataclass(frozen=True)
class PrefillTable:
    lengths: list[int]  # sampled input lengths, ascending (2^k)
    seconds: list[float]  # measured prefill time at each length

    def predict(self, input_len: int) -> float:
        return interp1(self.lengths, self.seconds, float(input_len))


@dataclass(frozen=True)
class DecodeTable:
    batch_sizes: list[int]  # ascending (2^i)
    lengths: list[int]  # average context length per request, ascending (2^j)
    seconds: list[list[float]]  # seconds[i][j]: one decode iteration at batch_sizes[i], lengths[j]

    def predict(self, batch_size: int, avg_len: float) -> float:
        """Bilinear: interpolate along length in the two bracketing batch rows, then along batch."""
        return self.at_batch(batch_size)(avg_len)

    def at_batch(self, batch_size: int) -> Callable[[float], float]:
        """`predict` with the batch size fixed: the batch bracket is located once. Shadow
        validation simulates many decode steps of one batch; the values are `predict`'s own."""
        if len(self.batch_sizes) == 1:
            return lambda avg_len: interp1(self.lengths, self.seconds[0], avg_len)
        i = _segment(self.batch_sizes, batch_size)
        xs, b = self.batch_sizes[i:i + 2], float(batch_size)
        low, high = self.seconds[i], self.seconds[i + 1]
        if len(self.lengths) == 1:
            value = _on_segment(xs, [low[0], high[0]], 0, b)
            return lambda avg_len: value
        return _bilinear_at(self.lengths, low, high, xs[0], xs[1], b)


def _bilinear_at(lengths: list[int], low: list[float], high: list[float], b0: float, b1: float,
                 b: float) -> Callable[[float], float]:
    """`_on_segment` along length in rows `low` and `high`, then along batch at `b`, written out
    with the same arithmetic in the same order (so the same floats): shadow validation calls it
    once per simulated decode step, and the calls and lists it saves are most of its cost."""
    first, last, top = lengths[0], lengths[-1], len(lengths) - 2
    bisect_right = bisect.bisect_right
    db, span = b - b0, b1 - b0

    def at(x: float) -> float:
        j = bisect_right(lengths, x) - 1
        j = 0 if j < 0 else (top if j > top else j)
        x0 = lengths[j]
        dx, width = x - x0, lengths[j + 1] - x0
        lo0, hi0 = low[j], high[j]
        lo = lo0 + (low[j + 1] - lo0) * dx / width
        hi = hi0 + (high[j + 1] - hi0) * dx / width
        if x > last:
            lo, hi = max(lo, low[-1]), max(hi, high[-1])
        elif x < first:
            lo, hi = min(max(lo, 0.0), low[0]), min(max(hi, 0.0), high[0])
        y = lo + (hi - lo) * db / span
        if b > b1:
            return max(y, hi)
        if b < b0:
            return min(max(y, 0.0), lo)
        return y
    return at


@dataclass(frozen=True)
class ChunkTable:
    """Measured chunks of a chunked prefill (`slinfer profile` on an engine that chunks):
    `seconds[i][j]` is a chunk of `tokens[j]` new tokens run against `done[i]` tokens already in
    the request's KV cache. Interpolated as the decode table is (bilinear, extrapolated up past
    the last sample, shrunk toward 0 below the first)."""

    done: list[int]  # tokens already written before the chunk, ascending
    tokens: list[int]  # the chunk's new tokens, ascending
    seconds: list[list[float]]  # [done][tokens]

    def predict(self, done: int, tokens: int) -> float:
        return DecodeTable(self.done, self.tokens, self.seconds).predict(done, float(tokens))

    def scaled(self, factor: float, extra: Callable[[int], float] = lambda n: 0.0) -> ChunkTable:
        """Each entry times `factor`, plus `extra` of its chunk's tokens (a derived profile's
        correction: calibration, activation hops)."""
        return ChunkTable(list(self.done), list(self.tokens),
                          [[s * factor + extra(n) for n, s in zip(self.tokens, row)]
                           for row in self.seconds])


def _clamped(xs: list[int], ys: list[float], x: float) -> float:
    """Linear between the samples, the end value past either end (a ratio, not a time: no
    extrapolation)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = _segment(xs, x)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def _by_rank(ranks: list[int], values: list[float], rank: int) -> float:
    """Linear in the rank between measured ranks; past the largest, extrapolated along the last
    segment but never below its value (more rank, more work); below the smallest, the smallest's
    value (the per-adapter matmul calls cost something at any rank)."""
    if len(ranks) == 1 or rank <= ranks[0]:
        return values[0]
    i = _segment(ranks, rank)
    y = values[i] + (values[i + 1] - values[i]) * (rank - ranks[i]) / (ranks[i + 1] - ranks[i])
    return max(y, values[-1]) if rank > ranks[-1] else y


@dataclass(frozen=True)
class LoraCost:
    """What unmerged LoRA (ServerlessLoRA §4.4) adds to an iteration, as fractions of the plain
    backbone's time, measured per adapter rank (`slinfer profile`, services/profiler/measure.py).

    `decode[i][j]`: a decode step of a batch of `batch_sizes[j]` requests that all run through
    adapters of rank `ranks[i]` (spread over several adapters, as a mixed batch is), relative to
    the same batch without adapters. `prefill[i]`: one prefill through a rank-`ranks[i]` adapter.
    A batch with any adapter request is charged its largest rank's overhead: the measured batch
    had every row through an adapter, so a partly plain batch is over- rather than
    under-estimated.

    Distinct adapters: the engine runs two matmuls per adapter segment per projection
    (services/node/engines/lora.py), so a batch over more adapters than the measured ones
    (`adapters`, spread round-robin: a batch of b rows held min(b, adapters) of them) costs
    more. ASSUMPTION: the measured overhead is all the segments' (a decode step's LoRA matmuls
    are latency-bound: a few rows cost about what one does), so k distinct adapters cost
    k / adapters times the measured figure; fewer than measured are still charged the measured
    figure (the per-row part is not separated out: over- rather than under-estimated)."""

    ranks: list[int]  # ascending
    batch_sizes: list[int]  # ascending
    decode: list[list[float]]  # [rank][batch]: extra fraction of a decode step
    prefill: list[float]  # [rank]: extra fraction of a prefill
    adapters: int = 4  # distinct adapters the measured decode batches were spread over

    def decode_factor(self, rank: int, batch_size: int, adapters: int = 1) -> float:
        """A decode step of `batch_size` rows through `adapters` distinct adapters, the largest
        of rank `rank`, over the plain step."""
        per_rank = [_clamped(self.batch_sizes, row, float(batch_size)) for row in self.decode]
        segments = max(1.0, adapters / max(1, self.adapters))
        return 1.0 + max(0.0, _by_rank(self.ranks, per_rank, rank)) * segments

    def prefill_factor(self, rank: int) -> float:
        return 1.0 + max(0.0, _by_rank(self.ranks, self.prefill, rank))

    @classmethod
    def flat(cls, overhead: float, rank: int = 8, adapters: int = 1) -> LoraCost:
        """One overhead for every rank and batch (for profiles that are not measured), as
        measured over `adapters` distinct adapters."""
        return cls([rank], [1], [[overhead]], [overhead], adapters=adapters)


# ASSUMPTION: a profile without a LoRA measurement (measured before the profiler did it, or by an
# engine that serves no adapters, or derived for the simulator) charges adapter batches this
# much: the upper end of what the torch engine measured on CPU at rank 8 (+9-28%,
# bench/results/lora_small.json, batches over four adapters), so an unmeasured cost errs on
# the slow side.
UNMEASURED_LORA = LoraCost.flat(0.3, adapters=4)


@dataclass(frozen=True)
class Profile:
    """Measured (or derived, for the simulator) timings of one model on one hardware kind."""

    model: str
    hardware: Hardware
    prefill: PrefillTable
    decode: DecodeTable
    load_s: float = 1.0  # cold start: weights into device memory (ServerlessLLM loader ~1 s/7B)
    # KV resize cost model: seconds = fixed + bytes moved / bandwidth (SLINFER Fig. 17).
    kv_scale_fixed_s: float = 0.0
    kv_scale_bytes_per_s: float = 1e11
    source: str = ""  # where the numbers come from (profiler run, paper table, first principles)
    # The part of a cold start that is not reading weights (engine and runtime start-up): a
    # node that knows its tiers' bandwidths estimates a load as q + n/b plus this.
    engine_init_s: float = 0.0
    # Unmerged LoRA's extra cost per adapter rank, as measured on this model and hardware; None:
    # not measured (`UNMEASURED_LORA` is charged).
    lora: LoraCost | None = None
    # Chunks of a prefill against a written cache, as measured (None: not measured, or an engine
    # that does not chunk; `prefill_chunk_s` then prices a chunk from the prefill table).
    chunks: ChunkTable | None = None

    def prefill_s(self, input_len: int) -> float:
        return self.prefill.predict(input_len)

    def lora_cost(self) -> LoraCost:
        return self.lora if self.lora is not None else UNMEASURED_LORA

    def lora_prefill_factor(self, rank: int) -> float:
        """A prefill through a rank-`rank` adapter takes this times the plain one (1 for rank 0:
        the plain backbone)."""
        return self.lora_cost().prefill_factor(rank) if rank > 0 else 1.0

    def prefill_through(self, input_len: int, lora_rank: int) -> float:
        """`prefill_s` of a request through an adapter of `lora_rank` (0: the plain backbone)."""
        seconds = self.prefill_s(input_len)
        return seconds * self.lora_prefill_factor(lora_rank) if lora_rank else seconds

    def prefill_chunk_s(self, done: int, tokens: int, lora_rank: int = 0) -> float:
        """One chunk of a chunked prefill (Sarathi-Serve): `tokens` more of a context whose first
        `done` tokens are in the KV cache already, through an adapter of `lora_rank` (0: none).
        The one definition of a chunk's cost: the node's scheduler sizes and times its chunks
        with it, and shadow validation simulates them with it.

        Measured (`chunks`): the chunk table at (done, tokens). Not measured, the difference
        form prefill(done + tokens) - prefill(done): the table holds whole prompts (linear in
        length, §VI-B), so the difference is what the chunk's tokens add, their attention over
        the `done` tokens included as far as the table's growth with length holds it.
        ASSUMPTION (unmeasured only): a later chunk is floored at a decode step of one request
        at its context, since a chunk is a forward pass of its own that reads every weight once
        more (a whole prefill reads them once). Either way a first chunk (`done` 0) is the
        prefill of its tokens, so a single chunk of the whole prompt costs exactly
        `prefill_through`."""
        if done <= 0:
            return self.prefill_through(tokens, lora_rank)
        if self.chunks is not None:
            seconds = max(0.0, self.chunks.predict(done, tokens))
        else:
            seconds = max(self.prefill_s(done + tokens) - self.prefill_s(done),
                          self.decode_s(1, done + tokens))
        return seconds * self.lora_prefill_factor(lora_rank) if lora_rank else seconds

    def lora_decode_factor(self, rank: int, batch_size: int, adapters: int = 1) -> float:
        """A decode step of a batch whose largest adapter rank is `rank`, through `adapters`
        distinct adapters, takes this times the plain batch's (1 for rank 0: no adapter)."""
        return self.lora_cost().decode_factor(rank, batch_size, adapters) if rank > 0 else 1.0

    def decode_s(self, batch_size: int, avg_len: float) -> float:
        if batch_size <= 0:
            return 0.0
        return self.decode.predict(batch_size, avg_len)

    def decode_at(self, batch_size: int) -> Callable[[float], float]:
        """`decode_s` for one batch size, as a function of the average length."""
        if batch_size <= 0:
            return lambda avg_len: 0.0
        return self.decode.at_batch(batch_size)

    def migration_s(self, tokens: int) -> float:
        """ServerlessLLM §6's migration time a * (t_in + t_out) + b: the destination recomputes
        the KV cache of every token so far. a and b are the least-squares line through the
        prefill table (the recompute is a prefill of that many tokens)."""
        xs, ys = self.prefill.lengths, self.prefill.seconds
        if len(xs) < 2:
            return ys[0] if ys else 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(0.0, a * tokens + (my - a * mx))

    def kv_scale_s(self, bytes_before: int, bytes_after: int) -> float:
        """Allocating the new pool dominates (Fig. 17: 32->16 GB 0.3 s, 32->64 GB 1.9 s)."""
        del bytes_before  # copy of used blocks is bounded by the new pool; folded into the rate
        return self.kv_scale_fixed_s + bytes_after / self.kv_scale_bytes_per_s


@dataclass
class PerfModel:
    """All profiles the placer or a node knows, keyed by (model, hardware)."""

    profiles: dict[tuple[str, Hardware], Profile] = field(default_factory=dict)

    def add(self, profile: Profile) -> None:
        self.profiles[(profile.model, profile.hardware)] = profile

    def get(self, model: str, hardware: Hardware) -> Profile | None:
        return self.profiles.get((model, hardware))
