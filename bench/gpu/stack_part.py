"""The whole local stack with one GPU node: a few streamed completions end to end, TTFT and TPOT
as the client sees them. Runs only where the services' dependencies and the nats-server and
valkey binaries are installed (a bare GPU machine has torch and transformers, not them); says
what is missing otherwise."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

NEEDED = ("nats", "redis", "fastapi", "uvicorn", "opentelemetry.sdk")


def missing() -> list[str]:
    """The services' modules and servers this machine lacks."""
    out = []
    for name in NEEDED:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except ModuleNotFoundError:  # a parent package is absent
            out.append(name)
    if out:  # shared.servers itself needs some of them
        return out
    from shared.servers import nats_server_binary, redis_server_binary

    for name, find in (("nats-server", nats_server_binary), ("valkey", redis_server_binary)):
        try:
            find()
        except Exception:  # noqa: BLE001 - ServerStartError: not installed
            out.append(name)
    return out


def _stream_one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    sent = time.perf_counter()
    stamps = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": r.read().decode(errors="replace")[:300]}
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    if not stamps:
        return {"status": 200, "tokens": 0}
    ttft = stamps[0] - sent
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"status": 200, "chunks": len(stamps), "ttft_s": ttft, "tpot_s": tpot}


def whole_stack(model_dir: Path, name: str, device: str, profile, work: Path,
                requests: int, max_tokens: int, prompt_repeats: int, node_memory_bytes: int
                ) -> dict:
    """`profile` is the device profile measured by the profile part (the placer decides with
    it); None: the stack measures one on the CPU, which a GPU node must not use."""
    absent = missing()
    if absent:
        return {"skipped": f"not installed here: {', '.join(absent)}", "ok": None}
    if profile is None:
        return {"skipped": "no profile of this device (the profile part did not run)",
                "ok": None}
    from services.stack import running_stack

    gpu = device.startswith("cuda")
    node_env = {"SLINFER_NODE_HARDWARE": "gpu" if gpu else "cpu", "SLINFER_DEVICE": device,
                "SLINFER_NODE_MEMORY_BYTES": str(node_memory_bytes)}
    prompt = "Tell me about serverless inference on shared GPUs. " * prompt_repeats
    with running_stack(work, model_dir, model=name, profile=replace(profile, model=name),
                       child_env={"node-0": node_env}) as stack:
        rows = [_stream_one(stack.url, name, prompt, max_tokens) for _ in range(requests)]
    served = [r for r in rows if r["status"] == 200 and r.get("chunks")]
    result = {"requests": rows, "served": len(served)}
    if served:
        warm = served[1:] or served  # the first may pay the instance's cold start
        result["ttft_s_median_warm"] = statistics.median(r["ttft_s"] for r in warm)
        tpots = [r["tpot_s"] for r in served if r["tpot_s"] is not None]
        result["tpot_s_median"] = statistics.median(tpots) if tpots else None
        result["cold_ttft_s"] = served[0]["ttft_s"]
    result["ok"] = len(served) == requests
    return result
