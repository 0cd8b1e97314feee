"""ServerlessLoRA on the torch engine (CPU): backbone sharing against one merged model per function.

Four measurements, all on one TorchEngine process (the node's engine, driven as the node drives it:
one iteration at a time), random-weight models from `shared.modelgen` and random PEFT adapters
from `shared.adaptergen` (rank `--rank`, all seven projections, nonzero B):

1. cold start (time to first token of a function's first request): an adapter whose backbone is
   resident (`load_adapter` + the prefill) against loading the full merged model and prefilling
   (three ways: the Hugging Face files, in the page cache after a warm-up read; the node's
   checkpoint loader from its DRAM tier, ServerlessLLM's fastest path; and the loader with no
   DRAM tier, reading the checkpoint from local disk with O_DIRECT, i.e. a model in no node's
   memory). The paper: TTFT down by up to 86%.
2. memory per added adapter: the engine's `adapter_bytes` and the process RSS, over 16 adapters.
3. decode-step cost of unmerged LoRA: one batch, all rows on the base vs spread over 4 adapters.
4. throughput and max batch: 4 functions (adapters of one backbone) in a memory budget of
   `--memory-factor` x one model's weights. Shared: one backbone + 4 adapters, the rest KV.
   Separate: 4 merged models, the rest KV split evenly. A burst of `--requests` requests
   (prompt `--prompt-len`, `--output-len` tokens each, round-robin over the functions) is served
   to the end by the same loop in both cases: admit waiting requests while their whole KV fits,
   prefill one, else decode the engine's batch; engines take turns. Max batch is the most
   requests holding KV at once. The paper: 1.65x tokens/s, 2.28x batch.
5. (`--parts profile`) what `slinfer profile` records for the core: the profiler's own
   `measure_lora` (services/profiler/measure.py) at ranks `--profile-ranks`, batch sizes 1..32,
   i.e. the `Profile.lora` table the shadow validation charges adapter batches with.

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/lora.py --shape small
    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/lora.py --shape llama-3.2-1b --parts cold,memory
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.node.engines import tune_cpu_allocator  # noqa: E402
from services.node.engines.base import SamplingParams  # noqa: E402
from services.node.engines.torch_engine import TorchEngine  # noqa: E402
from services.node.loader import CheckpointLoader, LoaderSettings, convert_checkpoint  # noqa: E402
from shared.adaptergen import build_adapter  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402

PARTS = ("cold", "memory", "decode", "throughput", "profile")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """The base with the adapter merged by peft, saved as a model directory (the baseline's
    'one full model per function')."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for name in ("generation_config.json",):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    del model, merged
    gc.collect()
    return out


def first_token(engine: TorchEngine, rid: str, ids: list[int], adapter: str | None) -> int:
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, adapter=adapter))
    token = engine.prefill(rid).tokens[rid]
    engine.release(rid)
    return token


# --- 1. cold start ----------------------------------------------------------------------------

