"""Soak: the whole stack under mixed traffic for 10 minutes, every process's memory sampled.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 4] [--warmup-s 60] [--shape small]

Starts the stack as real processes (`services.stack.running_stack`: nats-server, valkey, placer,
one CPU node worker, the gateway) serving a random-weight model of `shared.modelgen` (`small` by
default), then runs --clients concurrent loops of mixed requests for --minutes: streaming and
plain completions and chat completions of random lengths, clients that hang up mid-stream, bad
requests (400) and unknown models (404) - the paths where a service could keep something per
request and never let it go. Every 15 s it reads each process's resident memory (VmRSS from
/proc, summed over the process and its descendants). A service whose memory is bounded levels off
after the warm-up (the engine's KV cache, allocator arenas and caches fill once); a leak grows with
the number of requests. Writes bench/results/soak.json: the samples, RSS after the warm-up and at
the end per process, the growth per 1,000 requests, and what the requests got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.traffic import prompt, sampler, send  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from services.stack import running_stack  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

OUT = ROOT / "bench" / "results" / "soak.json"
SAMPLE_S = 15.0
ERRORS: dict[str, str] = {}  # outcome -> the first error message seen with it


async def one_request(client: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """One request of a random kind; returns how it ended (for the tally)."""
    kind = rng.choices(["stream", "plain", "chat", "hangup", "bad", "unknown"],
                       weights=[4, 3, 3, 2, 1, 1])[0]
    body = {"model": model, "prompt": prompt(rng), "max_tokens": rng.randint(4, 48),
            "temperature": 0.0}
    if kind == "bad":
        body["max_tokens"] = -1
    if kind == "unknown":
        body["model"] = "no-such-model"
    if kind == "chat":
        body = {"model": model, "max_tokens": body["max_tokens"],
                "messages": [{"role": "user", "content": body["prompt"]}]}
        answer = await send(client, kind, "/v1/chat/completions", body, stream=False)
    elif kind in ("stream", "hangup"):
        answer = await send(client, kind, "/v1/completions", {**body, "stream": True},
                            stream=True, hang_up_after=2 if kind == "hangup" else None)
    else:
        answer = await send(client, kind, "/v1/completions", body, stream=False)
    if answer.error_message is not None:
        ERRORS.setdefault(answer.outcome, answer.error_message[:300])
    return answer.outcome


async def client_loop(url: str, model: str, seed: int, until: float, tally: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            tally[await one_request(client, model, rng)] += 1


async def soak(url: str, model: str, pids: dict[str, int], args: argparse.Namespace) -> dict:
    tally: Counter = Counter()
    samples: list[dict] = []
    started = time.monotonic()
    until = started + args.warmup_s + args.minutes * 60
    await asyncio.gather(sampler(lambda: pids, lambda: sum(tally.values()), until, samples,
                                 started, SAMPLE_S),
                         *[client_loop(url, model, i, until, tally) for i in range(args.clients)])
    return {"samples": samples, "outcomes": dict(sorted(tally.items())), "errors": dict(ERRORS)}


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """Per process: RSS after the warm-up, at the end and at its peak, and the median of the
    first and last thirds of the measured samples. The node's RSS swings by hundreds of MB as KV
    caches are resized and instances come and go, so the trend is judged on the thirds' medians
    (growth per 1,000 requests between them), not on two single samples."""
    measured = [s for s in samples if s["t_s"] >= warmup_s]
    third = max(1, len(measured) // 3)
    first, last = measured[:third], measured[-third:]
    requests = max(1, statistics.median(s["requests"] for s in last)
                   - statistics.median(s["requests"] for s in first))
    out = {}
    for name in samples[-1]["rss_mb"]:
        early = statistics.median(s["rss_mb"][name] for s in first)
        late = statistics.median(s["rss_mb"][name] for s in last)
        out[name] = {"after_warmup_mb": measured[0]["rss_mb"][name],
                     "end_mb": samples[-1]["rss_mb"][name],
                     "max_mb": max(s["rss_mb"][name] for s in samples),
                     "first_third_median_mb": early, "last_third_median_mb": late,
                     "growth_mb_per_1000_requests": round((late - early) * 1000 / requests, 2)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="measured time after the warm-up")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--shape", default="small")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        name = f"{args.shape}-soak"
        model_dir = Path(ensure_model(data, args.shape, name))
        profile, _ = profile_model(model_dir, name, plan=ProfilePlan(max_len=1024, max_batch=16))
        with running_stack(data / "stack", model_dir, profile=profile, model=name) as stack:
            pids = stack.pids()
            run = asyncio.run(soak(stack.url, name, pids, args))
    result = {
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        "model": {"shape": args.shape, "engine": "torch", "node": "1 CPU node"},
        "minutes": args.minutes, "warmup_s": args.warmup_s, "clients": args.clients,
        "requests": run["samples"][-1]["requests"],
        "rss": summarize(run["samples"], args.warmup_s),
        **run,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("requests", "rss", "outcomes", "errors")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
