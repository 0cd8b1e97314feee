"""What constrained decoding costs per token on this CPU: the torch engine's decode steps with
and without a JSON-Schema output grammar, on the default real model (SmolLM2-135M-Instruct) or a
random-weight shape of shared/modelgen (`--shape llama-3.2-1b`).

Three measurements:
- steps: decode steps of a batch of `--batches` requests on the same chat prompt, greedy, free
  (ignore_eos, so every step runs) against constrained by a schema that cannot be complete
  within `--tokens` tokens (an array of at least 1000 strings), so both run the same number of
  steps; free and constrained batches alternate, `--repeats` times each, and the median step
  time over all their steps (the first two of each run left out) is reported, with tokens/s.
- answer: one request answering with a small object (name, country, population) under its
  schema, to its end, against the same number of free tokens: tokens/s as a client sees them.
- mask: the grammar's own share, off the model: the constrained outputs replayed through a fresh
  matcher, timing the token mask (`allowed`: llguidance's bitmask, unpacked to a bool tensor)
  and the advance per token; and the one-off costs: llguidance's tokenizer (once per model and
  process), compiling a schema (once per schema: cached), a request's matcher (a copy).

    .venv/bin/python bench/constrained_decoding.py [--shape llama-3.2-1b] [--batches 1,8]

On a CPU shared with other work, OMP_NUM_THREADS=1 keeps torch's threads from waiting on each
other (two threads under a load of 5 made a decode step ~5x slower than one); the JSON records
the threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.gateway.tokenization import encode_chat  # noqa: E402
from services.node.engines import create_engine, tune_cpu_allocator  # noqa: E402
from services.node.engines import grammar as engine_grammar  # noqa: E402
from services.node.engines.base import SamplingParams  # noqa: E402
from shared.grammar import json_schema_grammar  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402

LONG = {"type": "object", "properties": {"fruits": {
    "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}},
    "required": ["fruits"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "name": {"type": "string"}, "country": {"type": "string"},
    "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
    "required": ["name", "country", "population"], "additionalProperties": False}
LONG_PROMPT = [{"role": "user", "content": "List as many fruits as you can, as JSON."}]
CITY_PROMPT = [{"role": "user", "content": "Describe Paris as JSON with its name, country and "
                                           "population."}]
WARMUP_STEPS = 2


def _run(engine, prompt: list[int], params: SamplingParams, batch: int, tag: str
         ) -> tuple[list[float], list[list[int]]]:
    """Prefill `batch` copies, then decode them together until all end: the step times and
    each request's output."""
    ids = [f"{tag}-{i}" for i in range(batch)]
    outputs = {}
    for rid in ids:
        engine.add_request(rid, prompt, params)
        outputs[rid] = [engine.prefill(rid).tokens[rid]]
    steps = []
    live = [rid for rid in ids if not engine.is_finished(rid)]
    while live:
        t = time.perf_counter()
        result = engine.decode(live)
        steps.append(time.perf_counter() - t)
        for rid, token in result.tokens.items():
            outputs[rid].append(token)
        live = [rid for rid in live if not engine.is_finished(rid)]
    for rid in ids:
        engine.release(rid)
    return steps, [outputs[rid] for rid in ids]


def bench_steps(engine, prompt: list[int], eos: tuple[int, ...], tokens: int, batch: int,
                repeats: int) -> tuple[dict, list[list[int]]]:
    free = SamplingParams(max_tokens=tokens, eos_token_ids=eos, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, eos_token_ids=eos,
                                 grammar=json_schema_grammar(LONG))
    times: dict[str, list[float]] = {"free": [], "constrained": []}
    outputs: list[list[int]] = []
    _run(engine, prompt, constrained, batch, "warm")  # compiles the grammar, warms the caches
    for r in range(repeats):
        order = [("free", free), ("constrained", constrained)]
        for kind, params in order if r % 2 == 0 else order[::-1]:
            steps, outs = _run(engine, prompt, params, batch, f"{kind}-{r}")
            times[kind] += steps[WARMUP_STEPS:]
            if kind == "constrained":
                outputs += outs
    result = {}
    for kind, steps in times.items():
        step = statistics.median(steps)
        result[kind] = {"step_s_median": step, "step_s_mean": statistics.fmean(steps),
                        "tokens_per_s": batch / step, "steps": len(steps)}
    result["overhead_per_token_s"] = (result["constrained"]["step_s_median"]
                                      - result["free"]["step_s_median"]) / batch
    result["overhead_pct"] = 100 * (result["constrained"]["step_s_median"]
                                    / result["free"]["step_s_median"] - 1)
    return result, outputs


