"""Execute-while-load on real processes (λScale §4.3): a node that has received part of a model
(its head and some layers) serves with a stage process holding the other layers; once all its
blocks are in, it switches to local execution without losing the requests in flight. Greedy
output equals a local instance's, for a request served wholly in the pipeline and for ones that
continue across the switch."""

from __future__ import annotations

import pytest
import torch

from services.node.engines.torch_engine import TorchEngine
from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index
from services.node.loader.loader import HostCheckpoint
from services.node.engines.stage_client import StageClient
from services.node.engines.weights import held_tensors, holding_of
from shared.core.multicast import cut_blocks
from shared.core.pipeline import (TensorSpan, layer_index, layers_held, pipeline_stages,
                                  remote_ranges, switch_ready)

from .conftest import GREEDY, PROMPTS, generate

pytestmark = pytest.mark.integration


class Receiving:
    """A node's host copy of the model while multicast blocks arrive: buffers of the checkpoint's
    partitions in which only the blocks received so far hold the model's bytes."""

    def __init__(self, model, blocks: int = 16) -> None:
        self.dir = default_checkpoint_dir(model)
        self.index = read_index(self.dir)
        starts: dict[str, list[int]] = {}
        for t in self.index.tensors:
            starts.setdefault(t.file, []).append(t.offset)
        self.blocks = cut_blocks([(p.file, p.size) for p in self.index.partitions], starts,
                                 blocks)
        self.spans = [TensorSpan(t.name, t.file, t.offset, t.offset + t.size)
                      for t in self.index.tensors]
        self.host = HostCheckpoint(self.index, {p.file: torch.zeros(p.size, dtype=torch.uint8)
                                                for p in self.index.partitions})
        self.held: set[int] = set()

    def receive(self, block_ids) -> None:
        for i in block_ids:
            b = self.blocks[i]
            data = (self.dir / b.file).read_bytes()[b.start:b.end]
            self.host.buffers[b.file][b.start:b.end] = torch.frombuffer(bytearray(data),
                                                                       dtype=torch.uint8)
            self.held.add(i)

    def holding(self, node: str):
        got = layers_held(self.spans, self.blocks, self.held, node)
        assert got == holding_of(self.index, self.blocks, self.held, node)
        return got

    def tensors(self, holding) -> dict[str, torch.Tensor]:
        """Views of the tensors the node holds whole (never a half-received one)."""
        out = held_tensors(self.host, holding)
        assert all(layer_index(n) in holding.layers or layer_index(n) is None for n in out)
        return out


def test_a_pipeline_serves_while_loading_and_switches_to_local(
        tiny_converted, stages, reference):
    node_a = Receiving(tiny_converted)
    # What each node holds part-way through a 2-way multicast: a has the checkpoint's first
    # blocks (head and layer 0) and the final norm, b the later ones (layers 1-3).
    node_a.receive([*range(0, 9), 15])
    node_b = Receiving(tiny_converted)
    node_b.receive(range(8, 16))
    hold_a, hold_b = node_a.holding("a"), node_b.holding("b")
    assert hold_a.head and hold_a.layers == {0} and hold_b.layers == {1, 2, 3}
    assert pipeline_stages([hold_b], 4) is None  # b alone lacks the head
    plan = pipeline_stages([hold_a, hold_b], 4)
    assert [(s.node, s.start, s.end) for s in plan] == [("a", 0, 1), ("b", 1, 4)]
    (remote,) = remote_ranges(plan, "a")
    stage = stages.start(tiny_converted, remote.start, remote.end)
    engine = TorchEngine(tiny_converted, remote_layers=[stage.address],
                         weights=node_a.tensors(hold_a))
    engine.load()
    try:
        # A request served wholly by the pipeline: the local instance's greedy output.
        assert generate(engine) == reference
        # Requests in flight across the switch.
        out: dict[str, list[int]] = {}
        for rid in ("a", "b"):
            engine.add_request(rid, PROMPTS[rid], GREEDY)
            out[rid] = [engine.prefill(rid).tokens[rid]]
        for step in range(24):
            if step == 6:
                node_a.receive(range(16))  # the rest of the blocks arrive
                hold = node_a.holding("a")
                assert switch_ready(hold, 4)
                engine.take_layers(1, 4, tensors=node_a.tensors(hold))
                assert engine.layout().remote == () and engine.layout().local == ((0, 4),)
                assert StageClient(stage.address).memory()["kv_used_blocks"] == 0
                stage.stop()
            if step == 8:
                engine.add_request("c", PROMPTS["c"], GREEDY)
                out["c"] = [engine.prefill("c").tokens["c"]]
            for rid, token in engine.decode(list(out)).tokens.items():
                out[rid].append(token)
        assert out == reference
    finally:
        engine.unload()
