"""Engines behind the narrow protocol of `base.py`; `create_engine` picks one by name.

Engines are imported lazily so that importing this package does not pull in torch or
transformers for callers that only need the protocol types.
"""

from __future__ import annotations

from pathlib import Path

from .base import Engine, KVCacheFull, MemoryReport, SamplingParams, StepResult

ENGINES = ("torch", "openvino", "vllm")
AUTO = "auto"  # the default engine of the node's device kind (see DEFAULT_ENGINES)
# The engine a model registered with engine "auto" runs on, by device kind. CPU: the fastest
# engine that passes the correctness tests on the llama-3.2-1b shape in bf16 on this project's
# CPU (bench/results/engines_cpu_llama-3.2-1b*.json, bench/BENCHMARKS.md "Engines on CPU"):
# torch (prefill and decode at batch 1-32 ahead of OpenVINO and vLLM there). GPU: torch, the
# only engine here that runs on CUDA.
DEFAULT_ENGINES = {"cpu": "torch", "cuda": "torch"}

__all__ = ["AUTO", "DEFAULT_ENGINES", "ENGINES", "Engine", "KVCacheFull", "MemoryReport",
           "SamplingParams", "StepResult", "create_engine", "default_engine", "resolve_engine",
           "tune_cpu_allocator"]


def default_engine(device: str) -> str:
    """The default engine for a torch device string ("cpu", "cuda:0", ...)."""
    kind = str(device).split(":", 1)[0]
    try:
        return DEFAULT_ENGINES[kind]
    except KeyError:
        raise ValueError(f"no default engine for device {device!r}") from None


def resolve_engine(name: str, device: str) -> str:
    """`name`, or the device's default engine when it is "auto"."""
    return default_engine(device) if name == AUTO else name


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: allocations above it are mmapped
TRIM_THRESHOLD_BYTES = 512 << 20


def tune_cpu_allocator() -> bool:
    """Fix glibc malloc's thresholds for this process (once; False where it is not glibc).

    An iteration on CPU allocates and frees tens of MB of temporaries (the torch engine's padded
    K/V gather of a decode batch, activations of a prefill). With glibc's defaults the mmap
    threshold moves with the history of frees, and a free at the top of the heap trims it back to
    the OS, so the same decode step costs either a few ms or 3x that in page faults depending on
    what ran before (measured here: batch 32 x 512 tokens on the tiny model, 6 ms vs 17 ms). That
    made profiles and the iterations they predict disagree. Fixed thresholds keep up to
    TRIM_THRESHOLD_BYTES of freed heap for reuse; blocks above 32 MB (a real model's KV pool
    layers) are still mmapped and returned to the OS when freed.
    """
    global _allocator_tuned
    if _allocator_tuned is not None:
        return _allocator_tuned
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        _allocator_tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        _allocator_tuned = False
    return _allocator_tuned


_allocator_tuned: bool | None = None


def create_engine(name: str, model_dir: str | Path, device: str = "cpu",
                  kv_capacity_bytes: int | None = None, dtype: str | None = None,
                  loader=None) -> Engine:
    """Construct (not load) an engine for the model directory; call `.load()` before use.
    `loader` is the node's `CheckpointLoader` (services.node.loader); the torch engine loads
    converted checkpoints through it (its tiers and bandwidth figures are the node's)."""
    if str(device).startswith("cpu"):
        tune_cpu_allocator()
    name = resolve_engine(name, device)
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                           dtype=dtype, loader=loader)
    if name == "openvino":  # OpenVINO GenAI in this environment; IR conversion in .venv-openvino
        from .openvino_engine import OpenVINOEngine

        return OpenVINOEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                              dtype=dtype)
    if name == "vllm":  # a child process in .venv-vllm
        from .vllm_engine import VllmEngine

        return VllmEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                          dtype=dtype)
    raise ValueError(f"unknown engine {name!r}; available engines: {', '.join(ENGINES)} "
                     f"or {AUTO!r}")