def cold_start(base: Path, adapters: list[Path], merged: Path, args, rng, vocab) -> dict:
    kv = args.cold_kv_tokens
    ids = prompt(rng, args.cold_prompt_len, vocab)
    engine = TorchEngine(base, kv_capacity_bytes=None)
    engine.load()
    kv_bytes = kv * engine.memory().kv_bytes_per_token
    engine.resize_kv(kv_bytes)
    first_token(engine, "warm", ids, None)  # warm-up (allocator, kernels)
    base_prefill, adapter_ttft, adapter_load = [], [], []
    for i in range(args.repeats):
        started = time.perf_counter()
        first_token(engine, f"b{i}", ids, None)
        base_prefill.append(time.perf_counter() - started)
    for i in range(args.repeats):
        path = adapters[i % len(adapters)]
        started = time.perf_counter()
        engine.load_adapter(f"cold-{i}", path)
        loaded = time.perf_counter()
        first_token(engine, f"a{i}", ids, f"cold-{i}")
        adapter_ttft.append(time.perf_counter() - started)
        adapter_load.append(loaded - started)
        engine.unload_adapter(f"cold-{i}")
    engine.unload()
    del engine
    gc.collect()

    def full_load(loader: CheckpointLoader | None) -> list[float]:
        times = []
        for i in range(args.repeats + 1):  # the first run warms the page cache / DRAM tier
            started = time.perf_counter()
            e = TorchEngine(merged, kv_capacity_bytes=kv_bytes, loader=loader)
            e.load()
            first_token(e, f"m{i}", ids, None)
            elapsed = time.perf_counter() - started
            e.unload()
            del e
            gc.collect()
            if i:
                times.append(elapsed)
        return times

    merged_files = full_load(None)
    convert_checkpoint(merged)
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=8 << 30))
    try:
        merged_dram = full_load(loader)
    finally:
        loader.close()
    # No DRAM tier: every load reads the checkpoint from local disk with O_DIRECT (no page
    # cache), the cold start of a function whose model is in no node's memory.
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=0))
    try:
        merged_disk = full_load(loader)
    finally:
        loader.close()
    med = statistics.median
    return {
        "prompt_len": args.cold_prompt_len, "repeats": args.repeats,
        "adapter_ttft_s": adapter_ttft, "adapter_load_s": adapter_load,
        "base_prefill_s": base_prefill,
        "merged_hf_files_ttft_s": merged_files, "merged_dram_loader_ttft_s": merged_dram,
        "merged_disk_direct_ttft_s": merged_disk,
        "median": {"adapter_ttft_s": med(adapter_ttft), "adapter_load_s": med(adapter_load),
                   "base_prefill_s": med(base_prefill), "merged_hf_files_ttft_s": med(merged_files),
                   "merged_dram_loader_ttft_s": med(merged_dram),
                   "merged_disk_direct_ttft_s": med(merged_disk)},
        "ttft_reduction_vs_hf_files": 1 - med(adapter_ttft) / med(merged_files),
        "ttft_reduction_vs_dram_loader": 1 - med(adapter_ttft) / med(merged_dram),
        "ttft_reduction_vs_disk_direct": 1 - med(adapter_ttft) / med(merged_disk),
    }


# --- 2. memory per adapter --------------------------------------------------------------------

def memory(base: Path, adapters: list[Path]) -> dict:
    engine = TorchEngine(base, kv_capacity_bytes=16 << 20)
    engine.load()
    gc.collect()
    before, report = rss(), engine.memory()
    steps = []
    for i, path in enumerate(adapters):
        engine.load_adapter(f"m{i}", path)
        gc.collect()
        steps.append({"adapters": i + 1, "adapter_bytes": engine.memory().adapter_bytes,
                      "rss_delta": rss() - before})
    file_bytes = (adapters[0] / "adapter_model.safetensors").stat().st_size
    n = len(adapters)
    result = {"backbone_weight_bytes": report.weight_bytes, "adapter_file_bytes": file_bytes,
              "adapters": n, "engine_adapter_bytes_each": steps[-1]["adapter_bytes"] // n,
              "rss_delta_per_adapter": steps[-1]["rss_delta"] / n,
              "adapter_fraction_of_backbone": steps[-1]["adapter_bytes"] / n / report.weight_bytes,
              "steps": steps}
    engine.unload()
    return result


# --- 3. decode-step cost ----------------------------------------------------------------------

def decode_cost(base: Path, adapters: list[Path], args, rng, vocab) -> dict:
    engine = TorchEngine(base, kv_capacity_bytes=None)
    engine.load()
    for i, path in enumerate(adapters[:4]):
        engine.load_adapter(f"d{i}", path)
    rows = []
    for batch in args.decode_batches:
        engine.resize_kv(2 * batch * (args.cold_prompt_len + 64 * args.repeats)
                         * engine.memory().kv_bytes_per_token)
        batches = {}
        for label, pick in (("base", lambda j: None), ("4_adapters", lambda j: f"d{j % 4}")):
            ids = batches[label] = [f"{label}-{j}" for j in range(batch)]
            for j, rid in enumerate(ids):
                engine.add_request(rid, prompt(rng, args.cold_prompt_len, vocab),
                                   SamplingParams(max_tokens=1 << 20, ignore_eos=True,
                                                  adapter=pick(j)))
                engine.prefill(rid)
            engine.decode(ids)  # warm-up
        steps = {label: [] for label in batches}
        for _ in range(args.repeats * 4):  # alternate, so both see the same machine
            for label, ids in batches.items():
                started = time.perf_counter()
                engine.decode(ids)
                steps[label].append(time.perf_counter() - started)
        for ids in batches.values():
            for rid in ids:
                engine.release(rid)
        timing = {label: statistics.median(v) for label, v in steps.items()}
        rows.append({"batch": batch, "base_step_s": timing["base"],
                     "adapters_step_s": timing["4_adapters"],
                     "overhead": timing["4_adapters"] / timing["base"] - 1})
    engine.unload()
    return {"context": args.cold_prompt_len, "rank": args.rank, "rows": rows}


