"""Report contents, determinism, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sim.cli import main
from sim.report import REPORT_KEYS, dumps
from sim.config import SimConfig
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(models=8, duration=120.0, cpu_nodes=1, gpu_nodes=1, rps=0.5, cv=2.0)


def test_report_has_every_key():
    for system in ("slinfer", "sllm", "sllm+c", "sllm+c+s"):
        rep = simulate(SimConfig(system=system, **SMALL)).report
        missing = [k for k in REPORT_KEYS if k not in rep]
        assert not missing, (system, missing)
        assert set(rep["decode_tokens_per_s_per_node"]) == {"cpu", "gpu"}
        assert rep["requests"] > 20
        assert rep["slo_met"] <= rep["requests"] - rep["dropped"]
        assert 0.0 <= rep["slo_attainment"] <= 1.0


def test_same_seed_same_bytes_other_seed_other_report():
    a = dumps(simulate(SimConfig(system="slinfer", seed=1, **SMALL)).report)
    b = dumps(simulate(SimConfig(system="slinfer", seed=1, **SMALL)).report)
    c = dumps(simulate(SimConfig(system="slinfer", seed=2, **SMALL)).report)
    assert a == b and a != c


def test_identical_bytes_across_processes_with_different_hash_seeds(tmp_path):
    outs = []
    for hs in ("1", "2"):
        out = tmp_path / f"r{hs}.json"
        env = {**os.environ, "PYTHONHASHSEED": hs}
        subprocess.run([sys.executable, "-m", "sim", "--models", "6", "--duration", "90",
                        "--cpu-nodes", "1", "--gpu-nodes", "1", "--rps", "0.4", "--cv", "2",
                        "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_cli_writes_report_and_plots(tmp_path, capsys):
    out, plots = tmp_path / "rep.json", tmp_path / "plots"
    rc = main(["--system", "sllm+c", "--models", "4", "--duration", "60", "--rps", "0.3",
               "--cpu-nodes", "1", "--gpu-nodes", "1", "--out", str(out), "--plot", str(plots)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["params"]["system"] == "sllm+c"
    assert (plots / "ttft_cdf.png").stat().st_size > 0
    assert (plots / "nodes_used.png").stat().st_size > 0
    assert "sim-s per wall-s" in capsys.readouterr().err


def test_cli_rejects_bad_input(capsys):
    assert main(["--models", "0"]) == 2
    assert main(["--cpu-nodes", "0", "--gpu-nodes", "0"]) == 2
    assert "slinfer simulate" in capsys.readouterr().err


def test_ablations_reach_the_core():
    rep = simulate(SimConfig(system="slinfer", no_cpu=True, **SMALL)).report
    assert rep["avg_cpu_nodes_used"] == 0.0 and rep["served_on"]["cpu"] == 0
    rep = simulate(SimConfig(system="slinfer", no_consolidation=True, **SMALL)).report
    assert rep["preemptions"] == 0
