"""Layer stages on real processes: an instance whose decoder layers are split between this
process and stage processes gives the greedy output of a local instance."""

from __future__ import annotations

import pytest
import torch

from services.node.engines.base import KVCacheFull, SamplingParams
from services.node.engines.stage_client import StageClient
from services.node.engines.stage_wire import StageError
from services.node.engines.torch_engine import TorchEngine
from services.node.engines.torch_kernel import StepSpec
from services.node.engines.weights import layer_of, read_tensors

from .conftest import GREEDY, PROMPTS, generate

pytestmark = pytest.mark.integration


@pytest.fixture
def engines():
    made = []

    def make(model, **kwargs) -> TorchEngine:
        engine = TorchEngine(model, **kwargs)
        engine.load()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.unload()


def _layer_bytes(model, start: int, end: int) -> int:
    tensors = read_tensors(model, lambda n: (i := layer_of(n)) is not None and start <= i < end)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_split_instance_generates_what_a_local_one_does(tiny, stages, engines, reference):
    stage = stages.start(tiny, 2, 4)
    assert stage.weight_bytes == _layer_bytes(tiny, 2, 4)  # only its layers' bytes
    engine = engines(tiny, remote_layers=[stage.address])
    layout = engine.layout()
    assert layout.local == ((0, 2),) and layout.remote == ((2, 4, stage.address),)
    local = TorchEngine(tiny)
    local.load()
    # This process holds the other layers (plus embeddings and head), and K/V for 2 of 4.
    assert engine.memory().weight_bytes == local.memory().weight_bytes - stage.weight_bytes
    assert engine.memory().kv_bytes_per_token * 2 == local.memory().kv_bytes_per_token
    local.unload()
    assert generate(engine) == reference


def test_stages_in_the_middle_and_at_the_end_with_a_converted_checkpoint(
        tiny_converted, stages, engines, reference):
    middle, tail = stages.start(tiny_converted, 1, 2), stages.start(tiny_converted, 3, 4)
    engine = engines(tiny_converted, remote_layers=[middle.address, tail.address])
    assert engine.layout().local == ((0, 1), (2, 3))
    assert generate(engine) == reference


def test_extend_runs_through_the_stages(tiny, stages, engines):
    """Live migration's catch-up (extend) on a split instance gives the local result."""
    stage = stages.start(tiny, 1, 4)
    split = engines(tiny, remote_layers=[stage.address])
    local = engines(tiny)
    prompt, more = PROMPTS["a"], [3, 4, 5, 6, 7]
    tokens = []
    for engine in (local, split):
        engine.add_request("x", prompt, GREEDY)
        engine.prefill("x")
        tokens.append([engine.extend("x", more).tokens["x"],
                       *[engine.decode(["x"]).tokens["x"] for _ in range(5)]])
        engine.release("x")
    assert tokens[0] == tokens[1]


def test_prefill_chunks_run_through_the_stages(tiny, stages, engines):
    """Chunked prefill on a split instance: its chunks (a prefill, then extends against the
    stage's cached K/V) give the local whole prefill's tokens."""
    stage = stages.start(tiny, 2, 4)
    split = engines(tiny, remote_layers=[stage.address])
    local = engines(tiny)
    prompt = PROMPTS["a"]  # 35 tokens
    tokens = []
    for engine, chunks in ((local, ()), (split, (10, 17))):
        engine.add_request("x", prompt, GREEDY)
        for size in chunks:
            assert engine.prefill_chunk("x", size).tokens == {}
        tokens.append([engine.prefill("x").tokens["x"],
                       *[engine.decode(["x"]).tokens["x"] for _ in range(8)]])
        engine.release("x")
    assert tokens[0] == tokens[1]


def test_the_stages_pool_follows_the_engines_and_a_full_one_is_kv_cache_full(
        tiny, stages, engines):
    stage = stages.start(tiny, 2, 4)
    engine = engines(tiny, remote_layers=[stage.address])
    client = StageClient(stage.address)
    assert client.memory()["kv_blocks"] == engine.cache.num_blocks > 4
    engine.resize_kv(4 * engine.cache.block_bytes)
    assert client.memory()["kv_blocks"] == 4
    engine.resize_kv(2 * engine.cache.block_bytes)
    assert client.memory()["kv_blocks"] == 2
    # A stage whose pool is smaller than the engine's refuses with KVCacheFull, and the engine's
    # own reservation is undone: the request can run once the stage has room.
    client.resize(1)
    engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=4))
    with pytest.raises(KVCacheFull):
        engine.prefill("long")
    assert engine.cache.used_blocks == 0 and engine.requests["long"].computed == 0
    engine.resize_kv(4 * engine.cache.block_bytes)
    engine.prefill("long")
    assert client.memory()["kv_used_blocks"] == 3
    engine.release("long")
    assert client.memory()["kv_used_blocks"] == 0
    client.close()


def test_bad_calls_get_reasons_and_the_stage_keeps_serving(tiny, stages):
    stage = stages.start(tiny, 0, 2)
    client = StageClient(stage.address)
    with pytest.raises(StageError, match="unknown op"):
        client.call({"op": "teleport"})
    with pytest.raises(StageError, match="one request"):
        client.call({"op": "forward", "kind": "prefill", "ids": ["a", "b"], "starts": [0, 0],
                     "counts": [1, 1]}, [torch.zeros(2, 1, 128)])
    with pytest.raises(StageError, match="ValueError"):
        StageClient(stage.address).call({"op": "resize", "blocks": -1})
    client.resize(4)
    out = client.forward(StepSpec("prefill", ("q",), (0,), (3,)), torch.zeros(1, 3, 128), False)
    assert out.shape == (1, 3, 128)
    client.close()


def test_a_stage_that_dies_fails_the_step_not_the_engine(tiny, stages, engines, reference):
    stage = stages.start(tiny, 3, 4)
    engine = engines(tiny, remote_layers=[stage.address])
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.prefill("a")
    stage.proc.kill()
    stage.proc.wait()
    with pytest.raises(StageError):
        engine.decode(["a"])
    assert engine.requests["a"].computed == len(PROMPTS["a"])  # nothing half-applied here
    engine.release("a")  # releasing on a dead stage is not an error for the engine's state


def test_a_stage_refuses_a_range_the_model_does_not_have(tiny, stages):
    with pytest.raises(Exception, match="exited"):
        stages.start(tiny, 3, 9)


def test_an_in_process_stage_serves_the_loaders_host_copy(tiny_converted, engines, reference):
    """A node that holds the checkpoint in host memory (its DRAM tier, or blocks received by
    multicast) serves layers from a thread, viewing those bytes."""
    from services.node.loader import CheckpointLoader, LoaderSettings
    from services.node.engines.stage_server import LayerStage, StageServer

    loader = CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
    try:
        host = loader.host_checkpoint(tiny_converted)
        tensors = host.tensors(torch.device("cpu"))
        server = StageServer(LayerStage(tiny_converted, 1, 4, tensors=tensors))
        try:
            w = server.stage.layers[1].self_attn.q_proj.weight
            assert w.data_ptr() == tensors["model.layers.1.self_attn.q_proj.weight"].data_ptr()
            engine = engines(tiny_converted, remote_layers=[server.address])
            assert generate(engine) == reference
            engine.unload()
        finally:
            server.stop()
    finally:
        loader.close()
