"""lm-evaluation-harness against slinfer: a log-likelihood task through POST /v1/completions, with
Hugging Face transformers on the same model directory as the reference.

    make bench-lmeval [ARGS='--limit 20']
    .venv/bin/python bench/lmeval.py [--limit N] [--url http://127.0.0.1:8000] [--skip-hf]

lm-eval lives in its own environment, `.venv-lmeval` (`make bench-lmeval` makes it, pinned:
lm-eval[api,hf]==0.4.13 on the local torch 2.13.0 CPU wheel): its dependencies (datasets,
evaluate, peft, ...) would move `.venv`'s pins. This script runs in `.venv` and calls its
`lm_eval` as a child.

The task, `slinfer_facts` (bench/lmeval/slinfer_facts.yaml), is ours: 150 four-way
multiple-choice questions of general knowledge (bench/lmeval/facts.jsonl: capitals, small
arithmetic, common facts), read with `dataset_path: json` so nothing is downloaded. Each choice
is one request: lm-eval's `local-completions` sends the context and the choice as token ids
(`prompt: [[ids]]`, tokenized by the model directory's own tokenizer) with `echo: true`,
`logprobs: 1`, `max_tokens: 1`, `temperature: 0`, and sums `token_logprobs[ctxlen:-1]`: the
choice's tokens, the generated token left out. acc picks the likeliest choice, acc_norm the
likeliest per byte.

Steps:
1. the default real model (SmolLM2-135M-Instruct, shared/default_model.py) served by a stack of
   real processes (services.stack.running_stack: NATS, valkey, placer, one CPU node, gateway),
   its profile measured with a small plan (prompts here are under 40 tokens) and the model
   registered in the best-effort (batch) SLO class, as the real-model tests do: on a busy 2-core
   box a standard TTFT SLO may rightly be judged infeasible. With `--url`, an already running
   stack (`make run`) is used instead, unmodified.
2. `lm_eval --model local-completions` against it, with `--log_samples`.
3. `lm_eval --model hf` on the same directory (float32, CPU, batch 1): the reference.
4. Every choice's log-likelihood, slinfer's against HF's: the largest difference, and the
   questions whose pick differs (which should only be near-ties).

Writes bench/results/lmeval.json (accuracy of both, requests, wall times, agreement, machine,
command) and prints it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.profiler.measure import ProfilePlan  # noqa: E402
from services.stack import running_stack  # noqa: E402
from shared.default_model import NAME, cache_dir, ensure_default_model  # noqa: E402

TASK = "slinfer_facts"
INCLUDE = "bench/lmeval"  # relative to ROOT, where lm_eval runs (the YAML's data path is too)
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
# Short prompts, one at a time: a small profile is enough for the placer to admit them.
PLAN = ProfilePlan(max_len=128, max_batch=2, repeats=1, warmup=1, passes=1, lora_ranks=())
READY_TIMEOUT_S = 120.0


def run_lm_eval(lm_eval: Path, model: str, model_args: str, out: Path, limit: int | None,
                extra: list[str]) -> tuple[dict, list[dict], float, list[str]]:
    """One lm_eval run: (its results, its samples, wall seconds, the command)."""
    command = [str(lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", INCLUDE, "--output_path", str(out), "--log_samples", *extra]
    if limit is not None:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    wall = time.perf_counter() - start
    results = json.loads(Path(_one(out, "results_*.json")).read_text())
    samples = [json.loads(line) for line in
               Path(_one(out, f"samples_{TASK}_*.jsonl")).read_text().splitlines() if line]
    return results, samples, wall, command


def _one(out: Path, pattern: str) -> str:
    found = glob.glob(str(out / "**" / pattern), recursive=True)
    if len(found) != 1:
        raise RuntimeError(f"expected one {pattern} under {out}, found {found}")
    return found[0]


def scores(samples: list[dict]) -> dict[int, list[float]]:
    """doc_id -> each choice's log-likelihood."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


def summary(results: dict, samples: list[dict], wall: float, command: list[str]) -> dict:
    metrics = results["results"][TASK]
    return {"acc": metrics["acc,none"], "acc_stderr": metrics["acc_stderr,none"],
            "acc_norm": metrics["acc_norm,none"], "acc_norm_stderr": metrics["acc_norm_stderr,none"],
            "questions": len(samples), "requests": sum(len(s["resps"]) for s in samples),
            "wall_s": round(wall, 1),
            "command": " ".join(Path(c).name if c == command[0] else c for c in command)}


