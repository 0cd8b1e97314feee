"""warm_route(): the instance a gateway's direct admission goes to is the one `place` routes to
when every candidate admits (CPU first, then the largest batch), on a node that takes work, with
the request's adapter attached; otherwise the placers decide."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.fast_path import WarmRoute, warm_route
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware, InstanceStatus

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request


def _perf(*names: str):
    profiles = []
    for n in names:
        profiles += [flat_profile(n, Hardware.CPU, prefill_s=0.05, decode_s=0.01),
                     flat_profile(n, Hardware.GPU, prefill_s=0.02, decode_s=0.005)]
    return perf_for(*profiles)


def test_cpu_instance_first_then_the_largest_batch():
    perf, spec = _perf("m"), model("m")
    cpu, g0, g1 = (node("cpu0", Hardware.CPU, 256, perf), node("g0", Hardware.GPU, 80, perf),
                   node("g1", Hardware.GPU, 80, perf))
    loaded(g0, None, request("a", ttft=5), spec)
    i1 = loaded(g1, None, request("b", ttft=5), spec)
    loaded(g1, i1, request("c", ttft=5), spec)
    assert warm_route([g0.view(), g1.view()], "m") == WarmRoute("g1", i1)
    ic = loaded(cpu, None, request("d", ttft=5), spec)
    assert warm_route([g0.view(), g1.view(), cpu.view()], "m") == WarmRoute("cpu0", ic)


def test_no_instance_of_the_model_is_left_to_the_placers():
    perf, spec = _perf("m", "other"), model("m")
    g0 = node("g0", Hardware.GPU, 80, perf)
    loaded(g0, None, request("a", model_name="other", ttft=5), model("other"))
    assert warm_route([g0.view()], "m") is None
    assert warm_route([], "m") is None
    loaded(g0, None, request("b", ttft=5), spec)
    assert warm_route([g0.view()], "m") is not None


def test_draining_nodes_and_instances_that_take_nothing_are_skipped():
    perf, spec = _perf("m"), model("m")
    g0 = node("g0", Hardware.GPU, 80, perf)
    iid = loaded(g0, None, request("a", ttft=5), spec)
    view = g0.view()
    assert warm_route([replace(view, draining=True)], "m") is None
    for status in (InstanceStatus.UNLOADING, InstanceStatus.HANDOVER):
        leaving = [replace(i, status=status) for i in view.instances]
        assert warm_route([replace(view, instances=leaving)], "m") is None
    assert warm_route([view], "m") == WarmRoute("g0", iid)


def test_an_adapter_goes_direct_only_where_it_is_attached():
    perf, spec = _perf("m"), model("m")
    g0 = node("g0", Hardware.GPU, 80, perf)
    iid = loaded(g0, None, request("a", ttft=5), spec)
    view = g0.view()
    assert warm_route([view], "m", adapter="lora-1") is None
    attached = [replace(i, adapters={"lora-1": 1 << 20}) for i in view.instances]
    assert warm_route([replace(view, instances=attached)], "m", adapter="lora-1") \
        == WarmRoute("g0", iid)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.tuples(st.sampled_from([Hardware.CPU, Hardware.GPU]),
                                  st.integers(min_value=1, max_value=3)),
                        min_size=1, max_size=4))
def test_it_is_the_route_place_takes_when_every_candidate_admits(batches):
    """Roomy nodes and loose SLOs, so every candidate admits: `place` routes to its first
    candidate, which must be the fast path's."""
    perf, spec = _perf("m"), model("m")
    nodes = []
    for k, (hardware, batch) in enumerate(batches):
        sched = node(f"n{k}", hardware, 512, perf)
        iid = None
        for r in range(batch):
            iid = loaded(sched, iid, request(f"r{k}-{r}", ttft=30, tpot=5), spec)
        nodes.append(sched.view())
    plan = place(request("new", ttft=30, tpot=5), spec,
                 DecisionContext(nodes, perf, 0.0, CoreConfig()))
    assert plan.action is PlaceAction.ROUTE
    assert warm_route(nodes, "m") == WarmRoute(plan.node_id, plan.instance_id)
