"""Engines behind the narrow protocol of `base.py`; `create_engine` picks one by name.

Engines are imported lazily so that importing this package does not pull in torch or
transformers for callers that only need the protocol types.
"""

from __future__ import annotations

from pathlib import Path

from .base import Engine, KVCacheFull, MemoryReport, SamplingParams, StepResult

ENGINES = ("torch", "openvino", "vllm")

__all__ = ["ENGINES", "Engine", "KVCacheFull", "MemoryReport", "SamplingParams", "StepResult",
           "create_engine"]


def create_engine(name: str, model_dir: str | Path, device: str = "cpu",
                  kv_capacity_bytes: int | None = None, dtype: str | None = None) -> Engine:
    """Construct (not load) an engine for the model directory; call `.load()` before use."""
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                           dtype=dtype)
    if name == "openvino":  # OpenVINO GenAI in this environment; IR conversion in .venv-openvino
        from .openvino_engine import OpenVINOEngine

        return OpenVINOEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                              dtype=dtype)
    if name == "vllm":  # a child process in .venv-vllm
        from .vllm_engine import VllmEngine

        return VllmEngine(model_dir, device=device, kv_capacity_bytes=kv_capacity_bytes,
                          dtype=dtype)
    raise ValueError(f"unknown engine {name!r}; available engines: {', '.join(ENGINES)}")
