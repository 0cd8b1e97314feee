"""CoCoServe in the simulator (sim/cocoserve.py): layer replication onto idle fragments raises the
instance's modelled throughput through its node's profile; replicas are shed first, in
module_reduction's order, when their host is under pressure."""

from __future__ import annotations

import pytest

from shared.core.modules import eviction_order
from shared.core.types import Hardware, RequestView, slo_for_input
from sim.cocoserve import replica_key
from sim.engine import EventLoop, SimRequest
from sim.metrics import Metrics
from sim.simulate import SimConfig, build_cluster, build_system


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


def test_a_spike_replicates_layers_onto_an_idle_fragment_and_the_node_decides_with_the_speedup():
    sys_, loop, metrics, a, _ = spiked()
    assert metrics.counters["cocoserve_scale_ups"] == 1
    (r,) = sys_.cocoserve.replicated.values()
    assert r.node_id == "gpu0" and set(r.rep.on) == {"gpu1"}
    held = len(r.rep.on["gpu1"]) * r.layer_bytes
    gpu1 = sys_.nodes["gpu1"].sched
    assert gpu1.ledger.target(replica_key(r.instance_id, "gpu1")) == held  # the host's budget
    assert "gpu1" in sys_.cocoserve.hosts()
    base = sys_.perf.get(a, Hardware.GPU)
    assert sys_.nodes["gpu0"].sched.perf.get(a, Hardware.GPU).decode_s(16, 1024) == \
        base.decode_s(16, 1024)  # not faster before the transfer ends
    advance(sys_, loop, 13.0)
    mine = sys_.nodes["gpu0"].sched.perf.get(a, Hardware.GPU)
    assert r.loaded == {"gpu1"} and r.active() == pytest.approx(r.planned()) and r.planned() > 1.5
    # modelled throughput: the same batch decodes in 1/speedup of the time
    assert mine.decode_s(16, 1024) == pytest.approx(base.decode_s(16, 1024) / r.planned())
    assert mine.prefill_s(2048) == pytest.approx(base.prefill_s(2048) / r.planned())
    advance(sys_, loop, 600.0)
    served = [q for q in sys_.reqs.values() if q.rid.startswith("x") and q.finished_at]
    assert served and all(q.hardware is Hardware.GPU for q in served)


def test_the_replicated_instance_takes_more_of_the_spike_than_without_replicas():
    """The core admits against the replicated instance's cost: once the layers are across, the
    same instance holds more of the spike's requests than it can without them."""
    batches = []
    for coco in (True, False):
        sys_, loop, _, (a, b) = cluster(coco)
        arrive(sys_, "h", b, 0.0, node="gpu1")
        arrive(sys_, "w", a, 0.0, node="gpu0")
        advance(sys_, loop, 10.0)
        for i in range(40):
            arrive(sys_, f"x{i}", a, 10.0 + 0.001 * i, inp=2048, out=100)
        advance(sys_, loop, 12.0)
        batches.append(sys_.nodes["gpu0"].sched.node.instance(f"{a}@gpu0#1").batch_size)
    assert batches[0] > batches[1]


def test_a_host_whose_own_request_runs_late_sheds_its_replicas_first():
    sys_, loop, metrics, a, _ = spiked()
    advance(sys_, loop, 13.0)
    (r,) = sys_.cocoserve.replicated.values()
    key = replica_key(r.instance_id, "gpu1")
    own = [(i.instance_id, len(i.requests)) for i in sys_.nodes["gpu1"].sched.node.instances]
    sys_.cocoserve.host_violated("gpu1")  # what an iteration with a late token of the host's calls
    assert metrics.counters["cocoserve_replicas_evicted"] == 32  # no other fragment to migrate to
    assert not sys_.cocoserve.replicated and "gpu1" not in sys_.cocoserve.hosts()
    assert sys_.nodes["gpu1"].sched.ledger.target(key) == 0  # the host's memory is given back
    base = sys_.perf.get(a, Hardware.GPU)
    assert sys_.nodes["gpu0"].sched.perf.get(a, Hardware.GPU).decode_s(8, 512) == \
        pytest.approx(base.decode_s(8, 512))
    # the host's own instances were not touched
    assert [(i.instance_id, len(i.requests)) for i in sys_.nodes["gpu1"].sched.node.instances] == own


def test_memory_pressure_evicts_replicas_in_module_reduction_order_until_there_is_room():
    sys_, loop, metrics, a, _ = spiked()
    advance(sys_, loop, 13.0)
    (r,) = sys_.cocoserve.replicated.values()
    order = eviction_order(r.rep, r.hop_cost)
    node = sys_.nodes["gpu1"].sched.node
    free = node.memory_bytes - node.budget_bytes
    sys_.cocoserve._reduce(r, "gpu1", need_bytes=free + 3 * r.layer_bytes)
    gone = set(range(32)) - r.rep.on["gpu1"]
    assert gone == {layer for _, layer in order[:3]}  # the three cheapest to lose, and no more
    assert metrics.counters["cocoserve_replicas_evicted"] == 3
    assert node.memory_bytes - node.budget_bytes == free + 3 * r.layer_bytes
    assert 1.0 < r.planned() < speedup_all(r)


def speedup_all(r) -> float:
    from shared.core.modules import Replication, speedup
    return speedup(Replication(r.rep.layers, {"gpu1": set(range(r.rep.layers))}), r.hop_cost)


def test_an_unloaded_instance_gives_its_replicas_back():
    sys_, loop, metrics, a, _ = spiked()
    advance(sys_, loop, 13.0)
    (r,) = sys_.cocoserve.replicated.values()
    sys_.cocoserve.instance_gone(r.instance_id)
    assert not sys_.cocoserve.replicated
    assert sys_.nodes["gpu1"].sched.ledger.target(replica_key(r.instance_id, "gpu1")) == 0
    assert sys_.nodes["gpu0"].sched.perf.get(a, Hardware.GPU) == sys_.perf.get(a, Hardware.GPU)


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
