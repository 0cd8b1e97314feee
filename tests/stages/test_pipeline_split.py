"""Where a node receiving a model by multicast splits its instance while the blocks arrive
(services/node/pipeline_mode.py): once every byte of the head and of one layer is in, it runs the
layers it holds and a DRAM holder runs each run of layers it lacks; before it holds the head
and a layer it cannot serve."""

from __future__ import annotations

from types import SimpleNamespace

from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index
from services.node.pipeline_mode import _heads, _remote_runs
from shared.core.multicast import cut_blocks
from shared.core.pipeline import Holding, layer_index


def test_a_node_heads_once_it_holds_the_head_and_a_layer_and_the_holder_runs_the_rest(
        tiny_converted):
    index = read_index(default_checkpoint_dir(tiny_converted))
    starts: dict[str, list[int]] = {}
    for t in index.tensors:
        starts.setdefault(t.file, []).append(t.offset)
    blocks = cut_blocks([(p.file, p.size) for p in index.partitions], starts, 16)
    manifest = SimpleNamespace(index=index, blocks=blocks)
    head = {b.index for b in blocks for t in index.tensors if layer_index(t.name) is None
            and t.file == b.file and t.offset < b.end and b.start < t.offset + t.size}

    def blocks_of(layer: int) -> set[int]:
        return {b.index for b in blocks for t in index.tensors if layer_index(t.name) == layer
                and t.file == b.file and t.offset < b.end and b.start < t.offset + t.size}

    def remote(have: set[int]) -> list[tuple[int, int]]:
        holder = Holding("holder", frozenset(range(4)), True)  # a DRAM holder: every layer
        return [(s.start, s.end) for s in _remote_runs(manifest, have, "me", [holder], 4)]

    assert not _heads(manifest, set()) and not _heads(manifest, head)  # no layer to run
    assert not _heads(manifest, blocks_of(0))  # layers without the head: cannot head
    assert _heads(manifest, head | blocks_of(0)) and _heads(manifest, head | blocks_of(2))
    # The holder runs exactly the layers missing here, one stage per run of them.
    assert remote(head | blocks_of(0) | blocks_of(1)) == [(2, 4)]
    assert remote(head | blocks_of(2)) == [(0, 2), (3, 4)]
    assert remote(set(range(len(blocks)))) == []  # everything here: nothing elsewhere
    # Without the layers here and with no one else holding them: no cover yet.
    lacking = Holding("receiver", frozenset({3}), False)
    assert _remote_runs(manifest, head | blocks_of(0), "me", [lacking], 4) is None
