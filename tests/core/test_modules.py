"""CoCoServe's module-level scaling plans: the speedup model, Algorithm 1 (scale-up by layer
replication) and Algorithm 2's reduction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.cost import Replication
from shared.core.modules import (Device, Reduction, eviction_order, module_reduction, scale_up,
                                 speedup)


def test_speedup_model_rewards_replicas_and_charges_hops():
    base = Replication(8)
    assert speedup(base, 0.1) == 1.0
    half = Replication(8, {"d1": {0, 1, 2, 3}})  # one contiguous run: 2 hops
    scattered = Replication(8, {"d1": {0, 2, 4, 6}})  # four runs: 8 hops
    assert speedup(half, 0.1) == pytest.approx(8 / (4 * 0.5 + 4 + 0.2))
    assert speedup(half, 0.1) > speedup(scattered, 0.1)
    full = Replication(8, {"d1": set(range(8))})
    assert speedup(full, 0.0) == pytest.approx(2.0)  # every layer twice, free hops: 2x


def test_scale_up_fills_a_device_with_a_contiguous_run():
    rep = scale_up(Replication(16), [Device("d1", 6)], hop_cost=0.05)
    assert rep.on["d1"] == set(range(6))  # contiguous, from layer 0
    assert speedup(rep, 0.05) > 1.0


def test_scale_up_adds_nothing_when_hops_cost_more_than_replicas_give():
    rep = scale_up(Replication(4), [Device("d1", 1)], hop_cost=5.0)
    assert rep.on == {}


@given(layers=st.integers(2, 40), room=st.lists(st.integers(0, 12), max_size=4),
       hop=st.sampled_from([0.0, 0.02, 0.1, 0.5]))
@settings(max_examples=200, deadline=None)
def test_scale_up_never_lowers_the_speedup_nor_exceeds_any_device(layers, room, hop):
    devices = [Device(f"d{i}", r) for i, r in enumerate(room)]
    before = Replication(layers)
    after = scale_up(before, devices, hop)
    assert speedup(after, hop) >= speedup(before, hop)
    for d in devices:
        assert len(after.on.get(d.name, ())) <= d.free_layers
    assert all(0 <= i < layers for h in after.on.values() for i in h)


def test_reduction_escalates_from_migration_to_replicas_to_batch():
    rep = Replication(8, {"d1": {0, 1, 2, 3}, "d2": {6}})
    steps = module_reduction(rep, 0.1, migrate_to=["d3"])
    kinds = [s.action for s in steps]
    assert kinds[0] == Reduction.MIGRATE and kinds[-1] == Reduction.REDUCE_BATCH
    assert kinds.count(Reduction.EVICT_REPLICA) == 5
    # The lone replica on d2 costs two hops for one layer: the cheapest to lose, so first.
    assert eviction_order(rep, 0.1)[0] == ("d2", 6)
