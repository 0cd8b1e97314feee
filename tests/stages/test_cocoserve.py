"""CoCoServe's module-level scaling on real processes: layers of a running instance migrate to
stage processes (and back) or get replicas there, between iterations, while requests decode; the
greedy output equals a local instance's before, during and after."""

from __future__ import annotations

import pytest

from services.node.engines.torch_engine import TorchEngine
from services.node.engines.stage_client import StageClient

from .conftest import generate

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(tiny):
    engine = TorchEngine(tiny)
    engine.load()
    yield engine
    engine.unload()


def test_layers_migrate_out_and_back_while_requests_stream(tiny, stages, engine, reference):
    tail, middle = stages.start(tiny, 2, 4), stages.start(tiny, 1, 2)
    full = engine.memory()
    seen = {}

    def shed_tail(e):
        e.shed_layers(tail.address)
        seen["tail"] = e.memory()

    def shed_middle(e):
        e.shed_layers(middle.address)
        seen["middle"] = e.layout()

    def take_back(e):
        e.take_layers(1, 4)
        seen["back"] = e.memory()

    out = generate(engine, hooks={3: shed_tail, 6: shed_middle, 15: take_back})
    assert out == reference
    # Under memory pressure the instance shed half its layers: their weights and K/V pools left.
    assert seen["tail"].weight_bytes == full.weight_bytes - tail.weight_bytes
    assert seen["tail"].kv_capacity_bytes == full.kv_capacity_bytes // 2
    assert seen["middle"].local == ((0, 1),)
    assert seen["middle"].remote == ((1, 2, middle.address), (2, 4, tail.address))
    # Every layer home again: the same weights and pool as before.
    assert (seen["back"].weight_bytes, seen["back"].kv_capacity_bytes) == \
        (full.weight_bytes, full.kv_capacity_bytes)
    with pytest.raises(ValueError, match="at least one"):
        engine.shed_layers(stages.start(tiny, 0, 4).address)


def test_replicas_take_new_requests_and_give_them_back(tiny, stages, engine, reference):
    replica = stages.start(tiny, 2, 4)
    client = StageClient(replica.address)
    seen = {}

    def replicate(e):
        e.replicate_layers(replica.address)

    def check(e):
        seen["layout"] = e.layout()
        seen["replica_blocks"] = client.memory()["kv_used_blocks"]

    def drop(e):
        e.drop_replica(replica.address)
        seen["after"] = e.layout()
        seen["replica_after"] = client.memory()["kv_used_blocks"]

    # a and b were computed before the replica came: they stay here; c (joining at step 8) goes
    # to the replica, which computes layers 2-3 for it while this process does a and b.
    out = generate(engine, hooks={2: replicate, 12: check, 20: drop})
    assert out == reference
    assert seen["layout"].replicas == ((2, 4, replica.address),)
    assert seen["layout"].assigned == {replica.address: 1}
    assert seen["replica_blocks"] > 0
    assert seen["after"].replicas == () and seen["replica_after"] == 0
    client.close()


def test_a_batch_split_among_replicas_gives_the_local_output(tiny, stages, engine, reference):
    """Replicas from the start: new requests alternate between here and two replicas."""
    one, two = stages.start(tiny, 1, 3), stages.start(tiny, 1, 3)
    engine.replicate_layers(one.address)
    engine.replicate_layers(two.address)
    seen = {}
    out = generate(engine, hooks={10: lambda e: seen.update(e.layout().assigned)})
    assert out == reference
    assert sorted(seen.values()) == [1, 1]  # a here, b and c on one replica each
    with pytest.raises(ValueError, match="overlap"):
        engine.replicate_layers(stages.start(tiny, 2, 4).address)
