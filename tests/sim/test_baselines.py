"""Each baseline's rules (SLINFER §IX-A), on hand-made requests."""

from __future__ import annotations

import pytest

from shared.core.types import Hardware
from sim import profiles as P
from sim.baselines import BaselineConfig

from .helpers import run_requests

GPU7 = P.gpu_profile(P.SHAPES["7b"])
CPU7 = P.cpu_profile(P.SHAPES["7b"])


def test_hand_worked_single_request_on_sllm():
    # One 7B model, one GPU, one request at t=0: input 1024 tokens, 3 output tokens.
    # Cold start: 13.48 GB at ServerlessLLM's 13.48 GB/s = 1.000 s (ready at 1.0).
    # Prefill (a profile grid point): 5 ms + (2*6.74e9*1024 + 4*32*4096*1024^2) FLOP
    #   / (312e12 * 0.6) = 0.005 + 0.07374 + 0.00294 = 0.08168 s -> first token at 1.08168.
    # Two decodes, batch 1, context 1025 then 1026: 3 ms + (13.48e9 + L*524288 B) / 1.4e12 B/s
    #   + 2*6.74e9 / 1.872e14 = 0.013084 s each -> finish at 1.08168 + 0.026168 = 1.10785.
    # SLO: TTFT 1024/512 = 2 s plus 1 s cold-start grace; TPOT 0.013 s <= 0.25 s: met.
    _, reqs, m, _ = run_requests("sllm", "7b", 0, 1, 1, [(0.0, 0, 1024, 3)])
    r = reqs[0]
    assert r.first_token_at == pytest.approx(1.08168, abs=2e-4)
    assert r.finished_at == pytest.approx(1.10785, abs=3e-4)
    assert r.grace_s == pytest.approx(1.0)
    assert r.slo_met and r.hardware is Hardware.GPU
    assert m.counters["cold_starts"] == 1


def test_sllm_gives_each_instance_an_exclusive_gpu():
    # Model 0 occupies the only GPU for ~2.4 s; model 1's short request (TTFT SLO 0.5 s) cannot
    # share it, waits in the queue and is dropped once it has waited 0.5 s.
    _, reqs, m, _ = run_requests("sllm", "7b", 0, 1, 2, [(0.0, 0, 1024, 100), (0.1, 1, 100, 10)])
    assert reqs[0].slo_met
    assert reqs[1].dropped
    assert m.counters["cold_starts"] == 1


def test_sllm_scales_out_at_the_concurrency_limit():
    # 13B on GPU: limit 16. 17 simultaneous requests -> a second instance on the second GPU.
    reqs_in = [(0.0, 0, 200, 5)] * 17
    sys_, reqs, m, _ = run_requests("sllm", "13b", 0, 2, 1, reqs_in)
    assert m.counters["cold_starts"] == 2
    assert all(r.finished_at is not None for r in reqs)
    with_limit = run_requests("sllm", "13b", 0, 2, 1, [(0.0, 0, 200, 5)] * 16)
    assert with_limit[2].counters["cold_starts"] == 1


def test_sllm_c_prefers_cpu_and_sllm_never_uses_it():
    _, reqs, _, _ = run_requests("sllm+c", "7b", 1, 1, 1, [(0.0, 0, 512, 4)])
    assert reqs[0].hardware is Hardware.CPU
    _, reqs, _, _ = run_requests("sllm", "7b", 1, 1, 1, [(0.0, 0, 512, 4)])
    assert reqs[0].hardware is Hardware.GPU


def test_sllm_c_s_puts_two_instances_on_one_node_at_half_speed_while_both_run():
    # Two 7B models, one GPU: both get half of it. Both are ready at the same instant: the first
    # prefill starts on an idle node (full speed), the second while the first runs (twice the
    # profile time).
    sys_, reqs, m, _ = run_requests("sllm+c+s", "7b", 0, 1, 2, [(0.0, 0, 1024, 2), (0.0, 1, 1024, 2)])
    assert m.counters["cold_starts"] == 2
    assert all(r.hardware is Hardware.GPU and r.finished_at is not None for r in reqs)
    load = GPU7.load_s
    first, second = sorted(reqs, key=lambda r: r.first_token_at)
    assert first.first_token_at == pytest.approx(load + GPU7.prefill_s(1024), abs=1e-6)
    assert second.first_token_at == pytest.approx(load + 2 * GPU7.prefill_s(1024), abs=1e-6)
    # Alone on its half (the other half idle), an instance has the whole node.
    _, (alone,), _, _ = run_requests("sllm+c+s", "7b", 0, 1, 2, [(0.0, 1, 1024, 2)])
    assert alone.first_token_at == pytest.approx(load + GPU7.prefill_s(1024), abs=1e-6)
    # Half an A100: 40 GiB minus the weights for KV.
    cfg = BaselineConfig.named("sllm+c+s")
    assert cfg.limit(Hardware.GPU, "7b") == 12 and cfg.limit(Hardware.CPU, "7b") == 4


def test_sllm_c_s_gives_13b_a_whole_cpu_node():
    cfg = BaselineConfig.named("sllm+c+s")
    assert cfg.slots_needed(Hardware.CPU, "13b") == 2
    assert cfg.slots_needed(Hardware.GPU, "13b") == 1
    assert cfg.slots_needed(Hardware.CPU, "7b") == 1
    # Two 13B models, one CPU and one GPU: the first takes the whole CPU, the second the GPU.
    _, reqs, m, _ = run_requests("sllm+c+s", "13b", 1, 1, 2, [(0.0, 0, 256, 2), (0.0, 1, 256, 2)])
    assert sorted(r.hardware.value for r in reqs) == ["cpu", "gpu"]


def test_concurrency_limits_are_the_papers():
    plain = BaselineConfig.named("sllm+c")
    assert [plain.limit(Hardware.CPU, s) for s in ("3b", "7b", "13b")] == [59, 15, 6]
    assert [plain.limit(Hardware.GPU, s) for s in ("3b", "7b", "13b")] == [160, 32, 16]
    shared = BaselineConfig.named("sllm+c+s")
    assert [shared.limit(Hardware.CPU, s) for s in ("3b", "7b", "13b")] == [23, 4, 6]
    assert [shared.limit(Hardware.GPU, s) for s in ("3b", "7b", "13b")] == [71, 12, 4]


def test_keep_alive_reclaims_and_a_later_request_cold_starts_again():
    # Finishes at ~1.11 s; keep-alive 1 s -> unloaded at ~2.11; the request at 5 s cold-starts.
    _, reqs, m, _ = run_requests("sllm", "7b", 0, 1, 1, [(0.0, 0, 1024, 3), (5.0, 0, 1024, 3)])
    assert m.counters["cold_starts"] == 2
    assert reqs[1].grace_s == pytest.approx(1.0)
    # ...but one within the keep-alive reuses the warm instance (no grace).
    _, reqs, m, _ = run_requests("sllm", "7b", 0, 1, 1, [(0.0, 0, 1024, 3), (1.5, 0, 1024, 3)])
    assert m.counters["cold_starts"] == 1 and reqs[1].grace_s == 0.0
