"""Execute-while-load (λScale §4.3), as plans: which decoder layers a node can run from the
multicast blocks it holds so far, and how nodes that together hold every layer split an
instance's layers into a pipeline.

- `layers_held`: a layer is runnable on a node once every byte of every tensor of it lies in
  blocks the node holds (a block is a byte range of one partition, `shared.core.multicast.Block`);
  the *head* (embeddings, final norm, LM head: what is not a decoder layer) likewise.
- `pipeline_stages`: given what each node of a pipeline (`execution_pipelines`) holds, an ordered
  cover of layers 0..L-1 by contiguous ranges, one node per range: the head node (it holds the
  head, and runs the embeddings, the sampling and every layer it holds) first chooses its own
  runs, the gaps go to the node holding the longest run from the gap's start. None while no
  such cover exists (the pipeline waits for more blocks).
- `switch_ready`: the head node switches to local execution once it holds every layer.

The node workers carry the plans out (`services/node/stages.py`: the head's engine with
`remote_layers`, `take_layers` at the switch); the simulator times them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.core.multicast import Block

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpan:
    name: str
    file: str  # partition
    start: int  # byte offset in the partition
    end: int


@dataclass(frozen=True)
class Holding:
    """What one node can run now."""

    node: str
    layers: frozenset[int]
    head: bool


@dataclass(frozen=True)
class StageRange:
    node: str
    start: int
    end: int  # exclusive


def layer_index(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def layers_held(tensors: list[TensorSpan], blocks: list[Block], held: set[int],
                node: str = "") -> Holding:
    """The layers (and whether the head) whose every tensor byte is in the `held` blocks."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for b in blocks:
        if b.index in held:
            ranges.setdefault(b.file, []).append((b.start, b.end))
    covered = {f: _merge(r) for f, r in ranges.items()}
    complete: dict[int | None, bool] = {}
    for t in tensors:
        key = layer_index(t.name)
        ok = _inside(covered.get(t.file, []), t.start, t.end)
        complete[key] = complete.get(key, True) and ok
    layers = frozenset(k for k, ok in complete.items() if k is not None and ok)
    return Holding(node, layers, complete.get(None, True))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _inside(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return end <= start or any(a <= start and end <= b for a, b in ranges)


def pipeline_stages(holdings: list[Holding], layers: int) -> list[StageRange] | None:
    """Contiguous ranges covering 0..layers-1, in layer order, each on a node that holds it; the
    first node listed that holds the head and at least one layer is the head (the one with the
    most layers among those). None when the pipeline cannot serve yet."""
    heads = [h for h in holdings if h.head and h.layers]
    if not heads:
        return None
    head = max(heads, key=lambda h: len(h.layers))
    out: list[StageRange] = []
    i = 0
    while i < layers:
        if i in head.layers:
            j = i
            while j < layers and j in head.layers:
                j += 1
            out.append(StageRange(head.node, i, j))
            i = j
            continue
        best, best_end = None, i
        for h in holdings:
            if h is head:
                continue
            j = i
            while j < layers and j in h.layers and j not in head.layers:
                j += 1
            if j > best_end:
                best, best_end = h, j
        if best is None:
            return None
        out.append(StageRange(best.node, i, best_end))
        i = best_end
    return _join(out)


def _join(ranges: list[StageRange]) -> list[StageRange]:
    out: list[StageRange] = []
    for r in ranges:
        if out and out[-1].node == r.node and out[-1].end == r.start:
            out[-1] = StageRange(r.node, out[-1].start, r.end)
        else:
            out.append(r)
    return out


def switch_ready(holding: Holding, layers: int) -> bool:
    """The node holds the whole model: its instance runs every layer itself (mode switch)."""
    return holding.head and len(holding.layers) == layers


def remote_ranges(stages: list[StageRange], head: str) -> list[StageRange]:
    """The ranges the head node's instance runs elsewhere (its stages to start and attach)."""
    return [s for s in stages if s.node != head]
