"""End-to-end overhead of the request path: the gateway's time to first token (streaming, through
JetStream, the placer, the node worker and back) against the engine's own prefill time for the
*same request*, which the node reports on its first token message (`TokenMessage.prefill_s`).
Pairing per request makes the difference immune to the machine's noise between two phases.

    .venv/bin/python bench/e2e_overhead.py [--n 50] [--lengths 16 256 1024] [--out FILE]

Sequential warm requests (the cold start is reported on its own). Writes
bench/results/e2e_overhead.json (or --out) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
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

from services.profiler.measure import ProfilePlan  # noqa: E402
from shared import wire  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402
from shared.schemas import TokenMessage  # noqa: E402
from services.stack import MODEL as NAME, running_stack  # noqa: E402



def prompt_of(tokenizer, length: int, shift: int = 0) -> str:
    """A text prompt whose tokenization (with BOS, as the gateway does it) has ~`length` tokens
    (`shift`: start the words' numbering there, for another prompt of the same length)."""
    words = " ".join(f"word{i}" for i in range(shift, shift + length * 2))
    ids = tokenizer(words)["input_ids"][1:length]
    return tokenizer.decode(ids, skip_special_tokens=True)


def visible_prompts(model_dir: Path, tokenizer, lengths: list[int]) -> dict[int, str]:
    """A prompt of each length whose first greedy token, on the model's (random) weights,
    decodes to text. A token that decodes to part of a UTF-8 character is held back by the
    gateway until a later one completes it, so the client's first chunk would wait a decode step
    or more and count it as overhead: the 256-token prompt of `prompt_of` starts its output with
    two such bytes (the "HTTP out" of 4.7 ms in BENCHMARKS' earlier splits)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.gateway.tokenization import IncrementalDetokenizer, encode_text

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = {}
    for length in lengths:
        for shift in range(64):
            prompt = prompt_of(tokenizer, length, shift)
            ids = encode_text(tokenizer, prompt)
            with torch.inference_mode():
                first = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if IncrementalDetokenizer(tokenizer, ids).push([first]).strip():
                prompts[length] = prompt
                break
        else:
            raise RuntimeError(f"no prompt of {length} tokens starts its output with text")
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, prompt: str,
                      model: str = NAME) -> tuple[str, float, int]:
    """(request id, seconds to the first token chunk, prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, rid, prompt_tokens = None, "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return rid, ttft, prompt_tokens


async def watch_prefill(nats_url: str, prefill: dict[str, float]):
    """Connect to the stack's NATS and note each request's engine prefill time (the node puts it
    on the first token message) in `prefill`; returns the connection, to close when done."""
    from shared.bus import connect_nats

    nc = await connect_nats(nats_url, "bench-e2e")

    async def on_token(msg) -> None:
        m = wire.decode(TokenMessage, msg.data)
        if m.prefill_s is not None:
            prefill.setdefault(m.request_id, m.prefill_s)

    await nc.subscribe("slinfer.tokens.>", cb=on_token)
    return nc


async def measure(url: str, nats_url: str, prompts: dict[int, str], n: int) -> dict:
    prefill: dict[str, float] = {}
    nc = await watch_prefill(nats_url, prefill)
    out: dict = {}
    async with httpx.AsyncClient(timeout=60) as client:
        _, cold, _ = await one_request(client, url, prompts[min(prompts)])
        out["cold_start_ttft_ms"] = round(cold * 1e3, 1)
        for length, prompt in prompts.items():
            pairs, tokens = [], 0
            for _ in range(n):
                rid, ttft, tokens = await one_request(client, url, prompt)
                await asyncio.sleep(0.02)  # let the token subscription catch up
                pairs.append((ttft, prefill[rid]))
            out[length] = (pairs, tokens)
    await nc.close()
    return out


def summarize(pairs: list[tuple[float, float]], tokens: int) -> dict:
    ttft = [t for t, _ in pairs]
    engine = [p for _, p in pairs]
    overhead = [t - p for t, p in pairs]
    return {"prompt_tokens": tokens, "engine_prefill_ms_p50": round(statistics.median(engine) * 1e3, 2),
            "gateway_ttft_ms_p50": round(statistics.median(ttft) * 1e3, 2),
            "overhead_ms_p50": round(statistics.median(overhead) * 1e3, 2),
            "overhead_ms_p90": round(statistics.quantiles(overhead, n=10)[-1] * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--work-dir", help="keep servers' data and service logs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "e2e_overhead.json",
                   help="the result file (an A/B run keeps the recorded one)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.work_dir or tmp)
        model_dir = Path(ensure_demo_model(data))
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = visible_prompts(model_dir, tok, args.lengths)
        # Keep the instance warm between sequential requests: only the first is a cold start.
        with running_stack(data, model_dir, {"SLINFER_KEEP_ALIVE_S": "60"},
                           plan=ProfilePlan(max_len=1024, max_batch=8)) as stack:
            raw = asyncio.run(measure(stack.url, stack.nats_url, prompts, args.n))
    result = {"command": "python bench/e2e_overhead.py " + " ".join(sys.argv[1:]), "n": args.n,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "cold_start_ttft_ms": raw["cold_start_ttft_ms"],
              "rows": [summarize(*raw[n]) for n in args.lengths]}
    out = args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
