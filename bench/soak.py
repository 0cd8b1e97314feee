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

from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from services.stack import running_stack  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

OUT = ROOT / "bench" / "results" / "soak.json"
WORDS = ("the serverless cluster shares every node at token granularity while each model keeps "
         "its latency objective and the scheduler moves requests between instances").split()
SAMPLE_S = 15.0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                children = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo.extend(int(c) for c in children)
        except OSError:
            pass
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and everything it started."""
    total = 0
    for p in _descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 400)))


ERRORS: dict[str, str] = {}  # outcome -> the first error message seen with it


def _ended(kind: str, r: httpx.Response) -> str:
    outcome = f"{kind} {r.status_code}"
    if r.status_code >= 400 and outcome not in ERRORS:
        try:
            ERRORS[outcome] = r.json()["error"]["message"][:300]
        except (ValueError, KeyError, TypeError, httpx.ResponseNotRead):
            ERRORS[outcome] = "(no JSON error body)"
    return outcome


async def one_request(client: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """One request of a random kind; returns how it ended (for the tally)."""
    kind = rng.choices(["stream", "plain", "chat", "hangup", "bad", "unknown"],
                       weights=[4, 3, 3, 2, 1, 1])[0]
    body = {"model": model, "prompt": _prompt(rng), "max_tokens": rng.randint(4, 48),
            "temperature": 0.0}
    if kind == "bad":
        body["max_tokens"] = -1
    if kind == "unknown":
        body["model"] = "no-such-model"
    if kind == "chat":
        body = {"model": model, "max_tokens": body["max_tokens"],
                "messages": [{"role": "user", "content": body["prompt"]}]}
        return _ended("chat", await client.post("/v1/chat/completions", json=body))
    if kind in ("stream", "hangup"):
        body["stream"] = True
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                return _ended(kind, r)
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data:")
                if kind == "hangup" and chunks >= 2:
                    return f"hangup {r.status_code}"  # leaving the block closes the connection
            return f"{kind} {r.status_code}"
    return _ended(kind, await client.post("/v1/completions", json=body))


async def client_loop(url: str, model: str, seed: int, until: float, tally: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            try:
                tally[await one_request(client, model, rng)] += 1
            except httpx.HTTPError as e:
                tally[f"client error {type(e).__name__}"] += 1


async def sampler(pids: dict[str, int], until: float, samples: list[dict], tally: Counter,
                  started: float) -> None:
    while True:
        samples.append({"t_s": round(time.monotonic() - started, 1),
                        "requests": sum(tally.values()),
                        "rss_mb": {n: round(rss_bytes(p) / 2**20, 1) for n, p in pids.items()}})
        if time.monotonic() >= until:
            return
        await asyncio.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))


async def soak(url: str, model: str, pids: dict[str, int], args: argparse.Namespace) -> dict:
    tally: Counter = Counter()
    samples: list[dict] = []
    started = time.monotonic()
    until = started + args.warmup_s + args.minutes * 60
    await asyncio.gather(sampler(pids, until, samples, tally, started),
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
