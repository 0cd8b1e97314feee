"""End-to-end overhead of the request path: the gateway's time to first token (streaming, through
JetStream, the placer, the node worker and back) against the engine's own prefill time for the
same prompt tokens. Median of N warm requests each (the cold start is reported on its own).

    .venv/bin/python bench/e2e_overhead.py [--n 50] [--lengths 16 256 1024]

Writes bench/results/e2e_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher import spawn, stop_child  # noqa: E402
from services.node.engines import SamplingParams, create_engine  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402
from shared.servers import free_port, start_nats, start_redis  # noqa: E402

NAME = "tiny-llama"


def prompt_ids(tokenizer, length: int) -> tuple[str, list[int]]:
    """A text prompt whose tokenization (with BOS, as the gateway does it) has `length` tokens."""
    words = " ".join(f"word{i}" for i in range(length * 2))
    ids = tokenizer(words)["input_ids"][:length]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, tokenizer(text)["input_ids"]


def engine_prefill_s(model_dir: Path, ids: list[int], n: int) -> list[float]:
    engine = create_engine("torch", model_dir)
    engine.load()
    out = []
    for k in range(n + 3):
        rid = f"b{k}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.prefill(rid)
        elapsed = time.perf_counter() - start
        engine.release(rid)
        if k >= 3:  # warm-up
            out.append(elapsed)
    engine.unload()
    return out


def gateway_ttft_s(url: str, prompt: str) -> float:
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def start_stack(data: Path, model_dir: Path) -> tuple[str, list]:
    import asyncio

    from redis.asyncio import Redis

    from shared.cluster import save_profile

    nats, redis = start_nats(data / "nats"), start_redis(data / "redis")
    profile, _ = profile_model(model_dir, NAME, plan=ProfilePlan(max_len=1024, max_batch=8))

    async def store() -> None:
        r = Redis.from_url(redis.url)
        await save_profile(r, profile)
        await r.aclose()

    asyncio.run(store())
    port = free_port()
    env = {**os.environ, "SLINFER_NATS_URL": nats.url, "SLINFER_REDIS_URL": redis.url,
           "SLINFER_GATEWAY_PORT": str(port), "SLINFER_API_KEYS": "", "SLINFER_MATRIX_ACCEL": "true",
           "SLINFER_KEEP_ALIVE_S": "60"}  # keep the instance warm between sequential requests
    children = [spawn("placer", "services.placer", env, data / "logs"),
                spawn("node-0", "services.node", {**env, "SLINFER_NODE_ID": "node-0"}, data / "logs"),
                spawn("gateway", "services.gateway", env, data / "logs")]
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    httpx.post(f"{url}/admin/models", json={"name": NAME, "path": str(model_dir), "public": True}).raise_for_status()
    return url, [*children, redis, nats]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--work-dir", help="keep servers' data and service logs here (default: a temp dir)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.work_dir or tmp)
        model_dir = Path(ensure_demo_model(data))
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = {n: prompt_ids(tok, n) for n in args.lengths}
        engine = {n: engine_prefill_s(model_dir, ids, args.n) for n, (_, ids) in prompts.items()}
        url, procs = start_stack(data, model_dir)
        try:
            cold = gateway_ttft_s(url, prompts[args.lengths[0]][0])
            gateway = {n: [gateway_ttft_s(url, text) for _ in range(args.n)] for n, (text, _) in prompts.items()}
        finally:
            for proc in procs:
                stop_child(proc, 10) if hasattr(proc, "log_path") else proc.stop()
    rows = []
    for n in args.lengths:
        e, g = statistics.median(engine[n]), statistics.median(gateway[n])
        rows.append({"prompt_tokens": len(prompts[n][1]), "engine_prefill_ms_p50": round(e * 1e3, 2),
                     "gateway_ttft_ms_p50": round(g * 1e3, 2), "overhead_ms_p50": round((g - e) * 1e3, 2),
                     "gateway_ttft_ms_p90": round(statistics.quantiles(gateway[n], n=10)[-1] * 1e3, 2)})
    result = {"command": "python bench/e2e_overhead.py " + " ".join(sys.argv[1:]), "n": args.n,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
              "cold_start_ttft_ms": round(cold * 1e3, 1), "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    out = ROOT / "bench" / "results" / "e2e_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
