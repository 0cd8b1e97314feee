"""Peak memory and time of one torch-engine decode step at batch 32 on a real-size model.

Two batches of 32 requests on `--model` (default: the llama-3.2-1b shape, bfloat16):
* `uniform`: 32 prompts of `--prompt-len` tokens, each prefilled for real;
* `ragged`: 31 such requests plus one whose context is `--long-len` tokens. Its K/V is written
  straight into the cache (random values) instead of a real prefill, which would take minutes
  on two cores; the decode step that follows is the real one, and what it allocates depends on
  the lengths, not on the values.

For each: the process's RSS before the steps, the peak RSS during `--steps` decode steps (VmHWM,
reset through /proc/self/clear_refs before them), the peak over the before value (what the step
allocates for itself), and the median step time. Run it before and after a change to compare.

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/torch_decode_memory.py --label after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.node.engines import create_engine  # noqa: E402
from services.node.engines.base import SamplingParams  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 30)
BATCH = 32


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _fill_synthetic(engine, rid: str, length: int, vocab: int) -> None:
    """A request whose first `length` tokens have (random) K/V in the cache, as after a prefill."""
    engine.add_request(rid, [3 + i % (vocab - 3) for i in range(length + 1)], GREEDY)
    cache = engine.cache
    cache.reserve({rid: length})
    slots = cache.slots(rid, 0, length)
    for layer in range(cache.num_layers):
        kv = torch.randn(length, cache.n_kv_heads, cache.head_dim, dtype=cache.dtype)
        cache.write(layer, slots, kv, kv)
    cache.set_length(rid, length)
    engine.requests[rid].computed = length


def measure(engine, rids: list[str], steps: int) -> dict:
    engine.decode(rids)  # warm-up
    before = _status_kb("VmRSS")
    _reset_peak()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.decode(rids)
        times.append(time.perf_counter() - started)
    peak = _status_kb("VmHWM")
    return {"rss_before_mb": before / 1024, "peak_rss_mb": peak / 1024,
            "peak_over_before_mb": (peak - before) / 1024, "step_s": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model directory (default: build llama-3.2-1b "
                   "under .data/models)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--label", default="run")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/torch_decode_memory.json")
    args = p.parse_args(argv)
    model_dir = args.model or ensure_model(ROOT / ".data", "llama-3.2-1b", "llama-3.2-1b")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens = BATCH * (args.prompt_len + 64) + args.long_len + 64
    engine = create_engine("torch", model_dir)
    engine.load()
    engine.resize_kv(tokens * engine.memory().kv_bytes_per_token)
    result = {"label": args.label, "model": str(model_dir), "dtype": str(engine.dtype),
              "batch": BATCH, "prompt_len": args.prompt_len, "long_len": args.long_len,
              "torch_threads": torch.get_num_threads()}
    rids = [f"u{i}" for i in range(BATCH)]
    for i, rid in enumerate(rids):
        engine.add_request(rid, [3 + (i * 7 + j) % (vocab - 3) for j in range(args.prompt_len)],
                           GREEDY)
        engine.prefill(rid)
    result["uniform"] = measure(engine, rids, args.steps)
    engine.release(rids[-1])
    _fill_synthetic(engine, "long", args.long_len, vocab)
    result["ragged"] = measure(engine, rids[:-1] + ["long"], args.steps)
    engine.unload()
    print(json.dumps(result, indent=2))
    runs = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs[args.label] = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                        "cpu_count": os.cpu_count(), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
