"""Unmerged LoRA's iteration cost in the core: a batch with adapter requests is predicted slower
by the factor the profile measured for its rank (node scheduler, shadow validation, SLO check,
placement alike); a batch without adapters is predicted exactly as before."""

import json

import pytest

from shared.cluster import profile_from_json, profile_to_json, request_view
from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.evaluate import evaluate
from shared.core.iteration import IterationChoice, IterationKind, predict_seconds
from shared.core.perf_model import UNMEASURED_LORA, LoraCost
from shared.core.shadow import shadow_validate
from shared.core.types import SLO, Hardware, InstanceView, RequestView
from shared.schemas import InferenceRequest

from tests.core.factories import flat_profile, linear_profile, loaded, model, node, perf_for, request

COST = LoraCost(ranks=[8, 32], batch_sizes=[1, 8], decode=[[0.2, 0.1], [0.4, 0.3]],
                prefill=[0.05, 0.15])


def with_lora(profile, cost=COST):
    from dataclasses import replace
    return replace(profile, lora=cost)


def lora_request(rid, rank=8, **kw):
    from dataclasses import replace
    return replace(request(rid, **kw), lora_rank=rank)


def test_lora_cost_is_read_per_rank_and_batch():
    assert COST.decode_factor(8, 1) == pytest.approx(1.2)
    assert COST.decode_factor(32, 8) == pytest.approx(1.3)
    assert COST.decode_factor(20, 1) == pytest.approx(1.3)  # halfway between the ranks
    assert COST.decode_factor(8, 4) == pytest.approx(1 + 0.2 - 0.1 * 3 / 7)  # along the batch
    assert COST.decode_factor(8, 64) == pytest.approx(1.1)  # a ratio: held past the last batch
    assert COST.decode_factor(4, 1) == pytest.approx(1.2)  # below the smallest rank: its cost
    assert COST.decode_factor(56, 1) == pytest.approx(1.6)  # past the largest: along the last step
    assert COST.prefill_factor(32) == pytest.approx(1.15)
    falling = LoraCost([8, 32], [1], [[0.3], [0.2]], [0.1, 0.1])
    assert falling.decode_factor(64, 1) == pytest.approx(1.2)  # never below the largest's


def test_plain_requests_cost_the_plain_table_even_with_a_lora_profile():
    profile = with_lora(linear_profile("m", Hardware.CPU))
    assert profile.lora_decode_factor(0, 4) == 1.0 and profile.lora_prefill_factor(0) == 1.0
    assert profile.prefill_through(300, 0) == profile.prefill_s(300)
    assert profile.prefill_through(300, 32) == pytest.approx(profile.prefill_s(300) * 1.15)


def test_an_unmeasured_profile_charges_the_documented_assumption():
    profile = linear_profile("m", Hardware.CPU)
    assert profile.lora is None
    assert profile.lora_decode_factor(8, 4) == UNMEASURED_LORA.decode_factor(8, 4) > 1.0


def _instance(requests, spec=None):
    return InstanceView("i", spec or model("m"), "n", requests=requests)


def test_a_batch_with_an_adapter_request_is_predicted_slower_by_the_profiled_factor():
    profile = with_lora(linear_profile("m", Hardware.CPU))
    plain = [request(f"p{k}", generated=3) for k in range(8)]
    mixed = [*plain[:7], lora_request("a", rank=32, generated=3)]
    choice = IterationChoice("i", IterationKind.DECODE, tuple(r.request_id for r in plain), 0.0)
    base = predict_seconds(choice, _instance(plain), profile)
    assert base == profile.decode_s(8, 103)  # exactly the plain table
    choice = IterationChoice("i", IterationKind.DECODE, tuple(r.request_id for r in mixed), 0.0)
    assert predict_seconds(choice, _instance(mixed), profile) == pytest.approx(base * 1.3)
    prefill = IterationChoice("i", IterationKind.PREFILL, ("x",), 0.0)
    x = lora_request("x", rank=8)
    assert predict_seconds(prefill, _instance([x]), profile) == pytest.approx(
        profile.prefill_s(100) * 1.05)


def test_the_node_scheduler_plans_an_adapter_batch_at_its_measured_cost():
    spec = model("m")
    cost = LoraCost([8], [1], [[0.5]], [0.0])
    sched = node(perf=perf_for(with_lora(flat_profile("m", Hardware.GPU, decode_s=0.02), cost)))
    iid = loaded(sched, None, request("p", ttft=5.0), spec)
    sched.finish_iteration(sched.step(0.0).iteration, 0.1)  # its prefill
    assert sched.step(0.1).predicted_s == pytest.approx(0.02)  # a plain decode
    sched.finish_iteration(sched.step(0.1).iteration, 0.12)
    res = sched.admit(lora_request("a", ttft=5.0), iid, spec, 0.12)
    assert res.admission.ok
    sched.finish_iteration(sched.step(0.12).iteration, 0.2)  # the adapter request's prefill
    assert sched.step(0.2).predicted_s == pytest.approx(0.03)  # the mixed batch


