"""Checkpoint loading on this machine: our loader against safetensors and transformers.

On `--shape` (default llama-3.2-1b, bf16, converted with `slinfer convert-checkpoint`), each
timed `--repeats` times, the median reported:

* raw: the partition files read with O_DIRECT, chunked and parallel, into buffers that are
  already faulted in (no tensors, no allocation): the bandwidth the device gives; plus `dd
  iflag=direct bs=16M` over the same files (one thread) as a cross-check;
* loader (registry tier, cold): `CheckpointLoader.load` of a node in steady state (the model
  dropped from its DRAM tier before each run, so it is read from storage again into pool
  buffers that an earlier load faulted in), O_DIRECT reads, tensors viewing the buffers; and
  the same with a new loader per run, reading into fresh memory;
* torch engine (cold): `TorchEngine.load()` through the loader, weights only (no KV pool): the
  model on the meta device plus `load_state_dict(assign=True)`, ready to run;
* loader (DRAM tier hit): the same load again with the checkpoint in the DRAM tier, zero-copy,
  and with `copy=True` (private tensors), next to the host's memcpy bandwidth;
* safetensors: `safetensors.torch.load_file` on every shard (cold);
* transformers: `AutoModelForCausalLM.from_pretrained(dtype="auto")` (cold);
* `--vllm`: the vLLM engine's whole load (engine build included) with vLLM's own safetensors
  loader and with ours (cold).

Every time is until the tensors are in memory: each run ends by touching one byte of every page
of every tensor it produced (safetensors and transformers map the files and return before
reading them; `returned_seconds` and `resident_at_return` show that). Cold = the guest's page cache of every file involved dropped before the run
(`posix_fadvise(POSIX_FADV_DONTNEED)` after an fdatasync), checked with mincore: the largest
resident fraction of any file right after the drop is recorded as `resident_after_drop`. The
virtual disk's host may cache too, which no guest call can drop: every file is read once before
the timed runs so that all methods meet the same host state.

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/loader.py [--repeats 3] [--vllm]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.node.loader import (CheckpointLoader, LoaderSettings,  # noqa: E402
                                  convert_checkpoint)
from services.node.loader.direct_io import (ParallelReader, ReadJob, aligned_buffer,  # noqa: E402
                                            drop_page_cache, memcpy_bytes_per_s,
                                            resident_bytes)
from shared.modelgen import ensure_model  # noqa: E402


def drop(files: list[Path]) -> float:
    """Drop the files from the page cache; the largest resident fraction left (mincore)."""
    for path in files:
        drop_page_cache(path)
    return max(resident_bytes(p) / max(p.stat().st_size, 1) for p in files)


def timed(run: Callable[[], object], files: list[Path], repeats: int, cold: bool = True,
          before: Callable[[], None] | None = None) -> dict:
    """Median seconds of `run` until its tensors are all in memory (every page of every tensor
    touched: mmap-backed loaders return before reading), over `repeats`, with the page cache of
    `files` dropped before each. Also the median time until `run` returned, and for the lazy
    loaders the fraction of the files resident when it returned."""
    ready, returned, resident_at_return, resident = [], [], [], 0.0
    for _ in range(repeats):
        if before is not None:
            before()
        if cold:
            resident = max(resident, drop(files))
        gc.collect()
        started = time.perf_counter()
        result = run()
        returned.append(time.perf_counter() - started)
        resident_at_return.append(_resident_fraction(files))
        touch(result)
        ready.append(time.perf_counter() - started)
        del result
        gc.collect()
    return {"seconds": statistics.median(ready), "all_seconds": ready,
            "returned_seconds": statistics.median(returned),
            "resident_at_return": statistics.median(resident_at_return),
            "resident_after_drop": resident if cold else None}


def _resident_fraction(files: list[Path]) -> float:
    total = sum(p.stat().st_size for p in files)
    return sum(resident_bytes(p) for p in files) / total if total else 0.0


def touch(result: object) -> None:
    """Read one byte of every page of every tensor the run produced."""
    for tensor in _tensors(result):
        flat = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
        if flat is not None:
            flat[::4096].sum()


def _tensors(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.nn.Module):
        return list(result.state_dict().values())
    if hasattr(result, "state_dict") and isinstance(result.state_dict, dict):  # LoadResult
        return list(result.state_dict.values())
    if hasattr(result, "model") and isinstance(getattr(result, "model"), torch.nn.Module):
        return list(result.model.state_dict().values())  # an engine
    if isinstance(result, list):
        return [t for item in result for t in _tensors(item)]
    if isinstance(result, dict):
        return [t for t in result.values() if isinstance(t, torch.Tensor)]
    return []


def with_rate(entry: dict, nbytes: int) -> dict:
    entry["bytes"] = nbytes
    entry["bytes_per_s"] = nbytes / entry["seconds"]
    return entry


def raw_direct(parts: list[Path], repeats: int, threads: int, chunk: int) -> dict:
    reader = ParallelReader(threads, chunk)
    buffers = [aligned_buffer(p.stat().st_size) for p in parts]
    for buffer in buffers:
        buffer.fill_(0)  # faulted in: the reads below measure the device only
    jobs = [ReadJob(p, p.stat().st_size, b) for p, b in zip(parts, buffers)]
    try:
        return timed(lambda: reader.read(jobs), parts, repeats)
    finally:
        reader.close()


def dd_direct(parts: list[Path], repeats: int) -> dict:
    def run() -> None:
        for path in parts:
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                           check=True, capture_output=True)
    return timed(run, parts, repeats)


def loader_cold_fresh(model_dir: Path, parts: list[Path], repeats: int, threads: int,
                      chunk: int) -> dict:
    """A new loader per run: its buffers are fresh memory (faulted in by the reads)."""
    def run():
        loader = CheckpointLoader(LoaderSettings(threads=threads, chunk_bytes=chunk,
                                                 dram_bytes_per_s=1e10))
        try:
            return loader.load(model_dir)
        finally:
            loader.close()
    return timed(run, parts, repeats)


def loader_cold_pooled(model_dir: Path, parts: list[Path], repeats: int, threads: int,
                       chunk: int) -> dict:
    """A node's loader in steady state: the model dropped from the DRAM tier before each run,
    so it is read from storage again, into pool buffers a previous load faulted in."""
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=8 << 30, threads=threads,
                                             chunk_bytes=chunk, dram_bytes_per_s=1e10))
    try:
        first = loader.load(model_dir)  # faults the pool's memory in (not timed)
        del first
        entry = timed(lambda: loader.load(model_dir), parts, repeats,
                      before=lambda: loader.drop(model_dir))
        entry["tier"] = "registry"
        entry["buffers_reused"] = loader._buffers.reused
    finally:
        loader.close()
    return entry


def engine_cold(model_dir: Path, parts: list[Path], repeats: int) -> dict:
    from services.node.engines.torch_engine import TorchEngine

    def run():
        engine = TorchEngine(model_dir, kv_capacity_bytes=0)
        engine.load()
        assert engine.load_info["source"] == "loader"
        return engine
    return timed(run, parts, repeats)


def dram_hits(model_dir: Path, repeats: int) -> dict:
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=8 << 30, dram_bytes_per_s=1e10))
    try:
        first = loader.load(model_dir)
        assert first.tier == "registry"
        del first
        view = timed(lambda: loader.load(model_dir), [], repeats, cold=False)
        copy = timed(lambda: loader.load(model_dir, copy=True), [], repeats, cold=False)
        assert loader.load(model_dir).tier == "dram"
    finally:
        loader.close()
    return {"zero_copy": view, "copy": copy}


def safetensors_cold(files: list[Path], repeats: int) -> dict:
    from safetensors.torch import load_file

    return timed(lambda: [load_file(f) for f in files], files, repeats)


def from_pretrained_cold(model_dir: Path, files: list[Path], repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    return timed(lambda: AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype="auto"), files, repeats)


def vllm_loads(model_dir: Path, parts: list[Path], files: list[Path], repeats: int) -> dict:
    """vLLM's whole load with its own loader (a copy of the directory without our checkpoint:
    symlinks to the same files) and with ours."""
    from services.node.engines.vllm_engine import VllmEngine

    plain = model_dir.parent / f"{model_dir.name}-no-checkpoint"
    plain.mkdir(exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not (plain / path.name).exists():
            (plain / path.name).symlink_to(path)
    out = {}
    for key, directory, cold_files in (("vllm_safetensors", plain, files),
                                       ("slinfer", model_dir, parts)):
        infos = []

        def run(directory=directory, infos=infos):
            engine = VllmEngine(directory, kv_capacity_bytes=64 << 20,
                                checkpoint_loader=directory == model_dir)
            engine.load()
            infos.append({k: engine.info.get(k) for k in ("load_format", "build_s", "weights")})
            engine.unload()
        out[key] = timed(run, cold_files, repeats)
        out[key]["info"] = infos[-1]
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    mem = Path("/proc/meminfo").read_text().splitlines()[0]
    device = os.stat(ROOT).st_dev
    disk = f"{os.major(device)}:{os.minor(device)}"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "platform": platform.platform(),
            "disk_device": disk, "python": platform.python_version(),
            "torch": torch.__version__, "load_average_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--vllm", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/loader.json")
    args = p.parse_args(argv)
    model_dir = ensure_model(ROOT / ".data", args.shape, args.shape)
    started = time.perf_counter()
    conversion = convert_checkpoint(model_dir)
    convert_s = time.perf_counter() - started
    index = conversion.index
    parts = [conversion.path / part.file for part in index.partitions]
    files = sorted(model_dir.glob("*.safetensors"))
    for path in parts + files:  # the host's cache meets every method in the same state
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    chunk = args.chunk_mib << 20
    n = index.file_bytes
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "model": f"{args.shape} ({index.tensor_bytes} bytes of tensors, "
                       f"{len(index.tensors)} tensors)",
              "checkpoint": {"partitions": len(index.partitions), "file_bytes": n,
                             "converted_now": conversion.converted, "convert_s": convert_s},
              "threads": args.threads, "chunk_bytes": chunk, "repeats": args.repeats}
    steps = {
        "raw_direct_parallel": lambda: with_rate(raw_direct(parts, args.repeats, args.threads,
                                                            chunk), n),
        "raw_dd_direct": lambda: with_rate(dd_direct(parts, args.repeats), n),
        "loader_registry_cold": lambda: with_rate(loader_cold_pooled(
            model_dir, parts, args.repeats, args.threads, chunk), n),
        "loader_registry_cold_fresh_memory": lambda: with_rate(loader_cold_fresh(
            model_dir, parts, args.repeats, args.threads, chunk), n),
        "torch_engine_cold": lambda: with_rate(engine_cold(model_dir, parts, args.repeats), n),
        "loader_dram_hit": lambda: dram_hits(model_dir, args.repeats),
        "memcpy_bytes_per_s": lambda: memcpy_bytes_per_s(1 << 30),
        "safetensors_cold": lambda: with_rate(safetensors_cold(files, args.repeats),
                                              index.tensor_bytes),
        "from_pretrained_cold": lambda: with_rate(from_pretrained_cold(model_dir, files,
                                                                       args.repeats),
                                                  index.tensor_bytes),
    }
    if args.vllm:
        steps["vllm"] = lambda: vllm_loads(model_dir, parts, files, args.repeats)
    for key, step in steps.items():
        print(f"{key} ...", file=sys.stderr, flush=True)
        report[key] = step()
        print(json.dumps({key: report[key]}), file=sys.stderr, flush=True)
    raw = report["raw_direct_parallel"]["bytes_per_s"]
    loader = report["loader_registry_cold"]
    report["summary"] = {
        "loader_vs_raw_bandwidth": loader["bytes_per_s"] / raw,
        "speedup_vs_from_pretrained": report["from_pretrained_cold"]["seconds"] /
        loader["seconds"],
        "speedup_vs_safetensors": report["safetensors_cold"]["seconds"] / loader["seconds"],
        "engine_speedup_vs_from_pretrained": report["from_pretrained_cold"]["seconds"] /
        report["torch_engine_cold"]["seconds"],
        "fresh_memory_loader_vs_raw_bandwidth":
            report["loader_registry_cold_fresh_memory"]["bytes_per_s"] / raw,
        "dram_copy_vs_memcpy": (n / report["loader_dram_hit"]["copy"]["seconds"]) /
        report["memcpy_bytes_per_s"],
    }
    report["machine"]["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
