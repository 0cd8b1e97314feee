"""An embedding request as the core sees it: a prefill with no decode (max_tokens 0). It costs
its prompt's K/V and nothing for an output; its prefill finishes it, and its instance has
nothing left to decode."""

from shared.core.admission import AdmitReason
from shared.core.cost import kv_demand, request_tokens
from shared.core.iteration import IterationKind
from shared.core.types import Hardware

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request


def test_kv_demand_counts_the_prompt_only():
    spec = model("m", kv_per_token=1024, max_context=1024, avg_out=64)
    embed = request("e", input_len=300, max_tokens=0)
    generate = request("g", input_len=300, max_tokens=128)
    assert request_tokens(embed, spec.avg_output_len) == 300
    assert request_tokens(generate, spec.avg_output_len) == 364  # I + Ō
    # Past the instance's floor (its context), the embedding adds its prompt and no more.
    base = [request(f"r{i}", input_len=900, max_tokens=128) for i in range(2)]
    assert kv_demand(spec, [*base, embed]) - kv_demand(spec, base) == 300 * 1024


def test_an_input_up_to_the_context_is_admitted_without_room_for_output():
    spec = model("m", max_context=1024)
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)))
    long_prompt = dict(input_len=1000, ttft=60.0)
    assert sched.admit(request("e", max_tokens=0, **long_prompt), None, spec, 0.0).admission.ok
    refused = sched.admit(request("g", max_tokens=128, **long_prompt), None, spec, 0.0)
    assert refused.admission.reason is AdmitReason.CONTEXT_TOO_LONG


def test_its_prefill_ends_it_and_frees_the_instance():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.05)))
    iid = loaded(sched, None, request("e", input_len=200, max_tokens=0), spec)
    plan = sched.step(0.0)
    assert plan.iteration.kind is IterationKind.PREFILL and plan.iteration.request_ids == ("e",)
    # The node pools the prefill's hidden states and finishes the request in the same turn.
    sched.finish_iteration(plan.iteration, 0.05, finished={"e"})
    assert sched.view().instance(iid).requests == []
    assert sched.step(0.05).iteration is None  # no decode follows


def test_a_generation_beside_it_decodes_alone_after_its_prefill():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("g", input_len=100, ttft=1.0, max_tokens=16), spec)
    loaded(sched, iid, request("e", input_len=100, ttft=2.0, max_tokens=0), spec)
    ran = []
    now = 0.0
    for _ in range(3):
        plan = sched.step(now)
        ran.append((plan.iteration.kind, plan.iteration.request_ids))
        now += 0.1
        done = {"e"} if plan.iteration.request_ids == ("e",) else set()
        sched.finish_iteration(plan.iteration, now, finished=done)
    # Both prefills (in headroom order: the first one's cold start gave it a grace), then
    # decode steps of the generation alone.
    assert sorted(ran[:2]) == [(IterationKind.PREFILL, ("e",)), (IterationKind.PREFILL, ("g",))]
    assert ran[2] == (IterationKind.DECODE, ("g",))
