"""A decision seen in a simulation is the decision the services take: one recorded cluster state
(the nodes as the placer reads them over the wire, the models, a request) fed to the
simulator's decision path and to the services' gives the same plan, with each side's own
default configuration (the simulator's defaults follow the services')."""

from __future__ import annotations

from dataclasses import replace

from shared import wire
from shared.core.context import DecisionContext
from shared.core.node_scheduler import NodeScheduler
from shared.core.placement import PlaceAction, place
from shared.core.types import Hardware, InstanceStatus, NodeView
from shared.settings import core_config_from_env
from services.placer.settings import burst_from_env
from sim.config import SimConfig
from sim.slinfer_system import SlinferSystem

from tests.core.factories import (flat_profile, linear_profile, loaded, model, node, perf_for,
                                  request)

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
    return place(NEWCOMER, BIG, DecisionContext(nodes, PERF, 0.0, core, MODELS))


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


# -- module scaling (CoCoServe): the placer's planner gets what the simulator's gets -----------

def _module_state():
    """a: a lone, busy instance of m (4 requests); b: an idle fragment (an instance of another
    model, no request)."""
    from tests.core.test_module_scaling import proportional, spec

    perf = perf_for(proportional(per_request_s=0.02), proportional("other"))
    owner = node("a", Hardware.CPU, 40, perf)
    iid = None
    for k in range(4):
        iid = loaded(owner, iid, request(f"r{k}", ttft=5.0), spec())
    fragment = node("b", Hardware.CPU, 40, perf)
    loaded(fragment, None, request("idle", model_name="other", ttft=5.0), spec(name="other"))
    fragment.cancel("idle", 1.0)
    nodes = [wire.decode(NodeView, wire.encode(s.view())) for s in (owner, fragment)]
    return nodes, perf, {"m": spec(), "other": spec(name="other")}


def _simulator(nodes, perf, models):
    from sim.engine import EventLoop
    from sim.metrics import Metrics

    system = SlinferSystem(nodes, perf, dict(models), SimConfig().core_config(),
                           cocoserve=(10.0, {m: s.layers for m, s in models.items()},
                                      {m: 4096 for m in models}))
    system.bind(EventLoop(), Metrics())
    return system


def test_the_placers_module_planner_is_given_the_demand_the_simulators_is():
    from services.placer.module_scaler import ModuleScaler
    from shared.core.module_scaling import ModuleAction

    nodes, perf, models = _module_state()
    new = request("new", ttft=5.0, tpot=0.06)  # a's instance cannot take its TPOT
    system = _simulator(nodes, perf, models)
    ours = system.cocoserve.scale_up_plans(new)
    assert [p.action for p in ours] == [ModuleAction.REPLICATE]
    core = SimConfig().core_config()
    plan = place(new, models["m"], DecisionContext(nodes, perf, 0.0, core, models))
    assert plan.action is PlaceAction.NEW_INSTANCE  # the simulator offers it to its planner
    scaler = ModuleScaler(None, system.cocoserve.settings, interval_s=1.0)
    scaler.note(plan, new, models["m"], nodes)  # what `Placer._place_one` tells it
    assert scaler.decide(nodes, perf, 0.0, core) == ours
    assert scaler.decide(nodes, perf, 0.0, core) == []  # demand is passed once


def test_a_host_whose_own_requests_ran_late_loses_its_replicas_in_both_planners():
    """b hosts a replica of a's instance; one of b's own requests gets a token after its
    deadline: the node's view counts it (`late_tokens`), and the placer's planner, like the
    simulator's (which sees the late token itself), drops the replica b hosts."""
    from services.placer.module_scaler import ModuleScaler
    from shared.core.module_scaling import ModuleAction
    from shared.core.types import InstanceLayout, LayerRun
    from tests.core.test_module_scaling import drain, proportional, spec

    perf = perf_for(proportional(), proportional("other"))
    owner, host = node("a", Hardware.CPU, 40, perf), node("b", Hardware.CPU, 40, perf)
    iid = loaded(owner, None, request("r0", ttft=5.0), spec())
    layout = InstanceLayout(owner.node.instance(iid).model,
                            (LayerRun(0, 4, "b", "b:7", replica=True),), 1e-4, 1e10)
    drain(owner, owner.set_layout(iid, layout, 0.0)[1])
    loaded(host, None, request("own", model_name="other", ttft=0.5), spec(name="other"))
    models = {"m": spec(), "other": spec(name="other")}

    def views():
        return [wire.decode(NodeView, wire.encode(s.view())) for s in (owner, host)]

    system = _simulator(views(), perf, models)
    scaler = ModuleScaler(None, system.cocoserve.settings, interval_s=1.0)
    core = SimConfig().core_config()
    assert scaler.decide(views(), perf, 0.0, core) == []  # nothing late yet
    step = host.step(0.0)
    host.finish_iteration(step.iteration, 2.0)  # its first token was due at 0.5 s
    after = views()
    assert after[1].late_tokens == 1
    system = _simulator(after, perf, models)
    system.cocoserve.layouts[iid] = layout  # (the simulator's record of the replica it made)
    ours = system.cocoserve.overload_plans("b")
    assert [p.action for p in ours] == [ModuleAction.DROP_REPLICA]
    assert scaler.decide(after, perf, 2.0, core) == ours


