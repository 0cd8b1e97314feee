"""The torch engine on the device: its output against Hugging Face `generate`, its step times
against the device's bounds, a KV pool resized under live requests, and a measured profile's
prediction error. Each function is one part of `check.py` and returns its JSON-able result."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.bounds import copy_bandwidth, matmul_rate, model_cost, sync, timed
from services.node.engines import create_engine
from services.node.engines.base import SamplingParams
from services.profiler.measure import ProfilePlan, check, measure
from shared.core.perf_model import Profile
from shared.core.types import Hardware

GREEDY = SamplingParams(max_tokens=1 << 30, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _vocab(model_dir: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size


def engine_tokens(engine, prompts: list[list[int]], new: int, prefix: str = "p",
                  between=None) -> list[list[int]]:
    """Greedy `new` tokens for every prompt: each prefilled alone, then decoded together in one
    batch of mixed lengths. `between(step)` runs before each decode step (a resize, say)."""
    rids = [f"{prefix}{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {}
    try:
        for rid, prompt in zip(rids, prompts):
            engine.add_request(rid, prompt, GREEDY)
            out[rid] = [engine.prefill(rid).tokens[rid]]
        for step in range(new - 1):
            if between is not None:
                between(step)
            result = engine.decode(rids)
            for rid in rids:
                out[rid].append(result.tokens[rid])
    finally:
        for rid in rids:
            engine.release(rid)
    return [out[rid] for rid in rids]


def hf_tokens(model, prompts: list[list[int]], new: int, device: torch.device) -> list[list[int]]:
    """Hugging Face `generate`, greedy, each prompt alone (no padding to get wrong)."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def _margin(model, prompt: list[int], prefix: list[int], device: torch.device) -> float:
    """Hugging Face's gap between its two likeliest next tokens after prompt + prefix: a
    divergence at a near-tie is rounding, not a wrong kernel."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def parity(model_dir: Path, device: torch.device, lengths: list[int], new: int) -> dict:
    """Greedy tokens of the engine against `generate` on the same weights: float32 (must match
    token for token) and the checkpoint's dtype (reported: bf16 rounding may flip near-ties)."""
    from transformers import AutoModelForCausalLM

    vocab = _vocab(model_dir)
    prompts = _prompts(vocab, lengths, seed=1)
    result = {"prompt_lengths": lengths, "new_tokens": new}
    for dtype in ("float32", None):
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True,
            dtype=getattr(torch, dtype) if dtype else "auto").to(device).eval()
        expected = hf_tokens(hf, prompts, new, device)
        engine = create_engine("torch", model_dir, device=str(device), dtype=dtype,
                               kv_capacity_bytes=None)
        engine.load()
        try:
            got = engine_tokens(engine, prompts, new)
        finally:
            engine.unload()
        rows = []
        for prompt, want, have in zip(prompts, expected, got):
            same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), len(want))
            row = {"prompt_len": len(prompt), "matching_prefix": same}
            if same < len(want):
                row["hf_top2_margin_at_divergence"] = _margin(hf, prompt, want[:same], device)
            rows.append(row)
        del hf
        _free(device)
        result[dtype or "checkpoint_dtype"] = {
            "requests": rows, "all_equal": all(r["matching_prefix"] == new for r in rows)}
    result["ok"] = result["float32"]["all_equal"]
    return result


def speed(model_dir: Path, device: torch.device, batches: list[int], context: int,
          prefill_tokens: int, copy_bytes: int, matmul_n: int, steps: int) -> dict:
    """Decode step time at each batch against the HBM bound, and prefill throughput against
    the matmul rate, in the checkpoint's dtype."""
    engine = create_engine("torch", model_dir, device=str(device), dtype=None,
                           kv_capacity_bytes=None)
    engine.load()
    try:
        memory = engine.memory()
        per_token = memory.kv_bytes_per_token
        need = (max(batches) + 1) * (context + steps + 64) * per_token
        if memory.kv_capacity_bytes < need:
            engine.resize_kv(need)
        cost = model_cost(engine.model, engine.config, per_token)
        bandwidth = copy_bandwidth(device, copy_bytes)
        dtype = engine.model.dtype
        peak = matmul_rate(device, dtype, matmul_n)
        vocab = engine.config.vocab_size
        decode = {}
        for batch in batches:
            step = _decode_step_s(engine, _prompts(vocab, [context] * batch, seed=batch), steps,
                                  device)
            bound = cost.decode_bound_s(batch, context, bandwidth)
            decode[str(batch)] = {"step_s": step, "bound_s": bound, "x_bound": step / bound,
                                  "tokens_per_s": batch / step}
        prompt = _prompts(vocab, [prefill_tokens], seed=7)[0]
        prefill_s = _prefill_s(engine, prompt, device)
        achieved = cost.prefill_flops(prefill_tokens) / prefill_s
    finally:
        engine.unload()
    return {"dtype": str(dtype).removeprefix("torch."), "weight_bytes": cost.weight_bytes,
            "kv_bytes_per_token": per_token, "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_flops_per_s": peak, "matmul_n": matmul_n, "context": context,
            "decode": decode,
            "prefill": {"tokens": prefill_tokens, "seconds": prefill_s,
                        "tokens_per_s": prefill_tokens / prefill_s, "flops_per_s": achieved,
                        "fraction_of_matmul_rate": achieved / peak},
            "ok": True}


