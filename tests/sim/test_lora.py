"""LoRA functions in the simulator (sim/lora.py): adapters over shared backbones vs one merged
model per function, through the same SLINFER core."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, slo_for_input
from sim import lora
from sim import profiles as P
from sim.cli import main as cli_main
from sim.engine import SimRequest, run
from sim.config import SimConfig, params_of
from sim.simulate import simulate

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
GiB = 2**30


def run_lora(serving: str, reqs: list[tuple[float, int, int, int]], adapters: int = 4,
             backbones: int = 1, cpu: int = 0, gpu: int = 1, **kw):
    """reqs: (arrival, function index, input, output). Exact profile times (no noise)."""
    kw.setdefault("noise", 0.0)
    cfg = SimConfig(system=kw.pop("system", "slinfer"), lora_adapters=adapters,
                    lora_backbones=backbones, lora_serving=serving, cpu_nodes=cpu, gpu_nodes=gpu,
                    duration=60.0, **kw)
    lay = lora.layout(cfg)
    system, memory = lora.build_system(cfg, lay)
    requests = [SimRequest(f"r{i}", lay.functions[f], inp, out, t, slo_for_input(inp))
                for i, (t, f, inp, out) in enumerate(reqs)]
    metrics = lora.MemoryMetrics(memory)
    result = run(system, requests, metrics, horizon=600.0)
    return system, requests, metrics, lay, result


# --- sizes and costs ------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape", [
    # shared.modelgen.SHAPE_SPECS: hidden, intermediate, layers, kv heads x head dim, dtype bytes
    ("lora_small.json", (512, 1536, 12, 4 * 64, 4)),
    ("lora_llama-3.2-1b.json", (2048, 8192, 16, 8 * 64, 2)),
])
def test_adapter_bytes_formula_matches_what_the_engine_held(name, shape):
    measured = json.loads((RESULTS / name).read_text())
    hidden, inter, layers, kv, dtype = shape
    assert lora.adapter_bytes(hidden, inter, layers, kv, measured["rank"], dtype) \
        == measured["memory"]["engine_adapter_bytes_each"]


def test_simulated_shapes_adapter_bytes():
    # Llama-2-7B, rank 8, all seven projections: 8 x 78080 x 32 layers x 2 bytes = 40.0 MB, about
    # 0.3% of the 13.5 GB backbone; it doubles with the rank.
    b7 = lora.shape_adapter_bytes(P.SHAPES["7b"], 8)
    assert b7 == 8 * (4 * 8192 + 3 * (4096 + 11008)) * 32 * 2 == 39_976_960
    assert b7 / P.SHAPES["7b"].weight_bytes < 0.005
    assert lora.shape_adapter_bytes(P.SHAPES["7b"], 16) == 2 * b7
    assert lora.shape_adapter_bytes(P.SHAPES["3b"], 8) < b7 < lora.shape_adapter_bytes(P.SHAPES["13b"], 8)


def test_unmerged_cost_is_the_measured_curve_in_the_core_profile():
    rows = json.loads((RESULTS / "lora_small.json").read_text())["decode"]["rows"]
    cost = lora.lora_cost(8)
    for (batch, value), row in zip(lora.MEASURED_DECODE_OVERHEAD, rows):
        assert row["batch"] == batch and value == pytest.approx(row["overhead"], abs=1e-4)
        assert cost.decode_factor(8, batch) == pytest.approx(1 + value)
    assert cost.decode_factor(8, 512) == cost.decode_factor(8, 32)  # flat past the last point
    assert cost.decode_factor(8, 1) < cost.decode_factor(8, 4) < cost.decode_factor(8, 8)
    assert cost.prefill_factor(8) == pytest.approx(1.0913)  # assumed: the batch-32 figure
    assert lora.lora_cost(8, constant=0.05).decode_factor(8, 64) == pytest.approx(1.05)
    # In the profiles the core plans with: adapter requests pay it, plain ones do not.
    perf = PerfModel({("m", Hardware.GPU): P.gpu_profile(P.SHAPES["7b"])})
    base = perf.get("m", Hardware.GPU)
    lora.lora_perf(perf, cost)
    slower = perf.get("m", Hardware.GPU)
    assert slower.decode_s(8, 1000) == base.decode_s(8, 1000)
    assert slower.decode_s(8, 1000) * slower.lora_decode_factor(8, 8) == pytest.approx(
        base.decode_s(8, 1000) * 1.2837)


def test_layout_spreads_functions_over_backbones():
    cfg = SimConfig(lora_adapters=64, lora_backbones=4)
    lay = lora.layout(cfg)
    assert cfg.models == 64 and len(lay.functions) == 64 and len(lay.backbones) == 4
    per = {}
    for fn in lay.functions:
        per.setdefault(lay.backbone_of[fn], []).append(fn)
    assert sorted(len(v) for v in per.values()) == [16] * 4
    # the functions are the default run's models, so their arrivals are that run's
    assert lay.functions[:2] == ["m000-7b", "m001-7b"]
    assert all(a.bytes == 39_976_960 for a in lay.adapters.values())


# --- backbone sharing through the core -------------------------------------------------------
def test_adapters_share_one_backbone_instance_and_add_only_their_bytes():
    # Three functions over one 7B backbone on one GPU, one request each, spaced so each finds
    # the backbone loaded. Shared: one load of the backbone, then an adapter (40 MB) per
    # function; merged: a full 13.5 GB model per function.
    reqs = [(0.0, 0, 512, 40), (0.5, 1, 512, 40), (1.0, 2, 512, 40)]
    sys_s, rq_s, m_s, lay, _ = run_lora("shared", reqs)
    sys_m, rq_m, m_m, _, _ = run_lora("merged", reqs)
    assert all(r.slo_met for r in rq_s + rq_m)
    assert m_s.counters["cold_starts"] == 1 and m_s.counters["adapter_loads"] == 3
    assert m_m.counters["cold_starts"] == 3 and m_m.counters["adapter_loads"] == 0
    backbone = P.SHAPES["7b"].weight_bytes
    adapter = lora.shape_adapter_bytes(P.SHAPES["7b"], 8)
    assert m_s.weight_peak == backbone + 3 * adapter
    assert m_m.weight_peak == 3 * backbone
    assert {r.hardware for r in rq_s} == {Hardware.GPU}


def test_a_second_request_of_a_loaded_adapter_loads_nothing():
    reqs = [(0.0, 0, 256, 60), (2.0, 0, 256, 5), (2.1, 1, 256, 5)]
    _, rq, m, _, _ = run_lora("shared", reqs)
    assert all(r.finished_at is not None for r in rq)
    assert m.counters["cold_starts"] == 1
    assert m.counters["adapter_loads"] == 2  # function 0 once, function 1 once


def test_an_adapter_on_a_resident_backbone_waits_only_for_its_own_load():
    # The backbone is loaded and busy decoding function 0; function 1's request then waits for
    # its 40 MB adapter (bytes / 13.48 GB/s ~ 3 ms), not for a 1 s model load: no cold-start
    # grace, and it is counted among the requests that waited for a load.
    reqs = [(0.0, 0, 256, 80), (2.0, 1, 256, 3)]
    sys_, rq, m, _, result = run_lora("shared", reqs)
    late = rq[1]
    assert late.grace_s == 0.0 and late.slo_met
    assert late.ttft < 0.2  # vs > 1 s for the merged model's cold start
    assert "r1" in sys_.waited_for_adapter
    _, rq_m, _, _, _ = run_lora("merged", reqs)
    assert rq_m[1].ttft > 1.0 and rq_m[1].grace_s == pytest.approx(P.load_s(P.SHAPES["7b"]))
    adapter_s = lora.shape_adapter_bytes(P.SHAPES["7b"], 8) / P.LOAD_BYTES_PER_S
    assert adapter_s < 0.005


def test_shared_backbone_decodes_pay_the_unmerged_cost():
    reqs = [(0.0, 0, 256, 30)]
    _, rq0, _, _, _ = run_lora("shared", reqs, lora_decode_overhead=0.0)
    _, rq1, _, _, _ = run_lora("shared", reqs, lora_decode_overhead=0.5)
    tpot0 = rq0[0].tpot
    assert rq1[0].tpot == pytest.approx(1.5 * tpot0, rel=1e-6)


# --- whole runs ------------------------------------------------------------------------------
SHORT = dict(duration=300.0, seed=1, cpu_nodes=2, gpu_nodes=2)


def test_trace_run_with_sharing_loads_and_holds_less_than_merged():
    shared = simulate(SimConfig(lora_adapters=16, lora_backbones=2, **SHORT)).report
    merged = simulate(SimConfig(lora_adapters=16, lora_backbones=2, lora_serving="merged",
                                **SHORT)).report
    assert shared["requests"] == merged["requests"] > 100
    s, m = shared["lora"], merged["lora"]
    assert s["adapter_loads"] > 0 and m["adapter_loads"] == 0
    assert s["instance_loads"] < m["instance_loads"]
    assert s["weights_gib_avg"] < m["weights_gib_avg"]
    assert s["ttft_waiting_for_a_load_p50"] < m["ttft_waiting_for_a_load_p50"]


def test_merged_lora_run_is_the_plain_run_of_as_many_models():
    cfg = SimConfig(models=12, **SHORT)
    plain = simulate(cfg).report
    merged = simulate(replace(cfg, lora_adapters=12, lora_backbones=3, lora_serving="merged")).report
    section = merged.pop("lora")
    params_plain, params_merged = plain.pop("params"), merged.pop("params")
    assert plain == merged
    assert {k: v for k, v in params_merged.items() if not k.startswith("lora_")} == params_plain
    assert section["serving"] == "merged" and section["instance_loads"] == plain["cold_starts"]


def test_sllm_baseline_runs_merged_lora_functions():
    rep = simulate(SimConfig(system="sllm", lora_adapters=8, lora_serving="merged", **SHORT)).report
    assert rep["requests"] > 0 and rep["lora"]["memory_held_gib_avg"] > 0
    # an sllm instance owns its whole GPU: the memory held is whole nodes
    assert rep["lora"]["memory_held_gib_peak"] % (P.GPU_MEMORY_BYTES / GiB) == pytest.approx(0.0)


def test_plain_runs_report_no_lora_parameters():
    assert not [k for k in params_of(SimConfig()) if k.startswith("lora")]
    assert "lora_rank" in params_of(SimConfig(lora_adapters=4))


@pytest.mark.parametrize("kw, message", [
    (dict(system="sllm", lora_adapters=4), "cannot share a backbone"),
    (dict(lora_adapters=4, lora_backbones=5), "lora_backbones"),
    (dict(lora_adapters=4, lora_rank=0), "lora_rank"),
    (dict(lora_adapters=4, lora_serving="both"), "lora_serving"),
    (dict(lora_adapters=4, lora_decode_overhead=-0.1), "lora_decode_overhead"),
])
def test_bad_lora_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kw)


def test_cli_lora_flags(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["--lora-adapters", "6", "--lora-backbones", "2", "--duration", "120",
                     "--cpu-nodes", "1", "--gpu-nodes", "1", "--no-progress",
                     "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["params"]["lora_adapters"] == 6 and rep["lora"]["backbones"] == 2
    assert cli_main(["--system", "sllm", "--lora-adapters", "6", "--no-progress"]) == 2
    assert "lora-serving merged" in capsys.readouterr().err


def test_idle_adapters_are_offloaded_when_a_new_one_needs_the_room(monkeypatch):
    # One GPU with room for the backbone, its KV pool (the eq. 2 floor of 4096 tokens at the 25%
    # watermark) and two and a half adapters. Three functions call one after another: the third
    # adapter fits only once an idle one is offloaded (§4.3), and it is served.
    shape = P.SHAPES["7b"]
    adapter = lora.shape_adapter_bytes(shape, 8)
    kv_pool = int(shape.max_context * shape.kv_bytes_per_token * 1.25)
    monkeypatch.setattr(P, "GPU_MEMORY_BYTES", shape.weight_bytes + kv_pool + int(2.5 * adapter))
    reqs = [(0.0, 0, 256, 5), (2.0, 1, 256, 5), (4.0, 2, 256, 5)]
    _, rq, m, _, _ = run_lora("shared", reqs, keep_alive=30.0)
    assert all(r.slo_met for r in rq)
    assert m.counters["cold_starts"] == 1 and m.counters["adapter_loads"] == 3
    assert m.counters["adapter_offloads"] == 1
    assert m.weight_peak <= P.GPU_MEMORY_BYTES


# --- pre-loading (ServerlessLoRA §4.1, sim/preload.py) -----------------------------------------
def test_an_adapter_called_before_is_preloaded_onto_the_backbones_next_instance():
    # Function 1 runs at t = 0 and its instance is reclaimed (1 s keep-alive); function 0 then
    # starts a new instance of the backbone at t = 3. The turn at t = 5 attaches function 1's
    # adapter to it (it was called; the placer's plan), so its next request at t = 7 finds it
    # there. Without pre-loading that request waits for the adapter's load (3 ms here, hidden
    # behind the iteration in flight: the TTFTs come out the same).
    reqs = [(0.0, 1, 256, 5), (3.0, 0, 256, 300), (7.0, 1, 256, 5)]
    on, rq_on, m_on, _, _ = run_lora("shared", reqs)
    off, rq_off, m_off, _, _ = run_lora("shared", reqs, lora_preload_s=0.0)
    assert m_on.counters["adapter_preloads"] == 1 and "adapter_preloads" not in m_off.counters
    assert m_on.counters["cold_starts"] == m_off.counters["cold_starts"] == 2
    assert "r2" not in on.waited_for_adapter and "r2" in off.waited_for_adapter
    assert all(r.slo_met for r in rq_on + rq_off)


def test_a_planned_checkpoint_is_read_into_the_dram_tier_before_its_cold_start():
    # The placer's plan (standing in for its message) puts the backbone's checkpoint in the
    # node's cold DRAM tier: the turn at t = 5 reads it from the registry (10.8 s on the node's
    # I/O queue, once: the turns meanwhile find the queue busy), and the cold start at t = 20
    # loads from DRAM. Without the plan that cold start reads the registry.
    from shared.core.lora import NodePreload

    def cold_start_tier(plan: bool) -> tuple[dict, float]:
        cfg = SimConfig(lora_adapters=2, cpu_nodes=0, gpu_nodes=1, storage="tiered",
                        duration=60.0, noise=0.0)
        lay = lora.layout(cfg)
        system, memory = lora.build_system(cfg, lay)
        if plan:
            system.preloading.sent["gpu0"] = (0.0, NodePreload(("bb0-7b",), ()))
        req = SimRequest("r0", lay.functions[0], 256, 5, 20.0, slo_for_input(256))
        metrics = lora.MemoryMetrics(memory)
        run(system, [req], metrics, horizon=120.0)
        return metrics.counters, req.ttft

    (with_plan, ttft), (without, ttft_cold) = cold_start_tier(True), cold_start_tier(False)
    assert with_plan["checkpoint_preloads"] == 1 and with_plan["loads:dram"] == 1
    assert "checkpoint_preloads" not in without and without["loads:registry"] == 1
    assert ttft + 5.0 < ttft_cold


def test_benchmark_section_is_generated_from_the_summary_and_replaced_in_place(tmp_path):
    from bench.sim import lora as bench
    row = {**{k: 1.0 for k in (*bench.KEYS, *bench.LORA_KEYS)}, "served_on": {"cpu": 1, "gpu": 0}}
    runs = {f"main/{size}/{key}/s0": dict(row, slo_attainment=0.5 + i / 10, avg_gpu_nodes_used=4.0 - i)
            for size in bench.SIZES for i, key in enumerate(
                ["slinfer-shared", "slinfer-merged", "sllm-merged", "sllm+c-merged", "sllm+c+s-merged"])}
    text = bench.table({"runs": runs, "meta": {"seeds": [0], "command": "x"}})
    assert text.startswith(bench.BEGIN) and text.rstrip().endswith(bench.END)
    assert "| SLINFER, shared backbones | 0.500 |" in text
    assert "GPU nodes used 4.00 vs 3.00 merged (+33%)" in text
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\nbefore\n")
    bench.write_section(doc, text)
    once = doc.read_text()
    bench.write_section(doc, text)
    assert doc.read_text() == once and once.count(bench.BEGIN) == 1 and "before" in once