# -- LoRA pre-loading (ServerlessLoRA §4.1): the placer's plan is the simulator's --------------

def _lora_cluster():
    """A LoRA run's cluster just before its third pre-loading turn: one CPU and two GPU nodes with
    tiered storage (cold: the backbones' first loads read the registry, about 11 s), two 7B
    backbones and six functions. Functions 0 and 1 run (outputs long enough that their
    backbones' instances still run when the plan is made); 2 to 5 were called before, on
    instances gone since, so their adapters are attached nowhere. Every call at t = 0, a
    different number of times per function, so no two artifacts tie. Returns the system, the
    layout, the calls (a function each) and the time."""
    from sim import lora
    from sim.engine import SimRequest, run
    from shared.core.types import slo_for_input

    cfg = SimConfig(lora_adapters=6, lora_backbones=2, cpu_nodes=1, gpu_nodes=2,
                    storage="tiered", duration=60.0, noise=0.0)
    lay = lora.layout(cfg)
    system, memory = lora.build_system(cfg, lay)
    calls = [f for i, f in enumerate(lay.functions) for _ in range(i + 1)]
    requests = [SimRequest(f"r{k}", f, 256, 2000, 0.0, slo_for_input(256))
                for k, f in enumerate(calls) if f in lay.functions[:2]]
    for f in calls:
        if f not in lay.functions[:2]:
            system.preloading.note(lay.backbone_of[f], f, 0.0)
    now = 3 * system.preloading.interval_s - 0.1
    run(system, requests, lora.MemoryMetrics(memory), horizon=now)
    return system, lay, calls, now


async def test_the_placer_sends_the_preloading_plan_the_simulator_makes(own_servers):
    """The same recorded calls and node views (through Redis and the wire) give the placer's
    Pre-Loading Scheduler (`ClusterPreloader`, with its default settings) the plan the
    simulator's placer turn makes, node by node, with the same validity."""
    import time

    import nats
    from redis.asyncio import Redis

    from services.placer.placer import Placer
    from services.placer.settings import PlacerSettings
    from shared.cluster import publish_node, save_profile
    from shared.core.config import CoreConfig
    from shared.registry import ModelRegistry
    from shared.schemas import InferenceRequest, ModelRecord

    system, lay, calls, now = _lora_cluster()
    views = system.placer_views()
    assert all(i.status is InstanceStatus.READY for v in views for i in v.instances)
    ours = system.preloading.placer_turn(views, now)
    attached = [a for p in ours.values() for a in p.adapters]
    assert attached and any(p.checkpoints for p in ours.values())  # a plan worth comparing

    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    try:
        registry = ModelRegistry(redis)
        for name, spec in lay.backbones.items():
            await registry.register(ModelRecord(name, f"/models/{name}",
                                                weight_bytes=spec.weight_bytes))
        for fn, adapter in lay.adapters.items():
            await registry.register(ModelRecord(fn, f"/models/{fn}", weight_bytes=adapter.bytes,
                                                base_model=lay.backbone_of[fn]))
        for profile in system.perf.profiles.values():
            await save_profile(redis, profile)
        for view in views:
            await publish_node(redis, replace(view, heartbeat=time.time()), ttl_s=60)
        placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig()), nc, redis)
        await placer.port.refresh_perf()
        at = time.time()  # every call at one instant, as in the run: rates scale alike
        for i, fn in enumerate(calls):
            request = InferenceRequest(f"q{i}", "t", lay.backbone_of[fn], [5] * 16, 8, at, 5.0,
                                       0.5, adapter=fn)
            placer.preloader.note(request, at)
        await placer.preloader.turn()
        theirs = placer.preloader.sent
    finally:
        await nc.close()
        await redis.aclose()
    assert set(theirs) == set(ours)
    for node_id, plan in ours.items():
        assert theirs[node_id].checkpoints == list(plan.checkpoints)
        assert theirs[node_id].adapters == [list(pair) for pair in plan.adapters]
        assert theirs[node_id].valid_s == system.preloading.valid_s