# --- 4. throughput and max batch ----------------------------------------------------------------

class Served:
    """One engine and the functions it serves (adapter name or None per function)."""

    def __init__(self, engine: TorchEngine, functions: dict[int, str | None]) -> None:
        self.engine, self.functions = engine, functions
        cache = engine.cache
        self.free_blocks = cache.num_blocks
        self.block = cache.block_size
        self.waiting: list[tuple[str, int, list[int]]] = []
        self.running: dict[str, int] = {}  # request -> blocks reserved
        self.left: dict[str, int] = {}


def serve(served: list[Served], requests: list[tuple[str, int, list[int]]], output_len: int) -> dict:
    for rid, fn, ids in requests:
        next(s for s in served if fn in s.functions).waiting.append((rid, fn, ids))
    generated = 0
    max_batch = 0
    decode_steps = 0
    batch_sum = 0
    started = time.perf_counter()
    while any(s.waiting or s.running for s in served):
        for s in served:
            if s.waiting:
                rid, fn, ids = s.waiting[0]
                need = -(-(len(ids) + output_len) // s.block)
                if need <= s.free_blocks:
                    s.waiting.pop(0)
                    s.free_blocks -= need
                    s.running[rid] = need
                    s.left[rid] = output_len
                    s.engine.add_request(rid, ids, SamplingParams(
                        max_tokens=output_len, ignore_eos=True, adapter=s.functions[fn]))
                    s.engine.prefill(rid)
                    generated += 1
                    s.left[rid] -= 1
                    max_batch = max(max_batch, sum(len(x.running) for x in served))
                    continue  # one iteration per turn
            active = [rid for rid in s.running if s.left[rid] > 0]
            if not active:
                continue
            s.engine.decode(active)
            decode_steps += 1
            batch_sum += len(active)
            generated += len(active)
            for rid in active:
                s.left[rid] -= 1
                if s.left[rid] == 0:
                    s.engine.release(rid)
                    s.free_blocks += s.running.pop(rid)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "tokens": generated, "tokens_per_s": generated / elapsed,
            "max_batch": max_batch, "mean_decode_batch": batch_sum / max(1, decode_steps),
            "decode_steps": decode_steps}


