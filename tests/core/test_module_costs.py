"""The cost and memory of split / replicated instances (shared/core/modules.py): what shadow
validation and the memory ledger see of CoCoServe's modules and λScale's pipelines."""

from __future__ import annotations

import pytest

from shared.core.config import CoreConfig
from shared.core.cost import (HopCost, Replication, layer_weight_bytes, pipeline_profile,
                              plan_layer_move, replicated_profile, share_spec)
from shared.core.memory import MemoryLedger, MemOpKind
from shared.core.modules import speedup, stage_key
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.shadow import shadow_validate
from shared.core.admission import AdmitReason
from shared.core.types import SLO, Hardware, InstanceView, RequestView

from .factories import GB, linear_profile, model

HOP = HopCost(latency_s=0.001, bytes_per_s=1e9, token_bytes=4096)


def _proportional(model_name: str = "m") -> Profile:
    """Decode time exactly proportional to the batch (no fixed part): the speedup model's world."""
    batches, lengths = [1, 2, 4, 8, 16, 32], [16, 1024]
    return Profile(model_name, Hardware.CPU, PrefillTable([16, 1024], [0.01, 0.5]),
                   DecodeTable(batches, lengths, [[0.01 * b, 0.01 * b] for b in batches]))


def test_a_pipeline_pays_its_hops_on_every_iteration():
    base = linear_profile("m", Hardware.CPU)
    piped = pipeline_profile(base, 2, HOP)
    assert piped.prefill_s(512) == pytest.approx(base.prefill_s(512) + 2 * HOP.seconds(512))
    assert piped.decode_s(8, 256) == pytest.approx(base.decode_s(8, 256) + 2 * HOP.seconds(8))
    assert pipeline_profile(base, 0, HOP) is base
    with pytest.raises(ValueError):
        pipeline_profile(base, -1, HOP)


def test_replicated_decode_is_the_speedup_model_when_time_is_linear_in_the_batch():
    base = _proportional()
    rep = Replication(16, {"d1": set(range(8))})  # half the layers twice: 2 hops
    b = 16
    layer_s = base.decode_s(b, 16) / 16
    hop_relative = HOP.seconds(b / 2) / layer_s  # C of the speedup model at this batch
    got = replicated_profile(base, rep, HOP).decode_s(b, 16)
    assert got == pytest.approx(base.decode_s(b, 16) / speedup(rep, hop_relative))
    assert got < base.decode_s(b, 16)
    assert replicated_profile(base, Replication(16), HOP) is base


def test_replicas_gain_little_where_a_small_batch_costs_as_much_as_a_large_one():
    flat = linear_profile("m", Hardware.CPU, decode_base=0.05, decode_per_req=0.0001)
    rep = Replication(16, {"d1": set(range(8))})
    gain = flat.decode_s(32, 256) / replicated_profile(flat, rep, HOP).decode_s(32, 256)
    free_hops = HopCost(0.0, 1e18, 4096)
    gain_free = flat.decode_s(32, 256) / replicated_profile(flat, rep, free_hops).decode_s(32, 256)
    # The model's promise with free hops is 1.33x; here even free hops give < 2%, and the hops'
    # latency makes replication a loss: the core does not replicate such a model.
    assert speedup(rep, 0.0) == pytest.approx(4 / 3)
    assert 1.0 <= gain_free < 1.02 and gain < 1.0


def _busy(batch: int, tpot: float) -> InstanceView:
    spec = model("m")
    return InstanceView("a", spec, "n", requests=[
        RequestView(f"r{k}", "m", 64, 0.0, SLO(30.0, tpot), generated=1, prefilled=True,
                    max_tokens=256) for k in range(batch)])


def test_shadow_validation_sees_the_replicated_instance_faster():
    """At 31 requests the local decode step (0.32 s) passes the TPOT of 0.3 s: the 32nd request
    is refused; with half the layers replicated (0.16 s + hops per step) it is admitted."""
    base = _proportional()
    newcomer = RequestView("new", "m", 64, 0.0, SLO(30.0, 0.3), max_tokens=256)
    cfg = CoreConfig()
    inst = _busy(31, 0.3)
    assert shadow_validate([inst], {"a": base}, "a", newcomer, 0.0, 0.0, cfg) is \
        AdmitReason.TPOT_BUDGET
    rep = replicated_profile(base, Replication(16, {"d1": set(range(16))}), HOP)
    assert shadow_validate([inst], {"a": rep}, "a", newcomer, 0.0, 0.0, cfg) is \
        AdmitReason.ADMITTED


