"""What tracing costs: time to first token with every service exporting traces (and metrics)
over OTLP/HTTP to a local receiver, against the same stack with OTEL unset (no-op providers).

    .venv/bin/python bench/ops_overhead.py [--n 50] [--lengths 16 256] [--model-size tiny|small]
                                           [--rounds 1] [--control]

--model-size tiny (default) serves the demo model (~1.3M parameters: a prefill of 3-11 ms, far
below real serving); small serves a ~46M-parameter random-weight Llama (shared.modelgen "small";
a CPU prefill of 256 tokens ~0.12 s), a time to first token of a realistic order. Both are
profiled the same way before the stacks start (ProfilePlan(max_len=1024, max_batch=8)), so the
placer's SLO check uses a real profile. --control leaves OTEL unset on both stacks: an A/A run
that measures the noise floor of the comparison.

Two identical stacks run side by side (each its own nats-server, valkey, placer, node, gateway;
one with OTEL_* pointing at a receiver in its own process, every request sampled) and requests
alternate between them, off, on, off, on, ... so drift of the machine falls on both alike.
Each request is a streamed completion with max_tokens=2, sequential, warm (the cold start is
excluded). Per stack: median TTFT at the client, and median TTFT minus the engine's own prefill of
that request (reported by the node on the first token message), i.e. the path's overhead. The
added cost is the difference of medians and the median of per-pair differences (with a bootstrap
95% interval), of TTFT and of the path's overhead. --rounds R repeats it all with fresh stacks
and pools the pairs: two stack instances differ a little by themselves (see the A/A control),
and fresh pairs average that out. Writes bench/results/ops_overhead[_small][_control].json
(with every request's TTFT and prefill) and prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e_overhead import NAME, one_request, visible_prompts, watch_prefill  # noqa: E402
from services.stack import running_stack  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared.modelgen import ensure_demo_model, ensure_model  # noqa: E402


MODELS = {"tiny": ("tiny", NAME), "small": ("small", "small-llama")}  # --model-size: (shape, name)


async def measure(stacks: dict[str, tuple[str, str]], prompts: dict[int, str], n: int,
                  model: str) -> dict:
    prefill: dict[str, float] = {}
    conns = [await watch_prefill(nats_url, prefill) for _, nats_url in stacks.values()]
    out: dict = {"cold_start_ttft_ms": {}}
    async with httpx.AsyncClient(timeout=120) as client:
        for mode, (url, _) in stacks.items():
            _, cold, _ = await one_request(client, url, prompts[min(prompts)], model)
            out["cold_start_ttft_ms"][mode] = round(cold * 1e3, 1)
            for _ in range(3):  # warm both stacks before timing
                await one_request(client, url, prompts[max(prompts)], model)
        for length, prompt in prompts.items():
            rows: dict[str, list[tuple[float, float]]] = {mode: [] for mode in stacks}
            tokens = 0
            for i in range(n):
                order = list(stacks) if i % 2 == 0 else list(reversed(stacks))
                for mode in order:
                    rid, ttft, tokens = await one_request(client, stacks[mode][0], prompt, model)
                    await asyncio.sleep(0.02)  # let the token subscription catch up
                    rows[mode].append((ttft, prefill[rid]))
            out[length] = (rows, tokens)
    for nc in conns:
        await nc.close()
    return out


def ms(x: float) -> float:
    return round(x * 1e3, 2)


def bootstrap_median(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of `values`."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def summarize(rows: dict[str, list[tuple[float, float]]], tokens: int) -> dict:
    off, on = rows["off"], rows["on"]
    ttft_off, ttft_on = [t for t, _ in off], [t for t, _ in on]
    path_off, path_on = [t - p for t, p in off], [t - p for t, p in on]
    base = statistics.median(ttft_off)
    added = statistics.median(ttft_on) - base
    pairs = [b - a for a, b in zip(ttft_off, ttft_on)]
    paired = statistics.median(pairs)
    lo, hi = bootstrap_median(pairs)
    # The same without each request's engine prefill: immune to the two node processes' engines
    # running at slightly different speeds, which moves TTFT by more than tracing costs.
    path_pairs = [b - a for a, b in zip(path_off, path_on)]
    path_lo, path_hi = bootstrap_median(path_pairs)
    return {
        "prompt_tokens": tokens,
        "pairs": len(pairs),
        "ttft_ms_p50_off": ms(base),
        "ttft_ms_p50_on": ms(statistics.median(ttft_on)),
        "added_ms_p50": ms(added),
        "added_pct_of_ttft": round(100 * added / base, 2),
        "added_ms_paired_p50": ms(paired),
        "added_pct_paired": round(100 * paired / base, 2),
        "added_ms_paired_ci95": [ms(lo), ms(hi)],
        "added_path_ms_paired_p50": ms(statistics.median(path_pairs)),
        "added_path_ms_paired_ci95": [ms(path_lo), ms(path_hi)],
        "engine_prefill_ms_p50": ms(statistics.median([p for _, p in off + on])),
        "engine_prefill_ms_p50_off": ms(statistics.median([p for _, p in off])),
        "engine_prefill_ms_p50_on": ms(statistics.median([p for _, p in on])),
        "path_overhead_ms_p50_off": ms(statistics.median(path_off)),
        "path_overhead_ms_p50_on": ms(statistics.median(path_on)),
        "ttft_ms_p90_off": ms(statistics.quantiles(ttft_off, n=10)[-1]),
        "ttft_ms_p90_on": ms(statistics.quantiles(ttft_on, n=10)[-1]),
    }


def parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 256])
    p.add_argument("--control", action="store_true",
                   help="A/A control: leave OTEL unset on both stacks (measures the noise floor)")
    p.add_argument("--model-size", choices=sorted(MODELS), default="tiny",
                   help="tiny: the demo model; small: ~46M parameters, a realistic prefill time")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat with fresh stacks (each round --n pairs per length); pooled results")
    p.add_argument("--work-dir", help="keep servers' data and service logs here (default: a temp dir)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    shape, name = MODELS[args.model_size]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.work_dir or tmp)
        model_dir = Path(ensure_demo_model(data) if shape == "tiny" else ensure_model(data, shape, name))
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = visible_prompts(model_dir, tok, args.lengths)
        profile, _ = profile_model(model_dir, name, plan=ProfilePlan(max_len=1024, max_batch=8))
        n_params = parameters(model_dir)
        receiver = subprocess.Popen([sys.executable, "-m", "tests.ops.otlp_receiver"], cwd=ROOT,
                                    stdout=subprocess.PIPE, text=True)
        endpoint = receiver.stdout.readline().strip()
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        # Both stacks drop any OTEL_* of this shell; only "on" gets the exporter settings.
        # Keep-alive long: instances stay warm, only the first request is a cold start.
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        common = {"SLINFER_KEEP_ALIVE_S": "600"}
        rounds = []
        try:
            for r in range(args.rounds):
                with ExitStack() as stacks:  # leaving it stops both stacks, which flush their spans
                    off = stacks.enter_context(running_stack(data / f"r{r}" / "off", model_dir, common,
                                                             profile=profile, base_env=base, model=name))
                    on = stacks.enter_context(running_stack(data / f"r{r}" / "on", model_dir,
                                                            {**common, **({} if args.control else otel)},
                                                            profile=profile, base_env=base, model=name))
                    rounds.append(asyncio.run(measure({"off": (off.url, off.nats_url),
                                                       "on": (on.url, on.nats_url)}, prompts, args.n,
                                                      name)))
        finally:
            receiver.terminate()
            received = json.loads(receiver.communicate(timeout=30)[0].strip().splitlines()[-1])
    pooled = {n: ({mode: [row for raw in rounds for row in raw[n][0][mode]] for mode in ("off", "on")},
                  rounds[0][n][1]) for n in args.lengths}
    result = {"command": "python bench/ops_overhead.py " + " ".join(sys.argv[1:]), "n": args.n,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"),
              "model": {"size": args.model_size, "name": name,
                        "parameters": n_params},
              "engine_prefill_ms_profiled": {str(n): round(profile.prefill_s(n) * 1e3, 2)
                                             for n in args.lengths},
              "setup": "two stacks side by side, requests alternating; 'on' exports traces and metrics "
                       "over OTLP/HTTP (parentbased_always_on, default batch settings) to a receiver "
                       "process; 'off' has OTEL unset; both serve Prometheus /metrics",
              "rounds": args.rounds,
              "cold_start_ttft_ms": [raw["cold_start_ttft_ms"] for raw in rounds],
              "exported": {"spans": received["spans"], "services": received["services"],
                           "otlp_posts": received["exports"]},
              "rows": [summarize(*pooled[n]) for n in args.lengths],
              "per_round": [[{k: v for k, v in summarize(*raw[n]).items()
                              if k in ("prompt_tokens", "ttft_ms_p50_off", "added_ms_paired_p50",
                                       "added_path_ms_paired_p50", "engine_prefill_ms_p50_off",
                                       "engine_prefill_ms_p50_on")}
                             for n in args.lengths] for raw in rounds],
              # per request, in order: [TTFT ms, the engine's prefill ms]
              "raw_ms": {str(n): {mode: [[round(t * 1e3, 3), round(p * 1e3, 3)] for t, p in rows]
                                  for mode, rows in pooled[n][0].items()} for n in args.lengths}}
    if args.control:
        result["setup"] = "A/A control: both stacks with OTEL unset (the 'on' columns are a second 'off')"
    stem = "ops_overhead" + ("" if args.model_size == "tiny" else f"_{args.model_size}")
    out = ROOT / "bench" / "results" / f"{stem}{'_control' if args.control else ''}.json"
    summary = json.dumps({k: v for k, v in result.items() if k != "raw_ms"}, indent=2)
    raw = json.dumps(result["raw_ms"], separators=(",", ":"))  # one line
    out.write_text(f'{summary[:-2]},\n  "raw_ms": {raw}\n}}\n')
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
