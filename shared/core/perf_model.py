"""Iteration-time prediction from profile tables (SLINFER §VI-B).

Prefill time is linear in input length: 1-D linear interpolation over sampled lengths (2^k).
Decode time depends on batch size (FFN) and total context (attention): 2-D bilinear
interpolation over a grid of batch sizes 2^i x average lengths 2^j. Past the last sample point
both extrapolate linearly from the last segment (never below the last value), so a 6K prompt on a
table that stops at 4K is predicted slower than 4K rather than clamped to it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shared.core.types import Hardware


def _segment(xs: list[float], x: float) -> int:
    """Index i of the segment [xs[i], xs[i+1]] used for x (clamped to the first/last one)."""
    i = bisect.bisect_right(xs, x) - 1
    return max(0, min(i, len(xs) - 2))


def interp1(xs: list[float] | list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = _segment(xs, x)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > xs[-1]:
        y = max(y, ys[-1])  # extrapolate up, never down
    elif x < xs[0]:
        y = min(max(y, 0.0), ys[0])  # below the first sample: shrink toward 0, not below
    return y


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
        if len(self.batch_sizes) == 1:
            return interp1(self.lengths, self.seconds[0], avg_len)
        i = _segment(self.batch_sizes, batch_size)
        pair = self.batch_sizes[i:i + 2]
        rows = [interp1(self.lengths, self.seconds[k], avg_len) for k in (i, i + 1)]
        return interp1(pair, rows, float(batch_size))


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

    def prefill_s(self, input_len: int) -> float:
        return self.prefill.predict(input_len)

    def decode_s(self, batch_size: int, avg_len: float) -> float:
        if batch_size <= 0:
            return 0.0
        return self.decode.predict(batch_size, avg_len)

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