def test_the_simulators_preloading_defaults_are_the_services(monkeypatch):
    """Interval and validity: what the placer reads from an environment that sets nothing, and
    the nodes' default."""
    from services.node.settings import NodeSettings
    from services.placer.settings import PlacerSettings
    from shared.core.preload import plan_valid_s
    from sim import lora

    monkeypatch.delenv("SLINFER_CLUSTER_PRELOAD_S", raising=False)
    placer_s = PlacerSettings.from_env().preload_interval_s
    cfg = SimConfig(lora_adapters=2)
    assert cfg.lora_preload_s == placer_s
    assert cfg.lora_preload_s == NodeSettings.__dataclass_fields__["preload_interval_s"].default
    system, _ = lora.build_system(cfg, lora.layout(cfg))
    assert system.preloading.interval_s == placer_s
    assert system.preloading.valid_s == plan_valid_s(placer_s)


# -- burst scale-out (λScale): the placer's burst is the simulator's ------------------------------

def _burst_state():
    """g0 serves m with 3 requests (full for a fourth: 0.3 s prefills, 1 s TTFT); g1..g4 are
    empty and can receive m by multicast from g5, which holds it in DRAM with no room to serve."""
    from shared.core.types import StorageView
    from tests.core.factories import GB

    spec = model("m", weight_gb=10.0)
    perf = perf_for(replace(flat_profile("m", Hardware.GPU, prefill_s=0.3, load_s=30.0),
                            engine_init_s=0.2))
    scheds = [node(f"g{i}", Hardware.GPU, 80 if i < 5 else 1, perf) for i in range(6)]
    for s in scheds:
        s.node.storage = StorageView({"dram": 20 * GB, "registry": 0.5 * GB},
                                     multicast_bytes_per_s=12.5 * GB)
    scheds[5].node.storage.holds["m"] = "dram"
    iid = None
    for k in range(3):
        iid = loaded(scheds[0], iid, request(f"q{k}"), spec)
    nodes = [wire.decode(NodeView, wire.encode(s.view())) for s in scheds]
    return nodes, perf, {"m": spec}


def test_the_simulator_and_the_placer_plan_the_same_burst_for_one_recorded_state():
    """The burst is planned before the placed instance is committed on both sides, on the views
    `place` decided on: the same extra instances, the same group, the same price of the placed
    instance in it."""
    from services.placer.burst import BurstStarter
    from shared.cluster import request_view
    from shared.core.burst import BurstPlan
    from shared.schemas import InferenceRequest

    nodes, perf, models = _burst_state()
    env = {"SLINFER_BURST_SCALEOUT": "true"}
    core = burst_from_env(core_config_from_env(env={}), env=env)
    assert SimConfig(extra={"burst": {}}).core_config() == core
    wire_req = InferenceRequest("r", "t", "m", [5] * 100, 128, 0.5, 3.0, 0.25)
    view = request_view(wire_req)
    arrivals = [0.5 - 0.05 * k for k in range(10)]

    starter = BurstStarter(None, core, None, lambda model, rid: 0)
    system = SlinferSystem(nodes, perf, dict(models), core)
    for at in arrivals:
        starter.note(replace(wire_req, request_id=f"a{at}"), at)
        system.note_arrival("m", at)
    ctx = DecisionContext(nodes, perf, 0.5, core, models)
    plan = place(view, models["m"], ctx)
    assert plan == system.decide(view, 0.5) and plan.action is PlaceAction.NEW_INSTANCE
    theirs = starter.plan(wire_req, plan, _record(models["m"]), ctx)
    ours = system.decide_burst(plan, view, 0.5)
    assert isinstance(ours, BurstPlan) and len(ours.receivers) > 1  # a group, the placed first
    assert ours == theirs
    assert ours.receivers[0] == plan.node_id
    assert ours.placed.startup.arrive_s > plan.startup.arrive_s  # first of the group, not alone


def _record(spec):
    from shared.schemas import ModelRecord

    return ModelRecord(spec.name, f"/models/{spec.name}", weight_bytes=spec.weight_bytes,
                       kv_bytes_per_token=spec.kv_bytes_per_token, max_context=spec.max_context)
