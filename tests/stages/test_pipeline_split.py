"""Where a node receiving a model by multicast splits its instance while the blocks arrive
(services/node/pipeline_mode.py): it runs the head and layers 0..p-1 itself once every byte of
them is in, the rest on a helper; before it holds the head (or layer 0) it cannot serve."""

from __future__ import annotations

from types import SimpleNamespace

from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index
from services.node.pipeline_mode import _split
from shared.core.multicast import cut_blocks, head_first
from shared.core.pipeline import layer_index


def test_the_split_is_the_run_of_layers_from_0_behind_a_whole_head(tiny_converted):
    index = read_index(default_checkpoint_dir(tiny_converted))
    starts: dict[str, list[int]] = {}
    for t in index.tensors:
        starts.setdefault(t.file, []).append(t.offset)
    blocks = cut_blocks([(p.file, p.size) for p in index.partitions], starts, 16)
    manifest = SimpleNamespace(index=index, blocks=blocks)
    head = head_first(blocks, [(t.file, t.offset, t.offset + t.size) for t in index.tensors
                               if layer_index(t.name) is None])

    def blocks_of(layer: int) -> set[int]:
        return {b.index for b in blocks for t in index.tensors if layer_index(t.name) == layer
                and t.file == b.file and t.offset < b.end and b.start < t.offset + t.size}

    assert _split(manifest, set()) == 0
    assert _split(manifest, set(head)) == 0  # the head alone: no layer to run
    assert _split(manifest, set(head) | blocks_of(0)) >= 1
    assert _split(manifest, set(head) | blocks_of(0) | blocks_of(1)) >= 2
    assert _split(manifest, blocks_of(0)) == 0  # layers without the head: cannot be its head
    assert _split(manifest, set(range(16))) == 4  # everything: every layer here