def agreement(ours: list[dict], reference: list[dict]) -> dict:
    """How slinfer's per-choice log-likelihoods compare with the reference's."""
    a, b = scores(ours), scores(reference)
    diffs = [abs(x - y) for d in a for x, y in zip(a[d], b[d])]
    picks = [d for d in a if _argmax(a[d]) != _argmax(b[d])]
    gaps = {d: round(_gap(b[d]), 4) for d in picks}  # how close the reference's top two were
    return {"choices_compared": len(diffs), "max_abs_loglik_diff": max(diffs),
            "mean_abs_loglik_diff": sum(diffs) / len(diffs),
            "questions_with_another_pick": len(picks),
            "reference_top2_gap_where_picks_differ": gaps}


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def _gap(xs: list[float]) -> float:
    top = sorted(xs, reverse=True)
    return top[0] - top[1]


def register_batch_class(url: str) -> None:
    """Register the model again (same files) in the best-effort SLO class; wait until ready."""
    path = httpx.get(f"{url}/admin/models/{NAME}").json()["path"]
    r = httpx.post(f"{url}/admin/models", timeout=30, json={
        "name": NAME, "path": path, "engine": "torch", "public": True, "slo_class": "batch",
        "replace": True})
    r.raise_for_status()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while httpx.get(f"{url}/admin/models/{NAME}").json()["lifecycle"]["state"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{NAME} did not become ready again")
        time.sleep(0.5)


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, {platform.platform()}"


def lm_eval_version(lm_eval: Path) -> str:
    python = lm_eval.parent / "python"
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                          "print(m.version('lm-eval'))"], capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, help="only the first N questions (a quick check)")
    p.add_argument("--url", help="a running stack that serves the default model (else one "
                                 "is started here)")
    p.add_argument("--skip-hf", action="store_true", help="no Hugging Face reference run")
    p.add_argument("--lm-eval", type=Path, default=LM_EVAL)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lmeval.json")
    args = p.parse_args(argv)
    if not args.lm_eval.exists():
        p.error(f"{args.lm_eval} not found: `make bench-lmeval` makes .venv-lmeval")
    model_dir = ensure_default_model(cache_dir())
    given = sys.argv[1:] if argv is None else argv
    report: dict = {"command": shlex.join(["python", "bench/lmeval.py", *given]),
                    "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                    "model": f"{NAME} (shared/default_model.py), float32",
                    "task": f"{TASK} ({INCLUDE}/slinfer_facts.yaml, {INCLUDE}/facts.jsonl)",
                    "lm_eval": lm_eval_version(args.lm_eval)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.url:
            report["stack"] = f"running at {args.url}"
            report["slinfer"] = _slinfer(args, args.url, model_dir, work)
        else:
            start = time.perf_counter()
            with running_stack(work / "stack", model_dir, {"SLINFER_KEEP_ALIVE_S": "600"},
                               plan=PLAN, model=NAME) as stack:
                register_batch_class(stack.url)
                report["stack"] = (f"started here (services.stack, 1 CPU node) in "
                                   f"{time.perf_counter() - start:.0f} s")
                report["slinfer"] = _slinfer(args, stack.url, model_dir, work)
        if not args.skip_hf:
            results, samples, wall, command = run_lm_eval(
                args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", work / "hf",
                args.limit, ["--device", "cpu", "--batch_size", "1"])
            report["hf"] = summary(results, samples, wall, command)
            report["agreement"] = agreement(report["slinfer"].pop("_samples"), samples)
        report["slinfer"].pop("_samples", None)
    report["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


def _slinfer(args: argparse.Namespace, url: str, model_dir: Path, work: Path) -> dict:
    model_args = (f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={model_dir},num_concurrent=1,max_retries=3")
    results, samples, wall, command = run_lm_eval(args.lm_eval, "local-completions", model_args,
                                                  work / "slinfer", args.limit, [])
    return {**summary(results, samples, wall, command), "_samples": samples}


if __name__ == "__main__":
    sys.exit(main())
