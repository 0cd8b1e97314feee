"""`slinfer simulate`: run the cluster simulator and write its JSON report (and plots).

    slinfer simulate --system slinfer --models 64 --model-size 7b --cpu-nodes 4 --gpu-nodes 4 \\
        --duration 1800 --seed 0 --out report.json --plot plots/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared.core.preload import PRELOAD_INTERVAL_S
from sim import scaleout
from sim.config import SIZES, SYSTEMS, SimConfig
from sim.report import dumps
from sim.simulate import load_mix, simulate
from sim.workload import DEFAULT_LENGTHS_CSV


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slinfer simulate",
                                description="Discrete-event simulation of a CPU+GPU serverless "
                                            "LLM cluster under SLINFER or a baseline.")
    p.add_argument("--system", choices=SYSTEMS, default="slinfer")
    p.add_argument("--models", type=int, default=32, help="number of deployed models")
    p.add_argument("--model-size", choices=[*SIZES, "mix"], default="7b",
                   help="size of every model; 'mix' = 1:1:1")
    p.add_argument("--model-mix", metavar="FILE",
                   help='JSON size -> weight, e.g. {"3b": 2, "7b": 2, "13b": 2}')
    p.add_argument("--cpu-nodes", type=int, default=4)
    p.add_argument("--gpu-nodes", type=int, default=4)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default=str(DEFAULT_LENGTHS_CSV),
                   help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--arrivals", default="functions",
                   help="'synthetic', 'functions' (the Azure Functions sample in sim/data) or an "
                        "Azure Functions per-minute invocation CSV")
    p.add_argument("--rps", type=float, help="total request rate (default: 0.02 per model)")
    p.add_argument("--cv", type=float, default=8.0,
                   help="synthetic arrivals: CV of per-model Gamma inter-arrivals (ServerlessLLM: 8)")
    p.add_argument("--no-cpu", action="store_true", help="ablation: GPU nodes only")
    p.add_argument("--no-sharing", action="store_true", help="ablation: one instance per node")
    p.add_argument("--no-consolidation", action="store_true", help="ablation: no preemption")
    p.add_argument("--no-packing", action="store_true",
                   help="ablation: new instances on the soonest-starting node instead of bin-packing")
    p.add_argument("--watermark", type=float, default=0.25, help="KV scaling watermark (0.25 = 25%%)")
    p.add_argument("--keep-alive", type=float, default=1.0, help="idle seconds before reclaim")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="slinfer: prefills in chunks sized to the node's decode slack")
    p.add_argument("--prewarm", action="store_true",
                   help="slinfer: predictive pre-warming and per-model keep-alive from each "
                        "model's idle-time histogram (shared/core/prewarm.py)")
    p.add_argument("--prewarm-bin-s", type=float, default=1.0, metavar="S",
                   help="--prewarm: width of an idle-time bin (240 bins)")
    p.add_argument("--prefill-chunk-min", type=int, default=64, metavar="TOKENS",
                   help="--chunked-prefill: the smallest chunk (so a prefill progresses)")
    p.add_argument("--profiles", metavar="JSON", help="measured profiles replacing the built-in ones")
    p.add_argument("--noise", type=float, default=0.07,
                   help="sigma of the log-normal noise on every iteration time (0: exact profiles)")
    p.add_argument("--storage", choices=["dram", "tiered", "registry"], default="dram",
                   help="checkpoints on a cold start: all in every node's DRAM (the paper), "
                        "DRAM + disk caches + registry, or the registry only")
    p.add_argument("--engine-startup", type=float, default=0.0,
                   help="seconds of engine start-up added to every cold start, for every system")
    lora = p.add_argument_group("LoRA functions (sim/lora.py)")
    lora.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                      help="every function is a LoRA adapter: N functions (replaces --models)")
    lora.add_argument("--lora-backbones", type=int, default=1, metavar="B",
                      help="backbones the adapters are spread over (round-robin; --model-size)")
    lora.add_argument("--lora-rank", type=int, default=8, help="adapter rank (all 7 projections)")
    lora.add_argument("--lora-serving", choices=["shared", "merged"], default="shared",
                      help="shared: adapters on shared backbone instances (slinfer only); "
                           "merged: one full model per function")
    lora.add_argument("--lora-decode-overhead", type=float, metavar="X",
                      help="relative cost of an unmerged LoRA decode step (default: the curve "
                           "bench/lora.py measured)")
    lora.add_argument("--lora-preload-s", type=float, default=PRELOAD_INTERVAL_S, metavar="S",
                      help="shared: re-plan adapter and checkpoint pre-loading every S seconds, "
                           "as the placer and nodes do by default (0: no pre-loading)")
    scaleout.add_arguments(p)
    p.add_argument("--out", help="write the JSON report here (default: stdout)")
    p.add_argument("--plot", metavar="DIR", help="write TTFT CDF and nodes-used timeline PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def config_from(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        system=args.system, models=args.models, model_size=args.model_size,
        model_mix=load_mix(args.model_mix) if args.model_mix else None,
        cpu_nodes=args.cpu_nodes, gpu_nodes=args.gpu_nodes, duration=args.duration,
        seed=args.seed, lengths=args.lengths, arrivals=args.arrivals, rps=args.rps, cv=args.cv,
        no_cpu=args.no_cpu, no_sharing=args.no_sharing, no_consolidation=args.no_consolidation,
        no_packing=args.no_packing,
        watermark=args.watermark, keep_alive=args.keep_alive, profiles=args.profiles,
        noise=args.noise, engine_startup=args.engine_startup, storage=args.storage,
        lora_adapters=args.lora_adapters, lora_backbones=args.lora_backbones,
        lora_rank=args.lora_rank, lora_serving=args.lora_serving,
        lora_decode_overhead=args.lora_decode_overhead, lora_preload_s=args.lora_preload_s,
        prefill_chunk_tokens=args.prefill_chunk_min if args.chunked_prefill else 0,
        prewarm=args.prewarm, prewarm_bin_s=args.prewarm_bin_s,
        extra=scaleout.extra_from(args))


def _progress(total: float, enabled: bool):
    """A tqdm bar over simulated seconds, on stderr; a no-op when disabled."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=round(total), unit="sim-s", file=sys.stderr, leave=False)
    shown = [0]

    def update(now: float) -> None:
        t = min(round(now), round(total))
        if t > shown[0]:
            bar.update(t - shown[0])
            shown[0] = t
    return update, bar.close


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = config_from(args)
    except (ValueError, OSError) as exc:
        print(f"slinfer simulate: {exc}", file=sys.stderr)
        return 2
    update, close = _progress(cfg.duration, not args.no_progress and sys.stderr.isatty())
    started = time.perf_counter()
    try:
        outcome = simulate(cfg, on_progress=update)
    except (ValueError, OSError) as exc:
        print(f"slinfer simulate: {exc}", file=sys.stderr)
        return 2
    finally:
        close()
    wall = time.perf_counter() - started
    text = dumps(outcome.report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    if args.plot:
        from sim.plots import write_plots
        lora = (f" LoRA {cfg.lora_serving} over {cfg.lora_backbones}" if cfg.lora_adapters else "")
        write_plots(outcome, Path(args.plot), title=f"{cfg.system} {cfg.models}x{cfg.model_size}{lora}")
    # wall time goes to stderr only: the report stays byte-identical across runs
    print(f"simulated {outcome.report['sim_seconds']:.0f} s in {wall:.1f} s wall "
          f"({outcome.report['sim_seconds'] / max(wall, 1e-9):.0f} sim-s per wall-s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
