"""A decision seen in a simulation is the decision the services take: one recorded cluster state
(the nodes as the placer reads them over the wire, the models, a request) fed to the
simulator's decision path and to the services' gives the same plan, with each side's own
default configuration (the simulator's defaults follow the services')."""

from __future__ import annotations

from dataclasses import replace

from shared import wire
from shared.core.node_scheduler import NodeScheduler
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware, NodeView
from shared.settings import core_config_from_env
from services.placer.settings import burst_from_env
from sim.simulate import SimConfig
from sim.slinfer_system import SlinferSystem

from tests.core.factories import flat_profile, linear_profile, loaded, model, node, perf_for, request

BIG = model("big", weight_gb=30, kv_per_token=10 * 1024**2, max_context=1024, avg_out=64)
SMALL = model("small", weight_gb=35, max_context=1024)
MODELS = {"big": BIG, "small": SMALL}
PERF = perf_for(flat_profile("big", Hardware.GPU, prefill_s=0.05, decode_s=0.01),
                linear_profile("small", Hardware.GPU, 1e-4, 0.01, 0.001))


def cluster() -> list[NodeScheduler]:
    """g0 serves big (two requests whose KV cannot grow for a third) beside small (one request,
    the smaller neighbour, 35 GB); g1 has an instance of small with room: a newcomer of big is
    placed by preempting small on g0 and moving its request to g1."""
    g0, g1 = node("g0", Hardware.GPU, 80, PERF), node("g1", Hardware.GPU, 80, PERF)
    ib = loaded(g0, None, request("a", "big", input_len=400, ttft=5), BIG)
    loaded(g0, ib, request("b", "big", input_len=400, ttft=5), BIG)
    loaded(g0, None, replace(request("s", "small", input_len=400, ttft=5, generated=10),
                             prefilled=False), SMALL)
    loaded(g1, None, replace(request("t", "small", input_len=100, ttft=5, generated=3),
                             prefilled=False), SMALL)
    return [g0, g1]


def recorded_state() -> list[NodeView]:
    """The cluster as the placer reads it: the nodes' views through the wire."""
    return [wire.decode(NodeView, wire.encode(s.view())) for s in cluster()]


NEWCOMER = request("c", "big", input_len=900, ttft=5.0, max_tokens=100)


def services_plan(nodes: list[NodeView]):
    """The placer's decision (`Placer._place_one`): `place` with the core configuration the
    placer and the nodes build from an environment that sets nothing."""
    core = burst_from_env(core_config_from_env(env={}), env={})
    return place(NEWCOMER, BIG, nodes, PERF, 0.0, core, models=MODELS)


def simulator_plan(nodes: list[NodeView]):
    system = SlinferSystem(nodes, PERF, MODELS, SimConfig().core_config())
    return system.decide(NEWCOMER, 0.0)


def test_the_simulator_and_the_services_plan_the_same_for_one_recorded_state():
    ours, theirs = simulator_plan(recorded_state()), services_plan(recorded_state())
    assert theirs.action is PlaceAction.PREEMPT_AND_ROUTE and theirs.live  # the services' default
    assert ours == theirs


def test_the_simulators_core_configuration_is_the_services_default():
    services = burst_from_env(core_config_from_env(env={}), env={})
    assert SimConfig().core_config() == services
    assert services.live_preemption and services.enable_pipeline


def test_the_simulator_carries_a_live_preemption_out_as_the_node_workers_do():
    """The victim decodes on until the plan's handover, its request then runs on at the
    destination the plan validated (its tokens so far kept), the victim is unloaded, and the
    newcomer is served."""
    from sim.engine import SimRequest, run
    from sim.metrics import Metrics

    scheds = cluster()
    now = _until_prefilled(scheds[0], "s")  # g0 ran a and b, then s: s decodes from here
    system = SlinferSystem([s.node for s in scheds], PERF, MODELS, SimConfig().core_config())
    for sched in scheds:  # the schedulers that built the state, with their memory ledgers
        system.nodes[sched.node.node_id].sched = sched
    newcomer_view = replace(NEWCOMER, arrival=now)
    plan = system.decide(newcomer_view, now)
    assert plan.action is PlaceAction.PREEMPT_AND_ROUTE and plan.live and plan.handover_s > 0
    for sched in scheds:
        for inst in sched.node.instances:
            for r in inst.requests:
                system.reqs[r.request_id] = SimRequest(r.request_id, r.model, r.input_len, 200,
                                                       r.arrival, r.slo, generated=r.generated)
    s_before = system.reqs["s"].generated
    victim = plan.preempt[0]
    newcomer = SimRequest("c", "big", NEWCOMER.input_len, 20, now, NEWCOMER.slo)
    metrics = Metrics()
    run(system, [newcomer], metrics, horizon=120.0)
    assert newcomer.finished_at is not None and not newcomer.dropped
    assert metrics.counters["preemptions"] == 1 and metrics.counters["migrations"] == 1
    assert "evictions" not in metrics.counters  # nothing moved stop-and-resume
    assert scheds[0].node.instance(victim) is None  # unloaded after the handover
    assert newcomer.first_token_at > now + plan.handover_s  # it waited for the handover
    moved = system.reqs["s"]
    assert moved.generated > s_before and moved.evictions == 0  # its tokens went on, kept
    on_g1 = [r.request_id for i in scheds[1].node.instances for r in i.requests]
    assert "s" in on_g1 or moved.finished_at is not None


def _until_prefilled(sched: NodeScheduler, rid: str) -> float:
    """Run the node's iterations (as predicted) until request `rid` is prefilled; the time then."""
    now = 0.0
    while not any(r.request_id == rid and r.prefilled
                  for i in sched.node.instances for r in i.requests):
        step = sched.step(now)
        assert step.iteration is not None
        now += step.predicted_s
        sched.finish_iteration(step.iteration, now)
    return now