def _decode_step_s(engine, prompts: list[list[int]], steps: int, device) -> float:
    rids = [f"d{i}" for i in range(len(prompts))]
    try:
        for rid, prompt in zip(rids, prompts):
            engine.add_request(rid, prompt, GREEDY)
            engine.prefill(rid)
        return timed(lambda: engine.decode(rids), device, steps, warmup=3)
    finally:
        for rid in rids:
            engine.release(rid)


def _prefill_s(engine, prompt: list[int], device) -> float:
    n = 0

    def one() -> None:
        nonlocal n
        n += 1
        rid = f"f{n}"
        engine.add_request(rid, prompt, GREEDY)
        try:
            engine.prefill(rid)
        finally:
            engine.release(rid)
    return timed(one, device, 5, warmup=2)


def kv_resize(model_dir: Path, device: torch.device, start_bytes: int, lengths: list[int],
              new: int) -> dict:
    """SLINFER Fig. 17's experiment on our pool: grow it from `start_bytes` to twice that, back,
    and down to half, with requests decoding across the resizes; their tokens must equal an
    undisturbed run's (the live blocks are copied, not lost)."""
    engine = create_engine("torch", model_dir, device=str(device), dtype=None,
                           kv_capacity_bytes=start_bytes)
    engine.load()
    try:
        prompts = _prompts(engine.config.vocab_size, lengths, seed=3)
        reference = engine_tokens(engine, prompts, new, prefix="ref")
        sizes = {1: 2 * start_bytes, 3: start_bytes, 5: start_bytes // 2}
        resizes = []

        def resize(step: int) -> None:
            if step not in sizes:
                return
            before = engine.memory().kv_capacity_bytes
            sync(device)
            started = time.perf_counter()
            engine.resize_kv(sizes[step])
            sync(device)
            seconds = time.perf_counter() - started
            resizes.append({"from_bytes": before, "to_bytes": engine.memory().kv_capacity_bytes,
                            "seconds": seconds, "live_requests": len(prompts),
                            "used_bytes": engine.memory().kv_used_bytes})
        got = engine_tokens(engine, prompts, new, prefix="live", between=resize)
    finally:
        engine.unload()
    same = got == reference
    return {"start_bytes": start_bytes, "resizes": resizes, "tokens_kept": same,
            "paper": {"32GB_to_16GB_s": 0.3, "32GB_to_64GB_s": 1.9,
                      "source": "SLINFER section VII-B, Fig. 17 (GPU)"},
            "ok": same and len(resizes) == len(sizes)}


def profile_error(model_dir: Path, device: torch.device, plan: ProfilePlan, check_n: int,
                  runs: int) -> tuple[dict, Profile]:
    """`slinfer profile --check` as the profiler runs it, `runs` times on one loaded engine:
    the mean relative TTFT and TPOT error of each run, and their medians; and the last run's
    profile (the stack part's placer decides with it)."""
    vocab = _vocab(model_dir)
    engine = create_engine("torch", model_dir, device=str(device))
    engine.load()
    rows = []
    try:
        for run in range(runs):
            profile = measure(engine, model_dir.name, Hardware.GPU if device.type == "cuda"
                              else Hardware.CPU, plan, vocab, load_s=0.0, seed=run)
            result = check(engine, profile, plan, vocab, check_n, seed=100 + run)
            rows.append({"ttft_mean_rel_error": result.ttft_mean_rel_error,
                         "tpot_mean_rel_error": result.tpot_mean_rel_error,
                         "decode_step_s_at_max": profile.decode_s(plan.max_batch, plan.max_len),
                         "prefill_s_at_max": profile.prefill_s(plan.max_len)})
    finally:
        engine.unload()
    ttft = statistics.median(r["ttft_mean_rel_error"] for r in rows)
    tpot = statistics.median(r["tpot_mean_rel_error"] for r in rows)
    return {"plan": {"max_len": plan.max_len, "max_batch": plan.max_batch,
                     "repeats": plan.repeats, "passes": plan.passes},
            "check": check_n, "runs": rows, "ttft_mean_rel_error_median": ttft,
            "tpot_mean_rel_error_median": tpot, "paper": {"ttft": 0.059, "tpot": 0.039},
            "ok": True}, profile


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
