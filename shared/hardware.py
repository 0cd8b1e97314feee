"""What a node worker reports about its hardware, for the placer's "CPU only with a matrix
accelerator" rule (SLINFER §V) and for sizing its memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MATRIX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class HardwareInfo:
    kind: str  # "cpu" | "gpu"
    name: str
    memory_bytes: int
    cores: int = 0
    matrix_accel: bool = False  # AMX on CPUs; always True for GPUs (tensor cores)
    flags: list[str] = field(default_factory=list)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _total_memory() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def detect_cpu(cpuinfo: str | None = None) -> HardwareInfo:
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    flags = cpu_flags(text)
    found = sorted(f for f in MATRIX_FLAGS if f in flags)
    return HardwareInfo("cpu", _cpu_model(text), _total_memory(), os.cpu_count() or 1,
                        matrix_accel={"amx_tile", "amx_bf16"} <= flags, flags=found)


class NoGPU(RuntimeError):
    pass


def detect_gpu(index: int = 0) -> HardwareInfo:
    """GPU name and memory through NVML; NoGPU (not a crash) where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        raise NoGPU(f"no NVIDIA GPU available: {exc}") from exc
    return HardwareInfo("gpu", name if isinstance(name, str) else name.decode(), int(mem),
                        matrix_accel=True)
