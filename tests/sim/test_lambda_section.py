"""The λScale simulator section (bench/sim/lambda_section.py) comes from the summary's rows and
replaces only its own block of BENCHMARKS.md."""

from __future__ import annotations

from bench.sim import lambda_section as section
from bench.sim import scaleout as bench


def _row(p90: float, **extra) -> dict:
    row = {"slo_attainment": 0.9, "spike_slo_attainment": 0.8, "ttft_p50": 1.0, "ttft_p90": 2.0,
           "ttft_p99": "inf", "spike_ttft_p50": 1.0, "spike_ttft_p90": p90, "spike_ttft_p99": 9.0,
           "spike_requests": 100, "spike_dropped": 0, "gpu_node_seconds": 1000.0,
           "burst_instances": 0}
    return {**row, **extra}


def _summary() -> dict:
    runs = {}
    for seed, p90s in enumerate(((8.0, 4.0, 2.0), (10.0, 6.0, 4.0))):
        for variant, p90 in zip(("none", "100", "400"), p90s):
            loads = {} if variant == "none" else {
                "spike_loads": {"dram": 4, "multicast": 2, "pipeline": 1},
                "spike_multicast_sources_mean": 1.5, "spike_loads_sharing_a_multicast": 2}
            runs[f"lambda/7b/slinfer+burst/{variant}/s{seed}"] = _row(p90, burst_instances=3,
                                                                      **loads)
    return {"runs": runs, "meta": {"seeds": [0, 1], "command": "x"}}


def test_rows_are_means_over_seeds_with_the_spike_tails_range():
    text = section.lambda_table(_summary())
    assert text.startswith(bench.BEGIN_L) and text.rstrip().endswith(bench.END_L)
    line = next(ln for ln in text.splitlines() if "| slinfer + burst | 100 Gb/s |" in ln)
    # p90 5.00 = mean of 4 and 6, against the no-link mean 9.00: 1.80×
    assert "5.00 [4.00–6.00]" in line and "1.00× / 1.80×" in line
    assert "4.0 / 2.0 / 1.0 (k 1.5, 2.0 shared)" in line and line.endswith("| 3.0 |")
    assert "∞" in line  # an infinite TTFT p99 shows as such


def test_writing_replaces_only_the_lambda_block(tmp_path):
    doc = tmp_path / "B.md"
    coco = f"{bench.BEGIN_C}\nCoCoServe rows\n{bench.END_C}"
    doc.write_text(f"# B\n\n{bench.BEGIN_L}\nSTALE ROWS\n{bench.END_L}\n\n{coco}\n")
    text = section.lambda_table(_summary())
    bench.write_section(text, doc, bench.BEGIN_L, bench.END_L, "<!-- anchor -->")
    once = doc.read_text()
    bench.write_section(text, doc, bench.BEGIN_L, bench.END_L, "<!-- anchor -->")
    assert doc.read_text() == once and "STALE ROWS" not in once and coco in once
    assert once.count(bench.BEGIN_L) == 1
