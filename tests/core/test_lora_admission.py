"""LoRA adapters in the node's core: an adapter request on a node that holds its backbone costs
the adapter's bytes plus its KV (never another backbone), through the memory ledger's own entry
for the adapter and its own LOAD op; the instance runs nothing while an adapter loads; unloading
the instance unloads its adapters."""

from shared.core.admission import AdmitReason
from shared.core.iteration import IterationKind
from shared.core.memory import MemOpKind
from shared.core.types import AdapterSpec, Hardware, adapter_key, adapter_owner

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

MB = 1024**2


def done(sched, ops, now=0.0):
    pending = list(ops)
    while pending:
        pending.extend(sched.memop_done(pending.pop(0), now))


def test_adapter_key_round_trips():
    key = adapter_key("m@n0#1", "tenant~a1")
    assert adapter_owner(key) == ("m@n0#1", "tenant~a1")
    assert adapter_owner("m@n0#1") is None


def test_adapters_on_a_resident_backbone_cost_their_bytes_only():
    spec = model("m", weight_gb=4)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base"), spec)
    for i in range(8):
        res = sched.admit(request(f"r{i}", ttft=5.0), iid, spec, 0.0,
                          AdapterSpec(f"a{i}", 30 * MB))
        assert res.admission.ok and res.instance_id == iid
        loads = [op for op in res.start_ops if op.kind is MemOpKind.LOAD]
        assert [op.instance_id for op in loads] == [adapter_key(iid, f"a{i}")]
        assert loads[0].bytes_after == 30 * MB
        done(sched, res.start_ops)
    # One backbone, eight adapters, and the requests' KV: no second copy of the weights.
    assert len(sched.node.instances) == 1
    inst = sched.node.instances[0]
    assert inst.adapters == {f"a{i}": 30 * MB for i in range(8)}
    assert sched.ledger.budget == sched.ledger.target(iid) + 8 * 30 * MB
    assert sched.ledger.target(iid) == spec.weight_bytes + inst.kv_bytes
    assert sched.ledger.budget < 2 * spec.weight_bytes
    # The same adapter again adds no adapter bytes (only, perhaps, KV).
    res = sched.admit(request("again", ttft=5.0), iid, spec, 0.0, AdapterSpec("a0", 30 * MB))
    assert res.admission.ok
    assert not [op for op in res.start_ops if adapter_owner(op.instance_id) is not None]
    done(sched, res.start_ops)
    assert sched.ledger.budget == sched.ledger.target(iid) + 8 * 30 * MB


def test_a_cold_start_with_an_adapter_loads_backbone_and_adapter():
    spec = model("m", weight_gb=4)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    res = sched.admit(request("r"), None, spec, 0.0, AdapterSpec("a", 50 * MB))
    assert res.admission.ok
    keys = sorted(op.instance_id for op in res.start_ops)
    assert keys == sorted([res.instance_id, adapter_key(res.instance_id, "a")])
    assert sched.ledger.budget == sched.ledger.target(res.instance_id) + 50 * MB


