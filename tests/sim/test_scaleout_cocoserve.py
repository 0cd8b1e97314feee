"""CoCoServe in the simulator (sim/cocoserve.py), decided by the core's planner: layer replicas on
idle fragments change the instance's cost through its layout (the node's core decides with
it); replicas go when their host runs late or is under memory pressure, and with their
instance."""

from __future__ import annotations

import pytest

from shared.core.cost import layout_hop, layout_replication, replicated_profile
from shared.core.evaluate import node_profiles
from shared.core.types import Hardware, RequestView, slo_for_input
from sim.engine import EventLoop, SimRequest
from sim.metrics import Metrics
from sim.build import build_cluster, build_system
from sim.config import SimConfig


def cluster(coco: bool = True, gpus: int = 2):
    extra = {"cocoserve": {"link_gbps": 400.0}} if coco else {}
    cfg = SimConfig(system="slinfer", models=2, model_size="7b", cpu_nodes=0, gpu_nodes=gpus,
                    keep_alive=1000.0, noise=0.0, extra=extra)
    c = build_cluster(cfg)
    sys_ = build_system(cfg, c)
    loop, metrics = EventLoop(), Metrics()
    sys_.bind(loop, metrics)
    return sys_, loop, metrics, sorted(c.specs)


def advance(sys_, loop, until: float) -> None:
    while loop.peek_time() is not None and loop.peek_time() <= until:
        sys_.handle(loop.pop())
    loop.now = max(loop.now, until)


def arrive(sys_, rid: str, model: str, t: float, inp: int = 512, out: int = 32,
           node: str | None = None) -> SimRequest:
    req = SimRequest(rid, model, inp, out, t, slo_for_input(inp))
    sys_.reqs[rid] = req
    if node is None:
        sys_.on_arrival(req)
    else:  # a new instance of the model on this node
        view = RequestView(rid, model, inp, t, req.slo,
                           max_tokens=sys_.models[model].max_context - inp)
        assert sys_._admit(node, None, view)
    return req


def spiked():
    """Model a on gpu0 under a spike of long prompts (4 s TTFT: time to wait for replicas);
    gpu1 holds an idle instance of model b (a fragment: memory and compute to spare)."""
    sys_, loop, metrics, (a, b) = cluster()
    arrive(sys_, "h", b, 0.0, node="gpu1")
    arrive(sys_, "w", a, 0.0, node="gpu0")
    advance(sys_, loop, 10.0)
    for i in range(40):
        arrive(sys_, f"x{i}", a, 10.0 + 0.001 * i, inp=2048, out=100)
    return sys_, loop, metrics, a, b


def the_replica(sys_):
    """(instance id, its layout) of the one replicated instance."""
    ((iid, layout),) = sys_.cocoserve.layouts.items()
    return iid, layout


def test_a_spike_replicates_layers_onto_an_idle_fragment_and_the_node_decides_with_them():
    sys_, loop, metrics, a, _ = spiked()
    assert metrics.counters["cocoserve_scale_ups"] == 1
    ((key, transfer),) = sys_.cocoserve.transfers.items()
    plan = transfer.plan
    assert (plan.owner_node, plan.host_node) == ("gpu0", "gpu1") and plan.end > plan.start
    gpu0, gpu1 = sys_.nodes["gpu0"].sched, sys_.nodes["gpu1"].sched
    assert gpu1.ledger.target(key) == plan.host_bytes  # the host's budget holds it
    assert "gpu1" in sys_.cocoserve.hosts()
    iid = plan.instance_id
    base = sys_.perf.get(a, Hardware.GPU)
    assert gpu0.node.instance(iid).layout is None  # not faster before the transfer ends
    advance(sys_, loop, 13.0)
    got, layout = the_replica(sys_)
    assert got == iid and not sys_.cocoserve.transfers
    (run,) = layout.runs
    assert (run.start, run.end, run.node_id, run.replica) == (plan.start, plan.end, "gpu1", True)
    inst = gpu0.node.instance(iid)
    assert inst.layout == layout and inst.model.weight_bytes == sys_.models[a].weight_bytes
    # The node's core decides with the layout's cost: a batch split between the replicas.
    mine = node_profiles(gpu0.node, sys_.perf)[iid]
    assert mine.decode_s(16, 1024) == pytest.approx(
        replicated_profile(base, layout_replication(layout), layout_hop(layout)).decode_s(16, 1024))
    advance(sys_, loop, 600.0)
    served = [q for q in sys_.reqs.values() if q.rid.startswith("x") and q.finished_at]
    assert served and all(q.hardware is Hardware.GPU for q in served)


def test_a_host_whose_own_request_runs_late_loses_its_replicas():
    sys_, loop, metrics, a, _ = spiked()
    advance(sys_, loop, 13.0)
    iid, layout = the_replica(sys_)
    (run,) = layout.runs
    own = [(i.instance_id, len(i.requests)) for i in sys_.nodes["gpu1"].sched.node.instances]
    sys_.cocoserve.host_violated("gpu1")  # what an iteration with a late token of the host's calls
    assert metrics.counters["cocoserve_host_violations"] == 1
    assert metrics.counters["cocoserve_replicas_evicted"] == run.end - run.start
    assert not sys_.cocoserve.layouts and "gpu1" not in sys_.cocoserve.hosts()
    advance(sys_, loop, 14.0)
    assert sys_.nodes["gpu1"].sched.ledger.target(run.address) == 0  # its memory given back
    assert sys_.nodes["gpu0"].sched.node.instance(iid).layout is None
    # the host's own instances were not touched
    assert [(i.instance_id, len(i.requests)) for i in sys_.nodes["gpu1"].sched.node.instances] == own


