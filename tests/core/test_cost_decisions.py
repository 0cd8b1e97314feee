"""Wrong decisions of issue 22 that come from what an instance costs (shared/core/cost.py):
each test failed on the code before its fix."""

from __future__ import annotations

from shared.core.cost import kv_demand, layer_weight_bytes, plan_layer_move
from shared.core.modules import stage_key
from shared.core.types import Hardware, InstanceLayout, LayerRun

from .factories import GB, loaded, node, perf_for, request
from .test_module_scaling import HEAD, LAYERS, drain, proportional, spec


def _moved_kv(inst, moved: int) -> int:
    """The K/V the moved layers' stage holds: it mirrors the owner's block count, so its pool
    is the owner's token capacity times the moved layers' K/V per token."""
    full = inst.layout.model
    tokens = inst.kv_bytes // inst.model.kv_bytes_per_token
    return tokens * (full.kv_bytes_per_token * moved // full.layers)


# -- #1: a shed's moved layers grow K/V on the host outside the host's ledger -------------------


def test_a_split_instance_never_grows_kv_beyond_what_its_stages_host_reserved():
    """Issue 22 #1: shed 4 of 8 layers, then admit 11 requests. Before the fix the owner grew
    its pool for them (sized on its local share only), so the stage, which mirrors its block
    count, needed 4.72 GB of K/V on a host that reserved 0.63 GB."""
    perf = perf_for(proportional())
    owner = node("a", Hardware.CPU, 64, perf)
    host = node("b", Hardware.CPU, 64, perf)
    full = spec()
    iid = loaded(owner, None, request("r0", ttft=60.0, tpot=5.0), full)
    inst = owner.node.instance(iid)
    move = plan_layer_move(full, inst.kv_bytes, 0, LAYERS, LAYERS, 4, HEAD)
    reserved = move.dest_bytes - 4 * layer_weight_bytes(full, LAYERS, HEAD)
    ok, ops = host.hold(stage_key(iid, 4, 8), move.dest_bytes, 0.0)
    assert ok
    drain(host, ops)
    layout = InstanceLayout(full, (LayerRun(4, 8, "b", "b:1"),), 1e-4, 1e10)
    ok, ops = owner.set_layout(iid, layout, 0.0)
    assert ok
    drain(owner, ops)
    assert abs(reserved / GB - 0.63) < 0.01  # the figure
    newcomers = [request(f"r{k}", input_len=624, ttft=60.0, tpot=5.0) for k in range(1, 12)]
    # What the pool grown for all of them (at the watermark) would need on the moved layers.
    wanted = int(kv_demand(full, [*inst.requests, *newcomers]) * (1 + owner.config.watermark))
    assert abs(wanted * 4 // LAYERS / GB - 4.72) < 0.01  # the figure
    for k, newcomer in enumerate(newcomers, 1):
        res = owner.admit(newcomer, iid, full, 0.0)
        drain(owner, res.start_ops)
        assert _moved_kv(inst, 4) <= reserved, f"after {k} admissions"
    assert owner.ledger.allocated(iid) <= owner.node.memory_bytes