def test_shadow_validation_refuses_an_adapter_request_whose_measured_cost_breaks_the_tpot_budget():
    """One decode step of 8 plain requests takes 0.2 s (with the 10% margin 0.22 s < 0.25 s);
    through a rank-8 adapter it takes 30% more (0.286 s > 0.25 s)."""
    spec = model("m")
    cost = LoraCost([8], [1], [[0.3]], [0.0])
    profiles = {"i": with_lora(flat_profile("m", Hardware.GPU, prefill_s=0.01, decode_s=0.2), cost)}
    batch = [request(f"p{k}", ttft=5.0, generated=1) for k in range(7)]
    inst = InstanceView("i", spec, "n", requests=batch)
    config = CoreConfig()
    plain = request("new", ttft=5.0)
    assert shadow_validate([inst], profiles, "i", plain, 0.0, 0.0, config) is AdmitReason.ADMITTED
    adapter = lora_request("new", ttft=5.0)
    assert shadow_validate([inst], profiles, "i", adapter, 0.0, 0.0, config) is AdmitReason.TPOT_BUDGET
    # An adapter request already in the batch makes the batch slow for a plain newcomer too.
    inst = InstanceView("i", spec, "n", requests=[*batch[:6], lora_request("old", ttft=5.0,
                                                                               generated=1)])
    assert shadow_validate([inst], profiles, "i", plain, 0.0, 0.0, config) is AdmitReason.TPOT_BUDGET


def test_shadow_validation_charges_an_adapter_prefill_its_measured_cost():
    """A prefill of 1 s against a 1.2 s TTFT SLO passes (1.1 s with the margin); through an
    adapter whose prefill costs 20% more it misses (1.32 s)."""
    spec = model("m")
    cost = LoraCost([8], [1], [[0.0]], [0.2])
    profiles = {"i": with_lora(flat_profile("m", Hardware.GPU, prefill_s=1.0, decode_s=0.01), cost)}
    inst = InstanceView("i", spec, "n")
    config = CoreConfig()
    assert shadow_validate([inst], profiles, "i", request("p", ttft=1.2), 0.0, 0.0,
                           config) is AdmitReason.ADMITTED
    assert shadow_validate([inst], profiles, "i", lora_request("a", ttft=1.2), 0.0, 0.0,
                           config) is AdmitReason.TTFT_MISS


def test_the_slo_check_judges_an_adapter_request_alone_at_its_measured_cost():
    spec = model("m")
    cost = LoraCost([8], [1], [[1.0]], [0.0])  # twice the decode time through an adapter
    perf = perf_for(with_lora(flat_profile("m", Hardware.GPU, decode_s=0.15), cost))
    sched = node(perf=perf)
    view = sched.view()
    assert evaluate(view, None, request("p", ttft=5.0), spec, perf, 0.0, CoreConfig()).ok
    refused = evaluate(view, None, lora_request("a", ttft=5.0), spec, perf, 0.0, CoreConfig())
    assert refused.reason is AdmitReason.SLO_INFEASIBLE


def test_the_lora_cost_travels_with_the_profile_and_old_profiles_still_read():
    profile = with_lora(linear_profile("m", Hardware.CPU))
    assert profile_from_json(profile_to_json(profile)) == profile
    old = json.loads(profile_to_json(linear_profile("m", Hardware.CPU)))
    old.pop("lora")
    assert profile_from_json(json.dumps(old)).lora is None


def test_the_wire_request_carries_the_adapter_rank_into_the_core():
    req = InferenceRequest("r", "t", "base", [1, 2, 3], 8, 0.0, 1.0, 0.25, adapter="t~a",
                           adapter_rank=16)
    assert request_view(req).lora_rank == 16
    plain = InferenceRequest("r", "t", "base", [1, 2, 3], 8, 0.0, 1.0, 0.25)
    assert request_view(plain).lora_rank == 0
    assert RequestView("r", "m", 3, 0.0, SLO(1.0, 0.25)).lora_rank == 0


def test_shadow_validation_simulates_an_adapter_batch_at_its_measured_cost():
    """An adapter request due at 0.08 s decodes first: plain, its step ends at 0.055 s (with the
    10% margin) and the newcomer's prefill then meets its 0.1 s TTFT; at twice the cost through
    its adapter the step ends at 0.11 s, and the node's future fails."""
    spec = model("m")
    cost = LoraCost([8], [1], [[1.0]], [0.0])
    profiles = {"i": with_lora(flat_profile("m", Hardware.GPU, prefill_s=0.001, decode_s=0.05), cost)}
    config = CoreConfig()
    newcomer = request("new", ttft=0.1)
    for rank, verdict in ((0, AdmitReason.ADMITTED), (8, AdmitReason.HEADROOM)):
        old = lora_request("old", rank=rank, arrival=-0.22, ttft=0.05, generated=1)
        inst = InstanceView("i", spec, "n", requests=[old])
        assert shadow_validate([inst], profiles, "i", newcomer, 0.0, 0.0, config) is verdict
