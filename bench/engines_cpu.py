"""The engines on this CPU against Hugging Face `generate`: the tiny model, or a real shape.

For each engine (torch, openvino, vllm; plus openvino at its default precision): prefill of one
request of `--prompt-len` tokens (its engine-side time to first token), and one decode step of a
batch of `--batches` requests whose context is about `--prompt-len` tokens (time per output
token at that batch); the median of `--repeats` timed runs after warm-up, as seconds and
tokens/s (prefill: prompt tokens/s; decode: batch/step time). The baseline is Hugging Face
`generate` (KV cache on, greedy) on the same batches: its prefill is a `max_new_tokens=1` call,
its decode step the extra time of `max_new_tokens=G` over G-1 tokens. Engines are driven through
the protocol in this process (vllm: through its child process, one pipe round trip per call,
~0.05 ms). Everything runs under the fixed glibc allocator thresholds that `create_engine` sets
(services/node/engines/__init__.py). Each engine's load is timed too, with how it loaded
(`load_info`); OpenVINO's is loaded twice, with its compiled-model cache emptied first (cold)
and then filled (warm).

`--shape tiny` (default) runs every engine in float32, the precision the correctness tests
compare at. A real shape (`--shape llama-3.2-1b`, built under .data/models, bf16 on disk) runs
each engine at its serving precision: torch and vllm in the checkpoint's bf16, openvino with
bf16 compute and KV cache, and openvino at the plugin's defaults.

    .venv/bin/python bench/engines_cpu.py [--shape llama-3.2-1b --engines torch,openvino]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.node.engines import create_engine, tune_cpu_allocator  # noqa: E402
from services.node.engines.base import SamplingParams  # noqa: E402
from shared.modelgen import SHAPES, ensure_demo_model, ensure_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 30)
# key -> (engine, dtype); the tiny model compares engines in float32, real shapes in bf16.
RUNS = {
    "tiny": {"torch": ("torch", "float32"), "openvino": ("openvino", "float32"),
             "openvino-default": ("openvino", None), "vllm": ("vllm", "float32")},
    "real": {"torch": ("torch", None), "openvino": ("openvino", "bfloat16"),
             "openvino-default": ("openvino", None), "vllm": ("vllm", "bfloat16")},
}


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _kv_bytes_per_token_f32(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def _cold_openvino_load(model_dir: Path, dtype: str | None, kv_bytes: int) -> dict:
    """One OpenVINO load with its compiled-model cache emptied first: the compile it pays."""
    import shutil

    from services.node.engines.openvino_engine import ensure_ir

    shutil.rmtree(ensure_ir(model_dir) / "compiled", ignore_errors=True)
    engine = create_engine("openvino", model_dir, dtype=dtype, kv_capacity_bytes=kv_bytes)
    started = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - started
    engine.unload()
    return {"load_s": load_s, "load_info": dict(engine.load_info)}


def _load_info(engine) -> dict:
    info = getattr(engine, "load_info", None)
    if info is None and engine.name == "vllm":
        info = {k: engine.info.get(k) for k in ("load_format", "build_s", "weights")}
    return dict(info or {})


def bench_engine(name: str, model_dir: Path, dtype: str | None, prompt_len: int, repeats: int,
                 vocab: int, batches: tuple[int, ...]) -> dict:
    rng = random.Random(0)
    tokens = (max(batches) + 2) * (prompt_len + repeats + 64)
    kv_bytes = tokens * _kv_bytes_per_token_f32(model_dir)
    cold = _cold_openvino_load(model_dir, dtype, kv_bytes) if name == "openvino" else None
    engine = create_engine(name, model_dir, dtype=dtype, kv_capacity_bytes=kv_bytes)
    started = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - started
    n = 0

    def new_id() -> str:
        nonlocal n
        n += 1
        return f"b{n}"

    def prefill_once() -> float:
        rid = new_id()
        engine.add_request(rid, _prompt(rng, prompt_len, vocab), GREEDY)
        t = time.perf_counter()
        engine.prefill(rid)
        dt = time.perf_counter() - t
        engine.release(rid)
        return dt

    try:
        for _ in range(3):
            prefill_once()  # warm-up
        prefill = statistics.median(prefill_once() for _ in range(repeats))
        decode = {}
        for batch in batches:
            rids = [new_id() for _ in range(batch)]
            for rid in rids:
                engine.add_request(rid, _prompt(rng, prompt_len, vocab), GREEDY)
                engine.prefill(rid)
            steps = []
            for i in range(repeats + 3):
                t = time.perf_counter()
                result = engine.decode(rids)
                steps.append(time.perf_counter() - t)
                assert len(result.tokens) == batch
            for rid in rids:
                engine.release(rid)
            step = statistics.median(steps[3:])  # after 3 warm-up steps
            decode[str(batch)] = {"step_s": step, "tokens_per_s": batch / step}
        memory = engine.memory()
    finally:
        engine.unload()
    result = {"load_s": load_s, "load_info": _load_info(engine), "prefill_s": prefill,
              "prefill_tokens_per_s": prompt_len / prefill, "decode": decode,
              "kv_bytes_per_token": memory.kv_bytes_per_token,
              "weight_bytes": memory.weight_bytes}
    if cold is not None:
        result["cold_compile"] = cold
    return result


def bench_hf(model_dir: Path, prompt_len: int, repeats: int, vocab: int,
             batches: tuple[int, ...], gen: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype="auto").eval()
    rng = random.Random(0)

    def generate(batch: int, new: int) -> float:
        ids = torch.tensor([_prompt(rng, prompt_len, vocab) for _ in range(batch)])
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=2)
        return time.perf_counter() - t

    for _ in range(2):
        generate(1, 2)
    prefill = statistics.median(generate(1, 1) for _ in range(repeats))
    decode = {}
    for batch in batches:
        one = statistics.median(generate(batch, 1) for _ in range(repeats))
        many = statistics.median(generate(batch, gen) for _ in range(repeats))
        step = max(many - one, 1e-9) / (gen - 1)
        decode[str(batch)] = {"step_s": step, "tokens_per_s": batch / step}
    return {"prefill_s": prefill, "prefill_tokens_per_s": prompt_len / prefill, "decode": decode,
            "note": f"generate(max_new_tokens=1) for prefill; (t({gen}) - t(1)) / {gen - 1} "
                    "for a decode step"}


def machine() -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break

    def version(module: str, python: str | None = None) -> str:
        code = f"import {module} as m; print(m.__version__)"
        if python is None:
            try:
                return __import__(module).__version__
            except ImportError:
                return ""
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else ""

    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": version("torch"),
            "transformers": version("transformers"), "openvino_genai": version("openvino_genai"),
            "vllm": version("vllm", str(ROOT / ".venv-vllm" / "bin" / "python")),
            "load_average_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=SHAPES)
    p.add_argument("--out", type=Path, help="default: bench/results/engines_cpu.json (tiny), "
                   "engines_cpu_<shape>.json otherwise; one run's engines are merged into it")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--engines", default="hf,torch,openvino,openvino-default,vllm")
    args = p.parse_args(argv)
    allocator = tune_cpu_allocator()  # what create_engine does; HF runs under it too
    os.environ.setdefault("SLINFER_OPENVINO_CACHE", str(ROOT / ".data" / "openvino"))
    if args.shape == "tiny":
        model_dir = ensure_demo_model(Path(tempfile.mkdtemp(prefix="slinfer-bench-")))
    else:
        model_dir = ensure_model(ROOT / ".data", args.shape, args.shape)
    out = args.out or ROOT / "bench/results" / (
        "engines_cpu.json" if args.shape == "tiny" else f"engines_cpu_{args.shape}.json")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    batches = tuple(int(b) for b in args.batches.split(","))
    previous = json.loads(out.read_text()) if out.exists() and args.shape != "tiny" else {}
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": machine(), "model": f"{args.shape} (shared.modelgen, random weights, "
              f"{config.get('dtype') or config.get('torch_dtype')} on disk)",
              "prompt_len": args.prompt_len, "repeats": args.repeats, "batches": batches,
              "glibc_allocator_tuned": allocator, "results": previous.get("results", {})}
    runs = RUNS["tiny" if args.shape == "tiny" else "real"]
    for key in args.engines.split(","):
        print(f"benchmarking {key} ...", file=sys.stderr, flush=True)
        if key == "hf":
            result = bench_hf(model_dir, args.prompt_len, args.repeats, vocab, batches)
        else:
            name, dtype = runs[key]
            result = bench_engine(name, model_dir, dtype, args.prompt_len, args.repeats, vocab,
                                  batches)
            result["dtype"] = dtype or "engine default"
        result["command"] = report["command"]
        result["load_average_before"] = report["machine"]["load_average_before"]
        report["results"][key] = result
        print(json.dumps({key: result}), file=sys.stderr, flush=True)
    report["machine"]["load_average_after"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