def throughput(base: Path, adapters: list[Path], merged: list[Path], args, rng, vocab) -> dict:
    functions = 4
    probe = TorchEngine(base, kv_capacity_bytes=1 << 20)
    probe.load()
    weight, per_token = probe.memory().weight_bytes, probe.memory().kv_bytes_per_token
    block_bytes = probe.cache.block_bytes
    adapter_bytes = sum(probe.load_adapter(f"p{i}", adapters[i]) for i in range(functions))
    probe.unload()
    budget = int(args.memory_factor * weight)
    shared_kv = budget - weight - adapter_bytes
    separate_kv = (budget - functions * weight) // functions
    if separate_kv <= 0:
        raise SystemExit(f"--memory-factor {args.memory_factor} leaves 4 separate models no KV")
    per_request_blocks = -(-(args.prompt_len + args.output_len) // 16)
    requests = [(f"r{i}", i % functions, prompt(rng, args.prompt_len, vocab))
                for i in range(args.requests)]
    result = {"functions": functions, "memory_budget_bytes": budget, "weight_bytes": weight,
              "adapter_bytes_total": adapter_bytes, "kv_bytes_per_token": per_token,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "requests": args.requests,
              "capacity_requests": {
                  "shared": shared_kv // block_bytes // per_request_blocks,
                  "separate": functions * (separate_kv // block_bytes // per_request_blocks)}}

    engine = TorchEngine(base, kv_capacity_bytes=shared_kv)
    engine.load()
    for i in range(functions):
        engine.load_adapter(f"f{i}", adapters[i])
    first_token(engine, "warm", requests[0][2], "f0")
    result["shared"] = serve([Served(engine, {i: f"f{i}" for i in range(functions)})], requests,
                             args.output_len)
    engine.unload()
    del engine
    gc.collect()

    engines = []
    for i in range(functions):
        e = TorchEngine(merged[i], kv_capacity_bytes=separate_kv)
        e.load()
        engines.append(e)
    first_token(engines[0], "warm", requests[0][2], None)
    result["separate"] = serve([Served(e, {i: None}) for i, e in enumerate(engines)], requests,
                               args.output_len)
    for e in engines:
        e.unload()
    result["tokens_per_s_ratio"] = result["shared"]["tokens_per_s"] / result["separate"]["tokens_per_s"]
    result["max_batch_ratio"] = result["shared"]["max_batch"] / result["separate"]["max_batch"]
    return result


# --- 5. what the profiler records ---------------------------------------------------------------

def profile_cost(base: Path, args) -> dict:
    from dataclasses import asdict

    from services.profiler.measure import ProfilePlan, _Ids, measure_lora

    engine = TorchEngine(base, kv_capacity_bytes=None)
    engine.load()
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    plan = ProfilePlan(max_batch=32, lora_ranks=tuple(args.profile_ranks))
    started = time.perf_counter()
    cost = measure_lora(engine, base, _Ids(vocab, args.seed), plan)
    elapsed = time.perf_counter() - started
    engine.unload()
    return {"plan": {"max_batch": plan.max_batch, "context": plan.lora_len, "passes": plan.passes,
                     "repeats": plan.repeats, "warmup": plan.warmup},
            "lora": asdict(cost), "seconds": elapsed}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "memory": Path("/proc/meminfo").read_text().splitlines()[0],
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", choices=SHAPES)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold-prompt-len", type=int, default=128)
    parser.add_argument("--cold-kv-tokens", type=int, default=4096)
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--memory-factor", type=float, default=5.0,
                        help="memory budget of the throughput part, in model weights")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default, the cores)")
    parser.add_argument("--profile-ranks", default="8,16,32")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.decode_batches = [int(b) for b in args.decode_batches.split(",")]
    args.profile_ranks = [int(r) for r in args.profile_ranks.split(",")]
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}")
    tune_cpu_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    base = ensure_model(ROOT / ".data", args.shape, args.shape)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    # The command as run (a caller's `flock` around it is not visible here: the machine's load
    # averages say how quiet the box was).
    result = {"command": ".venv/bin/python bench/lora.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "shape": args.shape, "rank": args.rank,
              "model": f"{args.shape} (shared.modelgen, random weights, "
                       f"{json.loads((base / 'config.json').read_text()).get('dtype')})"}
    with tempfile.TemporaryDirectory(prefix="slinfer-lora-bench-", dir=ROOT / ".data") as tmp:
        tmp = Path(tmp)
        n = 16 if "memory" in parts else 4
        adapters = [build_adapter(base, tmp / f"adapter-{i}", rank=args.rank, seed=100 + i)
                    for i in range(n)]
        merged = []
        if "cold" in parts or "throughput" in parts:
            count = 4 if "throughput" in parts else 1
            merged = [merged_model(base, adapters[i], tmp / f"merged-{i}") for i in range(count)]
        if "cold" in parts:
            result["cold_start"] = cold_start(base, adapters, merged[0], args, rng, vocab)
            print(json.dumps(result["cold_start"]["median"]), flush=True)
        if "memory" in parts:
            result["memory"] = memory(base, adapters)
            print(json.dumps({k: v for k, v in result["memory"].items() if k != "steps"}), flush=True)
        if "decode" in parts:
            result["decode"] = decode_cost(base, adapters, args, rng, vocab)
            print(json.dumps(result["decode"]["rows"]), flush=True)
        if "throughput" in parts:
            result["throughput"] = throughput(base, adapters, merged, args, rng, vocab)
            t = result["throughput"]
            print(json.dumps({"shared": t["shared"], "separate": t["separate"],
                              "ratios": [t["tokens_per_s_ratio"], t["max_batch_ratio"]]}), flush=True)
        if "profile" in parts:
            result["profile"] = profile_cost(base, args)
            print(json.dumps(result["profile"]["lora"]), flush=True)
    result["machine"]["load_average_after"] = os.getloadavg()
    out = args.out or ROOT / "bench" / "results" / f"lora_{args.shape}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