def test_shadow_validation_charges_a_slow_link_to_a_pipeline():
    base = _proportional()
    newcomer = RequestView("new", "m", 64, 0.0, SLO(30.0, 0.3), max_tokens=256)
    inst = _busy(20, 0.3)  # 21 x 0.01 = 0.21 s a step locally
    cfg = CoreConfig()
    assert shadow_validate([inst], {"a": base}, "a", newcomer, 0.0, 0.0, cfg) is \
        AdmitReason.ADMITTED
    slow = pipeline_profile(base, 2, HopCost(0.05, 1e8, 4096))  # +0.1 s a step
    assert shadow_validate([inst], {"a": slow}, "a", newcomer, 0.0, 0.0, cfg) is \
        AdmitReason.TPOT_BUDGET


def test_share_spec_splits_weights_and_kv_by_layer():
    spec = model("m", weight_gb=2.0, kv_per_token=16 * 1024)
    head = int(0.5 * GB)
    layer = layer_weight_bytes(spec, 16, head)
    assert layer == (2 * GB - head) // 16
    front = share_spec(spec, 4, 16, head, head=True)
    back = share_spec(spec, 12, 16, head, head=False)
    assert front.weight_bytes == head + 4 * layer and back.weight_bytes == 12 * layer
    assert front.kv_bytes_per_token + back.kv_bytes_per_token == spec.kv_bytes_per_token
    with pytest.raises(ValueError):
        share_spec(spec, 17, 16, head, head=True)


def test_a_layer_move_is_accounted_on_both_ledgers():
    """The destination's stage is a LOAD its reservation station parks until it fits; the
    source shrinks by what moved."""
    spec = model("m", weight_gb=2.0, kv_per_token=16 * 1024)
    head, kv_pool, kv_live = int(0.5 * GB), 1 * GB, int(0.25 * GB)
    move = plan_layer_move(spec, kv_pool, kv_live, 16, 16, 4, head)
    layer = layer_weight_bytes(spec, 16, head)
    assert move.dest_bytes == 4 * layer + kv_pool // 4
    assert move.source_bytes_after == spec.weight_bytes - 4 * layer + kv_pool - kv_pool // 4
    assert move.moved_bytes == 4 * layer + kv_live // 4
    with pytest.raises(ValueError):
        plan_layer_move(spec, kv_pool, kv_live, 16, 16, 16, head)  # keep at least one layer

    source, dest = MemoryLedger(8 * GB), MemoryLedger(2 * GB)
    ok, started = source.request(MemOpKind.LOAD, "a", spec.weight_bytes + kv_pool, 0.0)
    assert ok and started
    source.complete("a", started[0].op_id, 0.0)
    ok, other = dest.request(MemOpKind.LOAD, "b", int(1.5 * GB), 0.0)  # a neighbour loading
    assert ok and other
    key = stage_key("a", 12, 16)
    ok, started = dest.request(MemOpKind.LOAD, key, move.dest_bytes, 0.0)
    assert not ok and not started  # does not fit beside the neighbour: no move
    dest.complete("b", other[0].op_id, 0.0)
    dest.request(MemOpKind.UNLOAD, "b", 0, 1.0)
    (unload,) = dest.running()
    ok, started = dest.request(MemOpKind.LOAD, key, move.dest_bytes, 1.0)
    assert ok and not started  # approved, parked until the neighbour's memory is really free
    (stage,) = dest.complete("b", unload.op_id, 2.0)
    assert stage.instance_id == key and stage.bytes_after == move.dest_bytes
    dest.complete(key, stage.op_id, 3.0)
    ok, (shrink,) = source.request(MemOpKind.SCALE, "a", move.source_bytes_after, 3.0)
    source.complete("a", shrink.op_id, 3.5)
    assert source.allocated("a") + dest.allocated(key) == spec.weight_bytes + kv_pool


def test_the_measured_hop_feeds_the_speedup_model():
    """A cheap link lets Algorithm 1 replicate; a link whose hop costs more than a layer's share
    of the step leaves the instance as it is."""
    from shared.core.modules import Device, relative_hop_cost, scale_up

    base = _proportional()
    cheap = relative_hop_cost(base, HopCost(1e-5, 1e10, 4096), 16, 16, 16)
    dear = relative_hop_cost(base, HopCost(0.5, 1e8, 4096), 16, 16, 16)
    assert cheap < 0.01 and dear > 10
    assert scale_up(Replication(16), [Device("d1", 8)], cheap).replicas() == 8
    assert scale_up(Replication(16), [Device("d1", 8)], dear).replicas() == 0


def test_layers_to_shed_frees_the_deficit_with_the_fewest_layers():
    from shared.core.modules import layers_to_shed

    spec = model("m", weight_gb=2.0, kv_per_token=16 * 1024)
    head, pool = int(0.5 * GB), 1 * GB
    per_layer = layer_weight_bytes(spec, 16, head) + pool // 16
    assert layers_to_shed(spec, pool, 16, 16, head, 0) == 0
    assert layers_to_shed(spec, pool, 16, 16, head, per_layer) == 1
    assert layers_to_shed(spec, pool, 16, 16, head, per_layer + 1) == 2
    assert layers_to_shed(spec, pool, 16, 16, head, 16 * per_layer) is None  # keeps one layer