def test_memory_pressure_drops_the_replicas_the_pressured_node_hosts():
    sys_, loop, metrics, a, b = spiked()
    advance(sys_, loop, 13.0)
    iid, layout = the_replica(sys_)
    (run,) = layout.runs
    host = sys_.nodes["gpu1"].sched.node
    free = host.memory_bytes - host.budget_bytes
    # A request for b whose new instance lacks memory on every node: gpu1 lacks the least.
    view = RequestView("p", b, 512, 13.0, slo_for_input(512), max_tokens=256)
    assert sys_.cocoserve.memory_pressure(view)
    assert metrics.counters["cocoserve_replicas_evicted"] == run.end - run.start
    advance(sys_, loop, 14.0)
    assert host.memory_bytes - host.budget_bytes > free
    assert sys_.nodes["gpu0"].sched.node.instance(iid).layout is None


def test_an_unloaded_instance_gives_its_replicas_back():
    sys_, loop, metrics, a, _ = spiked()
    advance(sys_, loop, 13.0)
    iid, layout = the_replica(sys_)
    sys_.cocoserve.instance_gone(iid)
    assert not sys_.cocoserve.layouts
    advance(sys_, loop, 14.0)
    assert sys_.nodes["gpu1"].sched.ledger.target(layout.runs[0].address) == 0


def test_without_a_fragment_nothing_is_replicated():
    """One GPU: no other node to hold replicas; CoCoServe changes nothing."""
    runs = []
    for coco in (False, True):
        sys_, loop, metrics, (a, _) = cluster(coco, gpus=1)
        for i in range(20):
            arrive(sys_, f"x{i}", a, 0.001 * i, inp=1024, out=50)
        advance(sys_, loop, 300.0)
        runs.append(([(q.first_token_at, q.finished_at) for q in sys_.reqs.values()],
                      {k: v for k, v in metrics.counters.items()}))
    assert runs[0] == runs[1]


def test_empty_nodes_host_replicas_only_when_allowed():
    """By default replicas go to idle fragments only; with empty_hosts an empty node takes them."""
    for empty, expect in ((False, 0), (True, 1)):
        cfg = SimConfig(system="slinfer", models=1, model_size="7b", cpu_nodes=0, gpu_nodes=2,
                        keep_alive=1000.0, noise=0.0,
                        extra={"cocoserve": {"link_gbps": 400.0, "empty_hosts": empty}})
        sys_ = build_system(cfg, build_cluster(cfg))
        loop, metrics = EventLoop(), Metrics()
        sys_.bind(loop, metrics)
        (a,) = sorted(sys_.models)
        arrive(sys_, "w", a, 0.0, node="gpu0")
        advance(sys_, loop, 10.0)
        for i in range(40):
            arrive(sys_, f"x{i}", a, 10.0 + 0.001 * i, inp=2048, out=100)
        assert metrics.counters["cocoserve_scale_ups"] == expect
        assert ("gpu1" in sys_.cocoserve.hosts()) is bool(expect)


def test_shed_layers_load_their_host_and_come_back_once_their_node_has_room():
    """A shed (memory pressure on gpu0): the moved layers' stage on gpu1 is in gpu1's view as a
    share of its compute, which its own admissions count; once the shed has settled and gpu0
    has room, the periodic take-back brings them home while the instance's request streams."""
    from shared.core.module_scaling import MemoryPressure, ModuleAction

    sys_, loop, metrics, (a, b) = cluster()
    arrive(sys_, "h", b, 0.0, node="gpu1")
    w = arrive(sys_, "w", a, 0.0, node="gpu0", out=3000)
    advance(sys_, loop, 5.0)
    coco = sys_.cocoserve
    gpu0, gpu1 = sys_.nodes["gpu0"].sched, sys_.nodes["gpu1"].sched
    (inst,) = gpu0.node.instances
    before = gpu0.ledger.target(inst.instance_id)
    [plan] = coco._plan(pressures=[MemoryPressure("gpu0", 1 << 30)])  # what memory_pressure does
    assert (plan.action, plan.owner_node, plan.host_node) == (ModuleAction.SHED, "gpu0", "gpu1")
    coco._carry(plan)
    advance(sys_, loop, 8.0)
    ((iid, layout),) = coco.layouts.items()
    assert iid == inst.instance_id and not layout.runs[0].replica
    assert gpu0.ledger.target(iid) < before
    assert gpu1.node.stage_load == pytest.approx(plan.load) and plan.load > 0
    tokens = w.generated
    # Settled (settle_s) and gpu0 has room: taken back, the host's hold and load released.
    advance(sys_, loop, 8.0 + coco.settings.settle_s + 5.0)
    assert metrics.counters["cocoserve_takes"] == 1
    assert not coco.layouts and gpu0.node.instance(iid).layout is None
    assert gpu0.ledger.target(iid) >= before - 8  # (the K/V pool's rounding)
    assert gpu1.ledger.target(layout.runs[0].address) == 0 and gpu1.node.stage_load == 0
    assert w.generated > tokens and not w.done
