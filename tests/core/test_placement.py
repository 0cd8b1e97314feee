"""place(): CPU first (with AMX and a feasible profile), bin-packing, preemption, cold start,
queue and drop."""

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

CFG = CoreConfig()


def _perf(*names, cpu_prefill=0.2, gpu_prefill=0.05):
    profiles = []
    for n in names:
        profiles += [flat_profile(n, Hardware.CPU, prefill_s=cpu_prefill, decode_s=0.05),
                     flat_profile(n, Hardware.GPU, prefill_s=gpu_prefill, decode_s=0.01)]
    return perf_for(*profiles)


def test_existing_cpu_instance_preferred_over_gpu():
    perf, spec = _perf("m"), model("m")
    cpu, gpu = node("cpu0", Hardware.CPU, 256, perf), node("gpu0", Hardware.GPU, 80, perf)
    loaded(cpu, None, request("a", ttft=2), spec)
    loaded(gpu, None, request("b", ttft=2), spec)
    plan = place(request("c", ttft=2, arrival=0), spec,
                 DecisionContext([gpu.view(), cpu.view()], perf, 0.0, CFG))
    assert plan.action is PlaceAction.ROUTE and plan.node_id == "cpu0"


def test_cpu_without_matrix_accel_or_slo_is_skipped():
    perf, spec = _perf("m", cpu_prefill=3.0), model("m")
    slow_cpu = node("cpu0", Hardware.CPU, 256, perf)
    no_amx = node("cpu1", Hardware.CPU, 256, _perf("m"), matrix_accel=False)
    gpu = node("gpu0", Hardware.GPU, 80, perf)
    plan = place(request("c", ttft=1.0), spec,
                 DecisionContext([slow_cpu.view(), no_amx.view(), gpu.view()], perf, 0.0, CFG))
    reasons = {a.node_id: a.reason for a in plan.attempts}
    assert reasons["cpu0"] is AdmitReason.SLO_INFEASIBLE
    assert reasons["cpu1"] is AdmitReason.NO_MATRIX_ACCEL
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.node_id == "gpu0"


def test_binpacking_prefers_largest_batch():
    perf, spec = _perf("m"), model("m")
    g0, g1 = node("g0", Hardware.GPU, 80, perf), node("g1", Hardware.GPU, 80, perf)
    loaded(g0, None, request("a", ttft=5), spec)
    i1 = loaded(g1, None, request("b", ttft=5), spec)
    loaded(g1, i1, request("c", ttft=5), spec)
    plan = place(request("d", ttft=5), spec,
                 DecisionContext([g0.view(), g1.view()], perf, 0.0, CFG))
    assert plan.action is PlaceAction.ROUTE and plan.instance_id == i1


def test_preemption_of_smaller_neighbour_when_memory_blocks_growth():
    # One 80 GB GPU: "big" (30 GB weights + 12.5 GB KV, 2 requests) and an idle 35 GB neighbour.
    # A third request needs 18.5 GB of KV for big; 2.5 GB are free, so neither M_recommend nor
    # the M_require compromise fits - unless the smaller (batch 0) neighbour is preempted.
    perf = _perf("big", "small")
    big = model("big", weight_gb=30, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
    small = model("small", weight_gb=35, max_context=1024)
    gpu = node("g0", Hardware.GPU, 80, perf)
    ib = loaded(gpu, None, request("a", "big", input_len=400, ttft=5), big)
    loaded(gpu, ib, request("b", "big", input_len=400, ttft=5), big)
    loaded(gpu, None, request("s", "small", ttft=5, max_tokens=1), small)
    view = gpu.view()
    view.instances[1].requests.clear()  # the neighbour finished its request: batch 0
    plan = place(request("c", "big", input_len=900, ttft=5, max_tokens=100), big,
                 DecisionContext([view], perf, 0.0, CFG, {"small": small}))
    assert any(a.reason is AdmitReason.MEMORY for a in plan.attempts)
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE
    assert plan.instance_id == ib and len(plan.preempt) == 1
    no_consolidation = place(request("c", "big", input_len=900, ttft=5, max_tokens=100), big,
                             DecisionContext([view], perf, 0.0,
                                             CoreConfig(enable_consolidation=False),
                                             {"small": small}))
    assert no_consolidation.action is not PlaceAction.PREEMPT_AND_ROUTE


def test_new_instance_on_cpu_first_then_queue_then_drop():
    perf, spec = _perf("m"), model("m", weight_gb=100)  # fits nowhere: 100 GB > 80 and > 64
    cpu, gpu = node("c", Hardware.CPU, 64, perf), node("g", Hardware.GPU, 80, perf)
    fresh = request("r", ttft=2.0, arrival=0.0)
    views = [cpu.view(), gpu.view()]
    assert place(fresh, spec, DecisionContext(views, perf, 0.1, CFG)).action is PlaceAction.QUEUE
    assert place(fresh, spec, DecisionContext(views, perf, 10.0, CFG)).action is PlaceAction.DROP
    small = model("m", weight_gb=1)
    plan = place(fresh, small, DecisionContext([gpu.view(), cpu.view()], perf, 0.0, CFG))
    assert plan.action is PlaceAction.NEW_INSTANCE and plan.node_id == "c"


def test_no_sharing_means_one_instance_per_node():
    perf = _perf("a", "b")
    gpu = node("g", Hardware.GPU, 80, perf)
    loaded(gpu, None, request("x", "a"), model("a"))
    plan = place(request("y", "b"), model("b"),
                 DecisionContext([gpu.view()], perf, 0.0,
                                 CoreConfig(enable_sharing=False, enable_consolidation=False)))
    assert plan.action is PlaceAction.QUEUE
    assert any(a.reason is AdmitReason.NOT_SHARED for a in plan.attempts)


def test_place_only_reads_the_views_it_is_given():
    """The simulator hands place() the node schedulers' own views (no copies): a placement that
    routes, preempts or cold-starts must leave them exactly as they were."""
    from shared.core.node_scheduler import copy_instances

    perf = _perf("big", "small")
    big = model("big", weight_gb=30, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
    small = model("small", weight_gb=35, max_context=1024)
    gpu, other = node("g0", Hardware.GPU, 80, perf), node("g1", Hardware.GPU, 80, perf)
    iid = loaded(gpu, None, request("a", "big", input_len=500, ttft=5), big)
    loaded(gpu, iid, request("b", "big", input_len=500, ttft=5), big)
    loaded(gpu, None, request("s", "small", ttft=5), small)
    loaded(other, None, request("t", "small", ttft=5), small)
    gpu.step(0.0)
    views = [gpu.node, other.node]
    before = [(v.busy_until, v.running, v.budget_bytes, copy_instances(v.instances)) for v in views]
    for r in (request("c", "big", input_len=500, ttft=5), request("d", "small", ttft=5),
              request("e", "other", ttft=5)):
        place(r, big if r.model == "big" else small,
              DecisionContext(views, perf, 0.0, CFG, {"big": big, "small": small}))
    after = [(v.busy_until, v.running, v.budget_bytes, copy_instances(v.instances)) for v in views]
    assert after == before
