"""Where the request path's overhead goes: each warm streamed request's time to first token cut
into its parts, from the spans every service exports and the client's own clock.

    .venv/bin/python bench/path_split.py [--n 50] [--lengths 16 256 1024]

The stack (as `bench/e2e_overhead.py` runs it: real nats-server, valkey, placer, one CPU node,
gateway, the tiny demo model on the torch engine) exports its traces over OTLP/HTTP to a receiver
in its own process. All processes share this machine's clock, so one request's timestamps line up:

    http_in      client sends the request -> the gateway's HTTP server span starts
    gateway_in   -> its request span starts: body, validation, chat template, tokenization
    to_placer    -> the placer took it from the stream: JetStream publish, store, pull
    placer       -> its decision span starts: queued, the cluster view, the core's decision
    to_node      -> the node's request span starts: the admit command's request-reply (on the
                    warm fast path, with no placer on the way, the gateway's own)
    node_admit   -> the node's prefill starts: admission re-check, queueing for an iteration
    prefill      the engine's prefill iteration
    token_back   -> the gateway has the first token: the token message over core NATS
    http_out     -> the client has the first SSE chunk

The parts sum to the client's TTFT. Tracing costs a little itself (`bench/ops_overhead.py`
measures how much); the untraced total is `bench/e2e_overhead.py`'s. Writes
bench/results/path_split.json and prints the medians.
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
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e_overhead import visible_prompts  # noqa: E402
from lean_client import LeanClient  # noqa: E402
from services.profiler.measure import ProfilePlan  # noqa: E402
from services.stack import MODEL as NAME, running_stack  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402

PARTS = ("http_in", "gateway_in", "to_placer", "placer", "to_node", "node_admit", "prefill",
         "token_back", "http_out")


def split(spans: list[dict], sent_ns: int, first_ns: int) -> dict[str, float]:
    """One request's parts in seconds, from the spans of its trace (dicts with the fields of
    tests/ops/otlp_receiver.ReceivedSpan) and the client's send and first-chunk times (ns)."""
    def one(service: str, pred) -> dict:
        found = [s for s in spans if s["service"] == service and pred(s)]
        if not found:
            raise ValueError(f"no {service} span in the trace")
        return min(found, key=lambda s: s["start_ns"])  # the first (a retry may add more)

    server = one("slinfer-gateway", lambda s: s["kind"] == 2)  # SERVER
    request = one("slinfer-gateway", lambda s: "gen_ai.response.id" in s["attributes"])
    node = one("slinfer-node", lambda s: s["name"] == "node.request")
    prefill = one("slinfer-node", lambda s: s["name"] == "node.prefill")
    first_event = [t for (name, _), t in zip(request["events"], request["event_ns"])
                   if name == "first_token"]
    if not first_event:
        raise ValueError("the request span has no first_token event")
    if any(s["service"] == "slinfer-placer" for s in spans):
        place = one("slinfer-placer", lambda s: s["name"].startswith("place "))
        placed_ns = place["start_ns"]
        taken_ns = placed_ns - int(place["attributes"]["slinfer.placement.queued_s"] * 1e9)
    else:  # the warm fast path: the gateway sent it to the node itself (to_node holds that)
        taken_ns = placed_ns = request["start_ns"]
    marks = [sent_ns, server["start_ns"], request["start_ns"], taken_ns, placed_ns,
             node["start_ns"], prefill["start_ns"], prefill["end_ns"], first_event[0], first_ns]
    return {part: (b - a) / 1e9 for part, a, b in zip(PARTS, marks, marks[1:])}


async def one_request(client: LeanClient, prompt: str) -> tuple[str, int, int]:
    """(request id, send time, first chunk time), both time.time_ns(). The lean client, as
    e2e_overhead's overhead figure: http_out is the path's, not an HTTP library's."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    sent = time.time_ns()
    first, rid = 0, ""
    async for line in client.post_sse("/v1/completions", body):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if not first and chunk.get("choices"):
            first, rid = time.time_ns(), chunk["id"]
    return rid, sent, first


async def measure(url: str, prompts: dict[int, str], n: int) -> dict[int, list[tuple[str, int, int]]]:
    out: dict[int, list[tuple[str, int, int]]] = {}
    async with LeanClient(url) as client:
        await one_request(client, prompts[min(prompts)])  # the cold start, not counted
        for length, prompt in prompts.items():
            out[length] = [await one_request(client, prompt) for _ in range(n)]
    return out


def summarize(rows: list[dict[str, float]]) -> dict:
    med = {p: round(statistics.median(r[p] for r in rows) * 1e3, 3) for p in PARTS}
    ttft = [sum(r.values()) for r in rows]
    overhead = [sum(v for p, v in r.items() if p != "prefill") for r in rows]
    return {"requests": len(rows), "parts_ms_p50": med,
            "ttft_ms_p50": round(statistics.median(ttft) * 1e3, 3),
            "prefill_ms_p50": med["prefill"],
            "overhead_ms_p50": round(statistics.median(overhead) * 1e3, 3),
            "overhead_ms_p90": round(statistics.quantiles(overhead, n=10)[-1] * 1e3, 3)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "path_split.json"))
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        model_dir = Path(ensure_demo_model(data))
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = visible_prompts(model_dir, tok, args.lengths)
        dump = data / "spans.jsonl"
        receiver = subprocess.Popen([sys.executable, "-m", "tests.ops.otlp_receiver", "0", str(dump)],
                                    cwd=ROOT, stdout=subprocess.PIPE, text=True)
        endpoint = receiver.stdout.readline().strip()
        env = {"SLINFER_KEEP_ALIVE_S": "600", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
               "OTEL_BSP_SCHEDULE_DELAY": "200"}
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        try:
            with running_stack(data / "stack", model_dir, env, base_env=base,
                               plan=ProfilePlan(max_len=1024, max_batch=8)) as stack:
                raw = asyncio.run(measure(stack.url, prompts, args.n))
                time.sleep(3)  # the last spans' export (every 0.2 s), before the stack stops
        finally:  # the stack flushed its spans as it stopped
            receiver.terminate()
            receiver.communicate(timeout=60)
        spans = [json.loads(line) for line in dump.read_text().splitlines()]
    by_request = {}
    for s in spans:
        rid = s["attributes"].get("gen_ai.response.id")
        if rid:
            by_request[rid] = s["trace_id"]
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    rows = {}
    for length, reqs in raw.items():
        rows[length] = [split(by_trace[by_request[rid]], sent, first) for rid, sent, first in reqs]
    result = {"command": "python bench/path_split.py " + " ".join(sys.argv[1:]), "n": args.n,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg(),
              "parts": {"names": list(PARTS), "doc": __doc__.split("\n\n")[2].strip()},
              "rows": {str(n): summarize(r) for n, r in rows.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["rows"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
