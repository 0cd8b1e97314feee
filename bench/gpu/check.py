"""The GPU check: slinfer's GPU path on one device, in one run that fits a short loan of a GPU.

    python bench/gpu/check.py --out DIR                  # on a machine with a CUDA GPU (~6 min)
    python bench/gpu/check.py --device cpu --out DIR     # the same parts on tiny shapes (seconds)

Parts, in order (each recorded as it ends, so a run cut short keeps what it did):
1. parity: the torch engine's greedy tokens against Hugging Face `generate` on the same random
   weights (float32 must match token for token; the checkpoint's bf16 is reported), prompts of
   mixed lengths decoded in one batch;
2. speed: decode step time at batch 1/8/32/128 against the HBM bound (weights plus the batch's
   K/V over the device's measured copy bandwidth), prefill throughput against the measured matmul
   rate in the same dtype;
3. kv_resize: the K/V pool grown 2x, shrunk back and halved under live requests, timed against
   SLINFER's Fig. 17 (32 -> 16 GB: 0.3 s, 32 -> 64 GB: 1.9 s), the requests' tokens kept;
4. profile: `slinfer profile --check` on the device, median of 3 runs (SLINFER §VI-B: 5.9% TTFT,
   3.9% TPOT);
5. loader: our loader through pinned host memory against safetensors and `from_pretrained`
   (ServerlessLLM: 3.6-8.2x), warm and cold;
6. stack: the local stack with one GPU node, a few streamed completions (only where the services'
   dependencies are installed).

Writes DIR/gpu_check.json (results, machine, command) and DIR/gpu_check.log. Needs torch and
transformers only (the services' own dependencies for part 6). The model is generated in --work
(default: a temporary directory), never in DIR: only the results travel back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu import engine_parts, loading, stack_part  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

PARTS = ("parity", "speed", "kv_resize", "profile", "loader", "stack")
GiB = 1 << 30
log = logging.getLogger("gpu_check")


@dataclass(frozen=True)
class Sizes:
    """How big each part runs: a real shape on a GPU, tiny ones on the CPU (the suite's run)."""

    shape: str
    parity_lengths: tuple[int, ...]
    parity_new: int
    batches: tuple[int, ...]
    context: int
    prefill_tokens: int
    copy_bytes: int
    matmul_n: int
    steps: int
    kv_start_bytes: int  # the resize part's first pool (capped by free device memory)
    plan: ProfilePlan
    check_n: int
    profile_runs: int
    loader_repeats: int
    stack_requests: int
    stack_max_tokens: int
    stack_prompt_repeats: int  # the prompt's sentence this many times (inside the profiled range)
    node_memory_bytes: int


GPU = Sizes(shape="llama-3.2-1b", parity_lengths=(7, 61, 250, 700), parity_new=32,
            batches=(1, 8, 32, 128), context=512, prefill_tokens=1024, copy_bytes=GiB,
            matmul_n=8192, steps=20, kv_start_bytes=32 * GiB, plan=ProfilePlan(lora_ranks=()),
            check_n=20, profile_runs=3, loader_repeats=3, stack_requests=4, stack_max_tokens=64,
            stack_prompt_repeats=8, node_memory_bytes=40 * GiB)
CPU = Sizes(shape="tiny", parity_lengths=(5, 17, 40), parity_new=8, batches=(1, 4), context=32,
            prefill_tokens=64, copy_bytes=16 << 20, matmul_n=256, steps=5, kv_start_bytes=4 << 20,
            plan=ProfilePlan(max_len=64, max_batch=4, repeats=1, passes=1, lora_ranks=(),
                             chunks=False),
            check_n=4, profile_runs=1, loader_repeats=1, stack_requests=2, stack_max_tokens=8,
            stack_prompt_repeats=1, node_memory_bytes=2 * GiB)


def machine(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_cores": os.cpu_count()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(gpu=props.name, gpu_memory_bytes=total, gpu_free_bytes_at_start=free,
                    cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
        try:  # the node's own reading (NVML), where nvidia-ml-py is installed
            from shared.hardware import detect_gpu
            gpu = detect_gpu(device.index or 0)
            info["nvml"] = {"name": gpu.name, "memory_bytes": gpu.memory_bytes}
        except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
            info["nvml"] = f"not read: {exc}"
    return info


def kv_start_bytes(sizes: Sizes, device: torch.device, weight_bytes: int) -> int:
    """The resize part's first pool: `sizes.kv_start_bytes`, or less where growing it to twice
    that (plus a layer's copy, the weights and a margin) would not fit the free device memory."""
    if device.type != "cuda":
        return sizes.kv_start_bytes
    free, _ = torch.cuda.mem_get_info(device)
    room = free - weight_bytes - 6 * GiB
    return max(GiB, min(sizes.kv_start_bytes, int(room / 2.2)))


def run_part(name: str, fn, results: dict, out: Path, report: dict) -> None:
    log.info("part %s: start", name)
    started = time.perf_counter()
    try:
        value = fn()
        entry = {"ok": value.get("ok"), "seconds": round(time.perf_counter() - started, 1),
                 "result": value}
    except Exception:  # noqa: BLE001 - one part's failure must not lose the others
        entry = {"ok": False, "seconds": round(time.perf_counter() - started, 1),
                 "error": traceback.format_exc()}
        log.error("part %s failed:\n%s", name, entry["error"])
    results[name] = entry
    log.info("part %s: ok=%s in %.1f s", name, entry["ok"], entry["seconds"])
    write(out, report)


def write(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cuda[:i] (default) or cpu (tiny shapes)")
    p.add_argument("--shape", help="default: llama-3.2-1b on a GPU, tiny on the CPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--work", type=Path, help="where the model is generated (default: temp)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="parts not started by then are skipped (the loan is short)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if unknown := sorted(set(parts) - set(PARTS)):
        p.error(f"unknown parts {unknown}; choose from {PARTS}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; use --device cpu for the tiny CPU run")
    sizes = GPU if device.type == "cuda" else CPU
    shape = args.shape or sizes.shape
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(args.out / "gpu_check.log", mode="w")])
    began = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="slinfer-gpu-"))
    results: dict = {}
    report = {"command": "python bench/gpu/check.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(device),
              "shape": shape, "machine": machine(device), "parts": results}
    log.info("generating the %s model in %s", shape, work)
    model_dir = ensure_model(work, shape, shape)
    report["model_generation_s"] = round(time.perf_counter() - began, 1)
    write(args.out, report)
    device_profile = {}
    weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    def profile_part() -> dict:
        result, device_profile["value"] = engine_parts.profile_error(
            model_dir, device, sizes.plan, sizes.check_n, sizes.profile_runs)
        return result

    steps = {
        "parity": lambda: engine_parts.parity(model_dir, device, list(sizes.parity_lengths),
                                              sizes.parity_new),
        "speed": lambda: engine_parts.speed(model_dir, device, list(sizes.batches),
                                            sizes.context, sizes.prefill_tokens,
                                            sizes.copy_bytes, sizes.matmul_n, sizes.steps),
        "kv_resize": lambda: engine_parts.kv_resize(
            model_dir, device, kv_start_bytes(sizes, device, weight_bytes),
            list(sizes.parity_lengths), max(8, sizes.parity_new)),
        "profile": profile_part,
        "loader": lambda: loading.loading(model_dir, device, sizes.loader_repeats),
        "stack": lambda: stack_part.whole_stack(
            model_dir, shape, str(device), device_profile.get("value"), work / "stack",
            sizes.stack_requests, sizes.stack_max_tokens, sizes.stack_prompt_repeats,
            sizes.node_memory_bytes),
    }
    for name in PARTS:
        if name not in parts:
            continue
        if time.perf_counter() - began > args.budget_s:
            results[name] = {"ok": None, "skipped": f"budget of {args.budget_s:.0f} s spent"}
            write(args.out, report)
            continue
        run_part(name, steps[name], results, args.out, report)
    report["wall_s"] = round(time.perf_counter() - began, 1)
    write(args.out, report)
    failed = [n for n, r in results.items() if r["ok"] is False]
    log.info("done in %.0f s; failed parts: %s", report["wall_s"], failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
