"""A node worker's stage host (services/node/stage_host.py): layer ranges of another node's
instance served from the worker's own process, keyed by stage key, made from the model's files,
the node's DRAM tier or tensors the caller holds; an engine on the owner's side uses them as it
uses stage processes, with the same greedy output; released on command or when the owner is gone."""

from __future__ import annotations

import pytest
import torch

from services.node.engines.torch_engine import TorchEngine
from services.node.stage_host import ORPHAN_GRACE_S, StageHost, is_stage_key, parse_stage_key
from services.node.engines.stage_client import StageClient
from services.node.engines.stage_wire import StageError
from services.node.engines.weights import layer_of, read_tensors
from shared.core.modules import stage_key

from .conftest import generate

pytestmark = pytest.mark.integration


def _layer_bytes(model, start: int, end: int) -> int:
    tensors = read_tensors(model, lambda n: (i := layer_of(n)) is not None and start <= i < end)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_stage_keys_name_their_owner_and_range():
    key = stage_key("tiny@n1#3", 2, 4)
    assert is_stage_key(key) and parse_stage_key(key) == ("tiny@n1#3", 2, 4)
    assert not is_stage_key("tiny@n1#3")
    with pytest.raises(ValueError):
        parse_stage_key("tiny@n1#3/layers/x:4")
    with pytest.raises(ValueError, match="not the stage key"):
        StageHost().expect("other", "/m", 2, 4, "tiny@n1#3", "n1")


def test_a_hosted_range_from_the_files_serves_an_engine_the_local_output(tiny, reference):
    host = StageHost()
    key = stage_key("tiny@owner#1", 2, 4)
    host.expect(key, str(tiny), 2, 4, "tiny@owner#1", "owner")
    assert host.owns(key) and host.get(key) is None  # announced, not built: no bytes yet
    hosted = host.build(key)
    assert host.build(key) is hosted  # a second LOAD of the same key keeps it
    try:
        assert hosted.source == "files"
        assert hosted.weight_bytes == _layer_bytes(tiny, 2, 4)
        engine = TorchEngine(tiny, remote_layers=[hosted.address])
        engine.load()
        try:
            assert hosted.bytes() > hosted.weight_bytes  # the engine sized its K/V pool
            assert generate(engine) == reference
        finally:
            engine.unload()
    finally:
        assert host.release(key)
    assert not host.owns(key) and host.keys() == []
    assert not host.release(key)


def test_a_range_is_served_from_the_dram_tier_or_given_tensors_without_a_copy(tiny_converted):
    from services.node.loader import CheckpointLoader, LoaderSettings

    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=256 << 20, dram_bytes_per_s=1e10))
    host = StageHost(loader)
    try:
        loader.load(tiny_converted)  # now in the DRAM tier
        dram = host.serve(stage_key("a#1", 0, 2), str(tiny_converted), 0, 2, "a#1", "n")
        assert dram.source == "dram"
        held = loader.host_checkpoint(tiny_converted).tensors(torch.device("cpu"))
        name = "model.layers.1.self_attn.q_proj.weight"
        assert dram.server.stage.layers[1].self_attn.q_proj.weight.data_ptr() == \
            held[name].data_ptr()
        given = host.serve(stage_key("b#1", 1, 3), str(tiny_converted), 1, 3, "b#1", "n",
                           tensors=held)
        assert given.source == "tensors"
        assert given.server.stage.layers[1].self_attn.q_proj.weight.data_ptr() == \
            held[name].data_ptr()
        assert sorted(host.release_owner("b#1")) == [stage_key("b#1", 1, 3)]
        assert host.keys() == [stage_key("a#1", 0, 2)]
    finally:
        host.close()
        loader.close()
    assert host.keys() == []


def test_a_released_range_ends_its_links_and_orphans_are_found(tiny):
    host = StageHost()
    key = stage_key("gone@n2#1", 3, 4)
    hosted = host.serve(key, str(tiny), 3, 4, "gone@n2#1", "n2")
    client = StageClient(hosted.address)
    assert host.orphans([hosted.address], hosted.created + 2 * ORPHAN_GRACE_S) == []
    assert host.orphans([], hosted.created + 1.0) == []  # too young: maybe not published yet
    assert host.orphans([], hosted.created + 2 * ORPHAN_GRACE_S) == [key]
    host.release(key)
    with pytest.raises(StageError):
        client.resize(4)
    client.close()
    with pytest.raises(ValueError, match="not a range"):
        host.expect(stage_key("x", 3, 3), str(tiny), 3, 3, "x", "n")


def test_memory_ops_of_a_stage_key_build_and_release_it(tiny):
    host = StageHost()
    key = stage_key("m@n#1", 0, 1)
    host.expect(key, str(tiny), 0, 1, "m@n#1", "n")
    host.run_op("load", key)
    hosted = host.get(key)
    host.run_op("scale", key)  # the owner resized the pool: the same stage
    assert host.get(key) is hosted and hosted.weight_bytes == _layer_bytes(tiny, 0, 1)
    host.run_op("unload", key)
    assert host.keys() == []
    with pytest.raises(KeyError, match="announced"):
        host.run_op("load", key)


def test_a_stage_on_the_nodes_own_copy_counts_its_weights_only_once_no_instance_does(tiny):
    """λScale Algorithm 2: a receiver hosting from its own copy holds the K/V only while its own
    instance counts the weights; once that instance is gone the stage's views keep the copy."""
    host = StageHost()
    key = stage_key("tiny@head#1", 1, 3)
    tensors = read_tensors(tiny, lambda n: (i := layer_of(n)) is not None and 1 <= i < 3)
    host.expect(key, str(tiny), 1, 3, "tiny@head#1", "head", tensors, own_copy=True)
    hosted = host.build(key)
    try:
        kv = hosted.bytes()
        assert hosted.bytes(copy_counted=True) == kv  # by default: the instance counts them
        assert hosted.bytes(copy_counted=False) == kv + hosted.weight_bytes
        assert hosted.weight_bytes == _layer_bytes(tiny, 1, 3) > 0
    finally:
        host.close()
