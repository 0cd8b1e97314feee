"""The Azure Functions trace replayed on the real stack: 16 models on 2 CPU nodes, with and
without chunked prefill and predictive pre-warming (issue 26).

    .venv/bin/python bench/trace_replay.py [--duration 300] [--rps 0.4] [--seed 0]
        [--configs base chunked prewarm both] [--out bench/results/trace_replay.json]

The stack is the one `slinfer up` runs (`services.stack.running_stack`: nats-server, valkey,
placer, two CPU node workers, gateway), serving 16 models registered under their own names,
each the `small` shape (46M parameters, random weights, torch engine) from one directory, with
one profile measured once and stored for each. Arrivals are the simulator's functions workload
(`sim.workload.build_workload(arrivals="functions")`: one Azure Functions 2019 function per
model, the minute's count at Poisson instants, rescaled to --rps) and its lengths come from the
Azure LLM 2023 trace, capped for a CPU (prompts at --max-input, outputs at --max-output tokens).
Each request is sent at its arrival time (open loop) as a streaming completion that asks for
exactly its output length (`ignore_eos`).

Per configuration: SLO attainment (TTFT and mean TPOT within SLINFER's §IX-A SLO of the prompt's
length, the `standard` class; a failed request misses), TTFT p50/p99, and the cold starts: the
requests whose node had to load their instance (the node's request span says so; every service
exports its spans to a receiver here). Configurations: `base` (the defaults: whole prefills, the
fixed 1 s keep-alive), `chunked` (SLINFER_PREFILL_CHUNK_TOKENS=64), `prewarm` (SLINFER_PREWARM
with 1 s idle-time bins: the trace is minutes long, the paper's 1-minute bins would learn
nothing) and `both`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e_overhead import prompt_of  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from services.stack import running_stack, store_profile  # noqa: E402
from shared.core.types import slo_for_class  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402
from sim.workload import Arrival, LengthSampler, build_workload  # noqa: E402

NAME = "replay-00"
CONFIGS = {
    "base": {},
    "chunked": {"SLINFER_PREFILL_CHUNK_TOKENS": "64"},
    "prewarm": {"SLINFER_PREWARM": "1", "SLINFER_PREWARM_BIN_S": "1"},
    "both": {"SLINFER_PREFILL_CHUNK_TOKENS": "64", "SLINFER_PREWARM": "1",
             "SLINFER_PREWARM_BIN_S": "1"},
}
OUT = ROOT / "bench" / "results" / "trace_replay.json"


@dataclass
class Sent:
    arrival: Arrival
    status: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0
    error: str = ""

    def met(self) -> bool:
        if self.ttft_s is None or self.tokens < self.arrival.output_len:
            return False
        slo = slo_for_class("standard", self.arrival.input_len)
        tpot = (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0
        return self.ttft_s <= slo.ttft_s and tpot <= slo.tpot_s


def workload(args: argparse.Namespace, names: list[str]) -> list[Arrival]:
    arrivals = build_workload(names, {n: 1024 for n in names}, args.duration, args.rps, args.seed,
                              LengthSampler.from_csv(), arrivals="functions")
    return [replace(a, input_len=min(a.input_len, args.max_input),
                    output_len=max(1, min(a.output_len, args.max_output))) for a in arrivals]


async def send(client: httpx.AsyncClient, url: str, prompt: str, sent: Sent) -> None:
    body = {"model": sent.arrival.model, "prompt": prompt, "max_tokens": sent.arrival.output_len,
            "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            sent.status = r.status_code
            if r.status_code != 200:
                sent.error = (await r.aread()).decode(errors="replace")[:200]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and sent.ttft_s is None:
                    sent.ttft_s = time.monotonic() - start
                if chunk.get("usage"):
                    sent.tokens = chunk["usage"]["completion_tokens"]
        sent.total_s = time.monotonic() - start
    except Exception as exc:
        sent.error = f"{type(exc).__name__}: {exc}"


async def replay(url: str, arrivals: list[Arrival], prompts: dict[int, str]) -> list[Sent]:
    sent = [Sent(a) for a in arrivals]
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        t0 = time.monotonic()

        async def at(s: Sent) -> None:
            await asyncio.sleep(max(0.0, t0 + s.arrival.time - time.monotonic()))
            await send(client, url, prompts[s.arrival.input_len], s)
        await asyncio.gather(*(at(s) for s in sent))
    return sent


def cold_starts(spans_file: Path) -> int:
    n = 0
    for line in spans_file.read_text().splitlines():
        span = json.loads(line)
        if span["service"] == "slinfer-node" and span["name"] == "node.request" \
                and span["attributes"].get("slinfer.cold_start"):
            n += 1
    return n


def summarize(sent: list[Sent], colds: int, prewarms: int) -> dict:
    ttfts = sorted(s.ttft_s for s in sent if s.ttft_s is not None)
    failed = [s for s in sent if s.ttft_s is None or s.tokens < s.arrival.output_len]
    pct = (lambda q: round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3)) if ttfts else (lambda q: None)
    return {"requests": len(sent), "slo_met": sum(s.met() for s in sent),
            "attainment": round(sum(s.met() for s in sent) / len(sent), 4),
            "failed": len(failed), "failures": sorted({f"{s.status}: {s.error[:80]}" for s in failed})[:5],
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None, "ttft_p99_s": pct(0.99),
            "cold_starts": colds, "prewarms": prewarms}


def run_config(name: str, args, data: Path, model_dir: Path, profile, names, arrivals, prompts) -> dict:
    dump = data / f"spans-{name}.jsonl"
    receiver = subprocess.Popen([sys.executable, "-m", "tests.ops.otlp_receiver", "0", str(dump)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
    endpoint = receiver.stdout.readline().strip()
    env = {**CONFIGS[name], "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp",
           "OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    try:
        with running_stack(data / f"stack-{name}", model_dir, env, base_env=base, profile=profile,
                           model=NAME, nodes=2) as stack:
            register(stack, model_dir, profile, names[1:])
            sent = asyncio.run(replay(stack.url, arrivals, prompts))
            time.sleep(8)  # the last spans' export, before the stack stops
            prewarms = stack.log("placer").count("pre-warmed ")
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)
    return summarize(sent, cold_starts(dump), prewarms)


def register(stack, model_dir: Path, profile, names: list[str]) -> None:
    """The other models: the same files under their own names, each with the profile stored
    first (so it is ready at once, as a model `slinfer up` profiled before)."""
    for name in names:
        store_profile(stack.redis_url, replace(profile, model=name))
        r = httpx.post(f"{stack.url}/admin/models", headers=stack.auth, timeout=30, json={
            "name": name, "path": str(model_dir), "engine": "torch", "public": True})
        r.raise_for_status()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--rps", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--work-dir", help="keep servers' data and service logs here (default: temp)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from transformers import AutoTokenizer

    names = [f"replay-{i:02d}" for i in range(args.models)]
    arrivals = workload(args, names)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.work_dir or tmp)
        model_dir = Path(ensure_model(data, "small", NAME))
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = {n: prompt_of(tok, n) for n in sorted({a.input_len for a in arrivals})}
        profile, _ = profile_model(model_dir, NAME, plan=ProfilePlan(max_len=1024, max_batch=16))
        results = {}
        for name in args.configs:
            results[name] = run_config(name, args, data, model_dir, profile, names, arrivals, prompts)
            print(name, json.dumps(results[name]), flush=True)
    out = {"command": "python bench/trace_replay.py " + " ".join(sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
           "date": time.strftime("%Y-%m-%d"), "duration_s": args.duration, "rps": args.rps,
           "seed": args.seed, "models": args.models, "requests": len(arrivals),
           "max_input": args.max_input, "max_output": args.max_output, "results": results}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
