"""End-to-end overhead of the request path: the gateway's time to first token (streaming, through
the gateway, to the node (directly when warm, else through JetStream and a placer) and back)
against the engine's own prefill time for the *same request*, which the node reports on its first
token message (`TokenMessage.prefill_s`). Pairing per request makes the difference immune to the
machine's noise between two phases.

Two clients take turns, request by request: a lean one (`bench/lean_client.py`: asyncio streams,
no HTTP library), whose figure is the request path's own overhead, and httpx (what the openai
Python client streams with), whose figure adds that library's own ~1.6-1.9 ms per streamed
request on the 2-core box (`bench/path_floor.py` measures it on a bare server). Rows: the lean client's
figures, and `httpx_*` for httpx's.

    .venv/bin/python bench/e2e_overhead.py [--n 50] [--lengths 16 256 1024] [--with logprobs json]
                                           [--out FILE]

Sequential warm requests, n per client and length (the cold start is reported on its own). Writes
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
sys.path.insert(0, str(ROOT / "bench"))

from services.profiler.measure import ProfilePlan  # noqa: E402
from lean_client import LeanClient  # noqa: E402
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


# --with: what a request asks for besides its tokens (the features on the path the overhead is
# measured with): the top-5 logprobs of every token, and output constrained to JSON (a grammar
# mask the node's engine applies at every step).
FEATURES = {"logprobs": {"logprobs": 5}, "json": {"response_format": {"type": "json_object"}}}


def request_body(prompt: str, model: str = NAME, extra: dict | None = None) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **(extra or {})}


class FirstChunk:
    """Reads a streamed completion's lines: the request id, the time of the first chunk with a
    choice (from `start`, perf_counter), the prompt's tokens from the usage chunk."""

    def __init__(self, start: float) -> None:
        self.start, self.ttft, self.rid, self.prompt_tokens = start, None, "", 0

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        self.rid = chunk["id"]
        if self.ttft is None and chunk.get("choices"):
            self.ttft = time.perf_counter() - self.start
        if chunk.get("usage"):
            self.prompt_tokens = chunk["usage"]["prompt_tokens"]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str,
                      model: str = NAME, extra: dict | None = None) -> tuple[str, float, int]:
    """With httpx: (request id, seconds to the first token chunk, prompt tokens)."""
    body = request_body(prompt, model, extra)
    seen = FirstChunk(time.perf_counter())
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            seen.line(line)
    return seen.rid, seen.ttft, seen.prompt_tokens


async def lean_request(client: LeanClient, prompt: str, model: str = NAME,
                       extra: dict | None = None) -> tuple[str, float, int]:
    """`one_request` with the lean client (the request path's own overhead, no httpx)."""
    body = request_body(prompt, model, extra)
    seen = FirstChunk(time.perf_counter())
    async for line in client.post_sse("/v1/completions", body):
        seen.line(line)
    return seen.rid, seen.ttft, seen.prompt_tokens


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


async def measure(url: str, nats_url: str, prompts: dict[int, str], n: int,
                  extra: dict | None = None) -> dict:
    """Per prompt length: (lean pairs, httpx pairs, prompt tokens), a pair being a request's
    (TTFT, engine prefill). The two clients alternate which goes first."""
    prefill: dict[str, float] = {}
    nc = await watch_prefill(nats_url, prefill)
    out: dict = {}
    async with httpx.AsyncClient(timeout=60) as client, LeanClient(url) as lean:
        _, cold, _ = await one_request(client, url, prompts[min(prompts)])
        out["cold_start_ttft_ms"] = round(cold * 1e3, 1)
        for length, prompt in prompts.items():
            pairs: dict[str, list] = {"lean": [], "httpx": []}
            tokens = 0
            for i in range(n):
                for who in (("lean", "httpx") if i % 2 == 0 else ("httpx", "lean")):
                    if who == "lean":
                        rid, ttft, tokens = await lean_request(lean, prompt, extra=extra)
                    else:
                        rid, ttft, tokens = await one_request(client, url, prompt, extra=extra)
                    await asyncio.sleep(0.02)  # let the token subscription catch up
                    pairs[who].append((ttft, prefill[rid]))
            out[length] = (pairs["lean"], pairs["httpx"], tokens)
    await nc.close()
    return out


def summarize(lean: list[tuple[float, float]], with_httpx: list[tuple[float, float]],
              tokens: int) -> dict:
    def overhead(pairs: list[tuple[float, float]]) -> list[float]:
        return [t - p for t, p in pairs]

    def ms(x: float) -> float:
        return round(x * 1e3, 2)

    return {"prompt_tokens": tokens,
            "engine_prefill_ms_p50": ms(statistics.median(p for _, p in lean)),
            "gateway_ttft_ms_p50": ms(statistics.median(t for t, _ in lean)),
            "overhead_ms_p50": ms(statistics.median(overhead(lean))),
            "overhead_ms_p90": ms(statistics.quantiles(overhead(lean), n=10)[-1]),
            "httpx_overhead_ms_p50": ms(statistics.median(overhead(with_httpx))),
            "httpx_overhead_ms_p90": ms(statistics.quantiles(overhead(with_httpx), n=10)[-1])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--with", dest="features", nargs="*", default=[], choices=sorted(FEATURES),
                   help="features every request asks for (logprobs: top 5; json: JSON output)")
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
            extra = {k: v for f in args.features for k, v in FEATURES[f].items()}
            raw = asyncio.run(measure(stack.url, stack.nats_url, prompts, args.n, extra))
    result = {"command": "python bench/e2e_overhead.py " + " ".join(sys.argv[1:]), "n": args.n,
              "features": args.features,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "cold_start_ttft_ms": raw["cold_start_ttft_ms"],
              "rows": [summarize(*raw[n]) for n in args.lengths]}
    out = args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
