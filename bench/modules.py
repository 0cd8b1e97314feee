"""CoCoServe's module-level scaling and λScale's execution pipelines on real processes (CPU): what
moving one decoder layer costs next to reloading a whole instance, and what running layers in
another process costs an iteration.

Everything runs on this machine: the instance in this process (torch engine), layer stages as
separate processes (`services.node.engines.stage_server`, spawned as a node spawns them), loopback TCP between
them. Measured, on one model shape:

- layer move: starting a stage process for the last layer (process start + reading that layer's
  bytes from the converted checkpoint), then `shed_layers` with requests in flight (the pause:
  their K/V of that layer exported, sent and imported, the layer dropped here), and the way back
  (`take_layers`, λScale's mode switch: the layer re-read here, its K/V received);
- whole-instance reload: the same instance unloaded and loaded again through the loader (the
  cost instance-level scaling pays per move), plus re-prefilling the requests in flight (a moved
  instance must rebuild their K/V);
- pipeline vs local: prefill (128, 512 tokens) and one decode step (batch 1, 8) with the second
  half of the layers in a stage process, against the local instance, both loaded and measured in
  turns; the difference per iteration / 2 is the measured hop (the `HopCost.latency_s` the core
  charges a pipeline);
- replication: a decode step (batch 8) with the second half of the layers replicated on a stage
  process (the batch split in two, the halves computed concurrently) against the local one, in
  turns.

Results are written after each part (a run cut short keeps what it measured).

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/modules.py --shape llama-3.2-1b
    .venv/bin/python bench/modules.py --table bench/results/modules_llama-3.2-1b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before torch starts OpenMP: a process that waits for another (the engine for its stage, a stage
# for the engine) must not keep its idle OpenMP threads spinning on the cores the other computes
# on. With the default (active) wait on these 2 cores, a hop measured ~190 ms instead of ~1 ms.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench.engines_cpu import machine  # noqa: E402
from services.node.engines.base import SamplingParams  # noqa: E402
from services.node.engines.torch_engine import TorchEngine  # noqa: E402
from services.node.loader import CheckpointLoader, LoaderSettings  # noqa: E402
from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index  # noqa: E402
from services.node.loader.convert import convert_checkpoint  # noqa: E402
from services.node.engines.stage_server import spawn_stage  # noqa: E402
from shared.modelgen import SHAPES, ensure_model  # noqa: E402

PARAMS = SamplingParams(max_tokens=10_000, ignore_eos=True)
IN_FLIGHT = 4  # requests decoding while a layer moves
IN_FLIGHT_PROMPT = 256


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 7 + salt) % 1000 for i in range(n)]


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _start_requests(engine: TorchEngine, n: int, prompt: int, tag: str) -> list[str]:
    ids = []
    for k in range(n):
        rid = f"{tag}-{k}"
        engine.add_request(rid, _prompt(prompt, k), PARAMS)
        engine.prefill(rid)
        ids.append(rid)
    for _ in range(3):
        engine.decode(ids)
    return ids


def _paired_prefill(engines: dict[str, TorchEngine], n: int, repeats: int) -> dict[str, float]:
    """Median prefill of n tokens on each engine, the engines taking turns (a change of the
    box's load hits both alike)."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(repeats):
        for name, engine in engines.items():
            rid = f"p{n}-{r}"
            engine.add_request(rid, _prompt(n, r), PARAMS)
            times[name].append(_timed(lambda: engine.prefill(rid)))
            engine.release(rid)
    return {k: statistics.median(v) for k, v in times.items()}


def _paired_decode(engines: dict[str, TorchEngine], batch: int, steps: int,
                   context: int = 128) -> tuple[dict[str, float], dict]:
    """Median decode step of `batch` requests on each engine, taking turns step by step; also
    how the rows were assigned to replicas (before they are released)."""
    ids = [f"d{batch}-{k}" for k in range(batch)]
    for engine in engines.values():
        for k, rid in enumerate(ids):
            engine.add_request(rid, _prompt(context, k), PARAMS)
            engine.prefill(rid)
        engine.decode(ids)  # warm
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            times[name].append(_timed(lambda: engine.decode(ids)))
    assigned = {name: engine.layout().assigned for name, engine in engines.items()}
    for engine in engines.values():
        for rid in ids:
            engine.release(rid)
    return {k: statistics.median(v) for k, v in times.items()}, assigned


def _save(out: dict, path: Path) -> None:
    out["load_average_after"] = os.getloadavg()
    path.write_text(json.dumps(out, indent=1) + "\n")


def measure(shape: str, data_dir: Path, repeats: int, steps: int, threads: int,
            path: Path) -> dict:
    model = ensure_model(data_dir, shape, shape)
    if read_index(default_checkpoint_dir(model)) is None:
        convert_checkpoint(model)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    half = layers // 2
    out: dict = {"shape": shape, "layers": layers, "machine": machine(), "repeats": repeats,
                 "decode_steps": steps, "stage_threads": threads or torch.get_num_threads(),
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    loader = CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    # -- pipeline vs local: both loaded, measured in turns --------------------------------------
    local = TorchEngine(model, loader=loader)
    first_load = _timed(local.load)
    stage = spawn_stage(model, half, layers, threads=threads,
                        log_path=logs / "modules_stage_pipeline.log")
    split = TorchEngine(model, remote_layers=[stage.address])
    split.load()
    pair = {"local": local, "pipeline": split}
    out["local"], out["pipeline"] = {}, {"remote_layers": [half, layers]}
    for n in (128, 512):
        got = _paired_prefill(pair, n, repeats)
        for k in pair:
            out[k][f"prefill_{n}_s"] = got[k]
    for b in (1, 8):
        got, _ = _paired_decode(pair, b, steps)
        for k in pair:
            out[k][f"decode_b{b}_s"] = got[k]
    split.unload()
    stage.stop()
    _save(out, path)

    # -- replication: a second instance (same weights, from the loader's memory) with replicas --
    stage = spawn_stage(model, half, layers, threads=threads,
                        log_path=logs / "modules_stage_replica.log")
    replicated = TorchEngine(model, loader=loader)
    replicated.load()
    replicated.replicate_layers(stage.address)
    got, assigned = _paired_decode({"local": local, "replicated": replicated}, 8, steps)
    out["replication"] = {"replicated_layers": [half, layers], "decode_b8_local_s": got["local"],
                          "decode_b8_replicated_s": got["replicated"],
                          "assigned": assigned["replicated"]}
    replicated.unload()
    stage.stop()
    gc.collect()
    _save(out, path)

    # -- one layer moved out and back, requests in flight; then a whole-instance reload ---------
    ids = _start_requests(local, IN_FLIGHT, IN_FLIGHT_PROMPT, "r")
    spawned = time.perf_counter()
    stage = spawn_stage(model, layers - 1, layers, threads=threads,
                        log_path=logs / "modules_stage_move.log")
    spawn_s = time.perf_counter() - spawned
    kv_layer = local.memory().kv_bytes_per_token // layers
    tokens = sum(local.requests[rid].computed for rid in ids)
    shed_s = _timed(lambda: local.shed_layers(stage.address))
    local.decode(ids)  # the requests keep decoding, one layer remote
    take_s = _timed(lambda: local.take_layers(layers - 1, layers))
    local.decode(ids)
    stage.stop()
    out["layer_move"] = {"stage_spawn_s": spawn_s, "stage_read_s": stage.load_s,
                         "layer_weight_bytes": stage.weight_bytes, "shed_pause_s": shed_s,
                         "kv_moved_bytes": tokens * kv_layer, "in_flight_tokens": tokens,
                         "take_back_s": take_s}
    weights = local.memory().weight_bytes
    contexts = [list(local.requests[rid].tokens) for rid in ids]
    local.unload()
    gc.collect()
    reload_engine = TorchEngine(model, loader=loader)
    reload_s = _timed(reload_engine.load)

    def reprefill() -> None:
        for rid, tokens_so_far in zip(ids, contexts):
            reload_engine.add_request(rid, tokens_so_far, PARAMS)
            reload_engine.prefill(rid)

    out["instance_reload"] = {"first_load_s": first_load, "reload_s": reload_s,
                              "tier": reload_engine.load_info.get("tier"),
                              "weight_bytes": weights, "reprefill_in_flight_s": _timed(reprefill),
                              "in_flight": IN_FLIGHT,
                              "in_flight_tokens": sum(len(c) for c in contexts)}
    reload_engine.unload()
    loader.close()
    _save(out, path)
    return out


def table(result: dict) -> str:
    """The BENCHMARKS.md rows of one result file."""
    loc, pipe = result["local"], result["pipeline"]
    move, reload, rep = result["layer_move"], result["instance_reload"], result["replication"]
    mb = 1 << 20
    hop = (pipe["decode_b1_s"] - loc["decode_b1_s"]) / 2
    lines = [
        f"Shape `{result['shape']}` ({result['layers']} layers), {result['machine']['cores']} "
        f"cores, load average {result['machine']['load_average_before'][0]:.1f} before / "
        f"{result['load_average_after'][0]:.1f} after; medians of {result['repeats']} prefills "
        f"and {result['decode_steps']} decode steps.",
        "",
        "| moving capacity | seconds | bytes |",
        "|---|---|---|",
        f"| one layer: stage process start + read its weights | {move['stage_spawn_s']:.2f} "
        f"(read {move['stage_read_s']:.2f}) | {move['layer_weight_bytes'] / mb:.0f} MiB |",
        f"| one layer: shed with {result['instance_reload']['in_flight']} requests in flight "
        f"(the pause) | {move['shed_pause_s']:.3f} | K/V {move['kv_moved_bytes'] / mb:.1f} MiB |",
        f"| one layer back (mode switch: re-read + K/V received) | {move['take_back_s']:.3f} | |",
        f"| whole instance: reload through the loader ({reload['tier']}) | "
        f"{reload['reload_s']:.2f} | {reload['weight_bytes'] / mb:.0f} MiB |",
        f"| whole instance: + re-prefill of the {reload['in_flight']} requests in flight | "
        f"{reload['reload_s'] + reload['reprefill_in_flight_s']:.2f} | |",
        "",
        "| iteration | local (s) | layers "
        f"{pipe['remote_layers'][0]}-{pipe['remote_layers'][1] - 1} in a stage process (s) | "
        "ratio |",
        "|---|---|---|---|",
    ]
    for key, name in (("prefill_128_s", "prefill 128 tokens"), ("prefill_512_s",
                      "prefill 512 tokens"), ("decode_b1_s", "decode step, batch 1"),
                      ("decode_b8_s", "decode step, batch 8")):
        lines.append(f"| {name} | {loc[key]:.3f} | {pipe[key]:.3f} | "
                     f"{pipe[key] / loc[key]:.2f}x |")
    lines += ["", f"Measured hop (decode batch 1, split - local, / 2): {hop * 1000:.1f} ms. "
              f"Replication of layers {rep['replicated_layers'][0]}-"
              f"{rep['replicated_layers'][1] - 1} onto a stage process, decode step at batch 8: "
              f"{rep['decode_b8_local_s']:.3f} s local, {rep['decode_b8_replicated_s']:.3f} s "
              f"replicated ({rep['decode_b8_local_s'] / rep['decode_b8_replicated_s']:.2f}x "
              f"throughput; rows per replica {rep['assigned']})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of each stage")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="print a result file's rows")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    out = args.out or ROOT / "bench" / "results" / f"modules_{args.shape}.json"
    result = measure(args.shape, args.data_dir, args.repeats, args.steps, args.threads, out)
    result["command"] = " ".join(sys.argv)
    _save(result, out)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