def test_the_adapter_bytes_are_counted_in_the_memory_check():
    # 4 GB backbone with its KV leaves less than the adapter's bytes free.
    spec = model("m", weight_gb=4)
    sched = node(memory_gb=4.2, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base"), spec)
    free = sched.ledger.capacity - sched.ledger.budget
    too_big = AdapterSpec("big", free + 1)
    res = sched.admit(request("r"), iid, spec, 0.0, too_big)
    assert res.admission.reason is AdmitReason.MEMORY
    assert sched.node.instances[0].adapters == {} and len(sched.node.instances[0].requests) == 1
    fits = AdapterSpec("ok", free // 4)
    assert sched.admit(request("r2", input_len=10), iid, spec, 0.0, fits).admission.ok


def test_the_instance_runs_nothing_while_an_adapter_loads():
    spec = model("m", weight_gb=1)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base"), spec)
    res = sched.admit(request("r"), iid, spec, 0.0, AdapterSpec("a", 10 * MB))
    adapter_ops = [op for op in res.start_ops if adapter_owner(op.instance_id)]
    other = [op for op in res.start_ops if not adapter_owner(op.instance_id)]
    done(sched, other)
    assert sched.step(0.0).iteration is None  # blocked by the adapter's load
    done(sched, adapter_ops)
    plan = sched.step(0.0)
    assert plan.iteration is not None and plan.iteration.kind is IterationKind.PREFILL


def test_unloading_the_instance_unloads_its_adapters():
    spec = model("m", weight_gb=1)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base"), spec)
    for name in ("a", "b"):
        done(sched, sched.admit(request(name), iid, spec, 0.0, AdapterSpec(name, 10 * MB)).start_ops)
    evicted, ops = sched.preempt([iid], 1.0)
    assert {r.request_id for r in evicted} == {"base", "a", "b"}
    assert sorted(op.instance_id for op in ops) == sorted(
        [iid, adapter_key(iid, "a"), adapter_key(iid, "b")])
    assert all(op.kind is MemOpKind.UNLOAD for op in ops)
    done(sched, ops, 1.0)
    assert sched.ledger.budget == 0 and sched.node.instances == []


def test_detach_frees_the_adapter_only():
    spec = model("m", weight_gb=1)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base"), spec)
    done(sched, sched.admit(request("r"), iid, spec, 0.0, AdapterSpec("a", 10 * MB)).start_ops)
    budget = sched.ledger.budget
    ops = sched.detach_adapter(iid, "a", 0.0)
    assert [(op.kind, op.instance_id) for op in ops] == [(MemOpKind.UNLOAD, adapter_key(iid, "a"))]
    done(sched, ops)
    assert sched.ledger.budget == budget - 10 * MB
    assert sched.node.instances[0].adapters == {}
    assert sched.detach_adapter(iid, "a", 0.0) == []


def test_memory_pressure_offloads_idle_adapters_least_valuable_first():
    """§4.3: a request that does not fit makes room by offloading idle adapters, the least
    valuable (rarely invoked) first; never one with a request in flight; and nothing at all when
    offloading every idle adapter would not be enough."""
    spec = model("m", weight_gb=1)
    sched = node(memory_gb=1.2, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("base", input_len=10, ttft=50), spec)
    size = 40 * MB
    now = 0.0
    # "hot" is invoked 5 times, "cold" once, "busy" once and keeps its request.
    for name, calls in (("hot", 5), ("cold", 1), ("busy", 1)):
        for k in range(calls):
            now += 0.1
            rid = f"{name}-{k}"
            res = sched.admit(request(rid, input_len=10, ttft=50, arrival=now), iid, spec, now,
                              AdapterSpec(name, size))
            assert res.admission.ok, (rid, res.admission)
            done(sched, res.start_ops, now)
            if name != "busy":
                sched.cancel(rid, now)
    assert set(sched.node.instances[0].adapters) == {"hot", "cold", "busy"}
    assert [a for _, a, _ in sched.offloadable(now)] == ["cold", "hot"]
    free = sched.ledger.capacity - sched.ledger.budget
    # A new adapter that needs one idle adapter's room: "cold" goes, "hot" stays.
    newcomer = AdapterSpec("new", free + size // 2)
    res = sched.admit(request("n", input_len=10, ttft=50, arrival=now), iid, spec, now, newcomer)
    assert res.admission.ok
    unloads = [op for op in res.start_ops if op.kind is MemOpKind.UNLOAD]
    assert [op.instance_id for op in unloads] == [adapter_key(iid, "cold")]
    done(sched, res.start_ops, now)
    assert set(sched.node.instances[0].adapters) == {"hot", "busy", "new"}
    # More than every idle adapter could free: refused, and nothing is offloaded.
    free = sched.ledger.capacity - sched.ledger.budget
    huge = AdapterSpec("huge", free + 3 * size)
    res = sched.admit(request("h", input_len=10, ttft=50, arrival=now), iid, spec, now, huge)
    assert res.admission.reason is AdmitReason.MEMORY and res.start_ops == ()
    assert set(sched.node.instances[0].adapters) == {"hot", "busy", "new"}


def test_rates_count_adapter_calls_for_their_backbone_and_fall_while_nothing_calls():
    spec = model("m", weight_gb=1)
    sched = node(memory_gb=10, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("p0", ttft=5.0), spec, now=0.0)
    for k in range(4):
        res = sched.admit(request(f"a{k}", ttft=5.0), iid, spec, float(k), AdapterSpec("a", MB))
        assert res.admission.ok
        done(sched, res.start_ops, float(k))
    assert sched.rate("a", 4.0) == 1.0  # 4 calls over 4 s
    assert sched.rate("m", 4.0) == 5 / 4  # the plain call and the adapter's four
    assert sched.rate("a", 40.0) == 4 / 40  # nothing since: the rate falls
    assert sched.rate("never", 4.0) == 0.0 and sched.called() == ["a", "m"]


def test_an_adapter_is_preloaded_onto_a_ready_instance_within_the_budget_only():
    spec = model("m", weight_gb=4)
    sched = node(memory_gb=5, perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("p", ttft=5.0), spec)
    ops = sched.preload_adapter(iid, AdapterSpec("a", 30 * MB), 1.0)
    assert [op.instance_id for op in ops] == [adapter_key(iid, "a")]
    assert sched.node.instance(iid).adapters == {"a": 30 * MB}
    done(sched, ops, 1.0)
    assert sched.preload_adapter(iid, AdapterSpec("a", 30 * MB), 1.0) == []  # already there
    room = sched.ledger.capacity - sched.ledger.budget
    assert sched.preload_adapter(iid, AdapterSpec("big", room + 1), 1.0) == []  # never over
    assert "big" not in sched.node.instance(iid).adapters
    assert sched.preload_adapter("nope", AdapterSpec("b", MB), 1.0) == []
    # Pre-loaded and idle, it is what offloading takes first under pressure (§4.3).
    assert [a for _, a, _ in sched.offloadable(2.0)] == ["a"]
