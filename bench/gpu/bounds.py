"""What the device can do at best, measured, and what a decode step or a prefill should cost at
that best.

Decode at small batches reads every weight once per step and every cached K/V of the batch once:
its floor is those bytes over the device's memory bandwidth (the HBM bound). Prefill is matrix
multiplication: its ceiling is the device's dense matmul rate in the serving dtype. Both
yardsticks are measured here on the device itself (a device-to-device copy; a large square
matmul), not taken from a datasheet, so a ratio against them says how far the engine is from what
this very device does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def samples(fn, device: torch.device, repeats: int, before=None) -> list[float]:
    """Wall seconds of each of `repeats` runs of `fn()`, the device drained before and after
    each; `before()` runs untimed ahead of each (a cache to drop, say)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = sorted(samples(fn, device, repeats))
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s moved by a copy between two device buffers, counting the read and the write
    (what a kernel streaming memory can reach)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats)
    return 2 * n ** 3 / seconds


@dataclass(frozen=True)
class ModelCost:
    """The bytes and FLOPs of the model that a step's floor counts."""

    weight_bytes: int  # every parameter once (a tied head counted once)
    kv_bytes_per_token: int  # K and V of one token over all layers
    matmul_params: int  # parameters that multiply every token (all but the embedding table)
    layers: int
    hidden: int

    def decode_bound_s(self, batch: int, context: int, bytes_per_s: float) -> float:
        """One decode step can be no faster than reading the weights and the batch's K/V."""
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / bytes_per_s

    def prefill_flops(self, tokens: int) -> float:
        """Dense FLOPs of a prefill of `tokens`: 2 per parameter per token, plus causal attention
        (QK^T and PV over half the square, per layer)."""
        return 2.0 * self.matmul_params * tokens + 2.0 * self.layers * tokens * tokens * self.hidden


def model_cost(model: torch.nn.Module, config, kv_bytes_per_token: int) -> ModelCost:
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    # A tied head multiplies every token by the embedding table: it is matmul work then.
    matmul = sum(p.numel() for p in params) - (0 if tied else embed.numel())
    return ModelCost(weight_bytes, kv_bytes_per_token, matmul, config.num_hidden_layers,
                     config.hidden_size)