def bench_answer(engine, tokenizer, eos: tuple[int, ...], repeats: int) -> dict:
    """A whole constrained answer against as many free tokens, as tokens/s end to end."""
    prompt = encode_chat(tokenizer, CITY_PROMPT)
    constrained = SamplingParams(max_tokens=256, eos_token_ids=eos,
                                 grammar=json_schema_grammar(CITY))
    walls = {"free": [], "constrained": []}
    text, n = "", 0
    for r in range(repeats):
        t = time.perf_counter()
        _, (out,) = _run(engine, prompt, constrained, 1, f"city-{r}")
        walls["constrained"].append(time.perf_counter() - t)
        n = len(out)
        text = tokenizer.decode(out, skip_special_tokens=True)
        free = SamplingParams(max_tokens=n, eos_token_ids=eos, ignore_eos=True)
        t = time.perf_counter()
        _run(engine, prompt, free, 1, f"cityfree-{r}")
        walls["free"].append(time.perf_counter() - t)
    out = {"tokens": n, "answer": text}
    for kind, ws in walls.items():
        out[kind] = {"wall_s_median": statistics.median(ws),
                     "tokens_per_s": n / statistics.median(ws)}
    json.loads(text)  # the answer parses (the grammar's promise)
    return out


def bench_mask(model_dir: Path, vocab: int, eos: tuple[int, ...],
               outputs: list[list[int]]) -> dict:
    """The grammar alone: one-off costs, then each token's mask and advance, replayed."""
    engine_grammar._tokenizer.cache_clear()
    engine_grammar._initial.cache_clear()
    grammars = engine_grammar.Grammars(model_dir, vocab)
    t = time.perf_counter()
    engine_grammar._tokenizer(str(model_dir), vocab)
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    engine_grammar._initial(str(model_dir), vocab, json_schema_grammar(LONG))
    compile_s = time.perf_counter() - t
    copies, masks, advances = [], [], []
    for output in outputs:
        t = time.perf_counter()
        state = grammars.start(json_schema_grammar(LONG), eos, [])
        copies.append(time.perf_counter() - t)
        for token in output:
            t = time.perf_counter()
            allowed = state.allowed()
            masks.append(time.perf_counter() - t)
            assert allowed[token]
            t = time.perf_counter()
            state.advance(token)
            advances.append(time.perf_counter() - t)
    masks.sort()
    return {"tokenizer_build_s": tokenizer_s, "schema_compile_s": compile_s,
            "matcher_copy_s_median": statistics.median(copies),
            "mask_s_median": statistics.median(masks),
            "mask_s_p90": masks[int(0.9 * (len(masks) - 1))],
            "advance_s_median": statistics.median(advances), "tokens": len(masks)}


def machine() -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "llguidance": version("llguidance"),
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "load_average_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("smollm2", *SHAPES), default="smollm2",
                   help="smollm2: the default real model (shared/default_model.py)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per run (steps)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    allocator = tune_cpu_allocator()
    if args.shape == "smollm2":
        from shared.default_model import cache_dir, ensure_default_model

        model_dir = ensure_default_model(cache_dir())
        model = "SmolLM2-135M-Instruct (shared/default_model.py), float32"
    else:
        model_dir = ensure_model(ROOT / ".data", args.shape, args.shape)
        model = f"{args.shape} (shared.modelgen, random weights, its own BPE tokenizer)"
    out = args.out or ROOT / "bench/results" / (
        "constrained_decoding.json" if args.shape == "smollm2"
        else f"constrained_decoding_{args.shape}.json")
    threads = os.environ.get("OMP_NUM_THREADS")
    command = " ".join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", *sys.argv])
    report = {"command": command, "machine": machine(), "model": model,
              "tokens": args.tokens, "repeats": args.repeats,
              "glibc_allocator_tuned": allocator, "schemas": {"steps": LONG, "answer": CITY}}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine = create_engine("torch", model_dir)
    engine.load()
    try:
        eos = engine.eos_token_ids
        vocab = engine.config.vocab_size
        prompt = encode_chat(tokenizer, LONG_PROMPT)
        steps, outputs = {}, []
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"steps, batch {batch} ...", file=sys.stderr, flush=True)
            steps[str(batch)], outs = bench_steps(engine, prompt, eos, args.tokens, batch,
                                                  args.repeats)
            outputs += outs
        report["steps"] = steps
        print("answer ...", file=sys.stderr, flush=True)
        report["answer"] = bench_answer(engine, tokenizer, eos, args.repeats)
    finally:
        engine.unload()
    print("mask ...", file=sys.stderr, flush=True)
    report["mask"] = bench_mask(model_dir, vocab, eos, outputs)
    report["vocab_size"] = vocab
    report["machine"]["load_average_after"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("steps", "answer", "mask")}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
