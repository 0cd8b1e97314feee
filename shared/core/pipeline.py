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
- `holder_plan`: a receiver whose missing layers a DRAM holder runs (it holds them all): it
  serves from the first step at which it holds the head and a layer, running the layers it
  holds then, the holder each gap; its hops follow from which layers its sub-group's order
  brought first (a middle run: four, the first or last layers: two).
- `switch_ready`: the head node switches to local execution once it holds every layer.
- `receiver_plan` (λScale Algorithm 2 among a multicast's destinations): the k-way orders give
  different receivers different parts of the model first, so the receivers of one execution
  pipeline (`execution_pipelines`) together hold every layer long before any of them holds the
  whole model. Each receiver heads its own instance (λScale's 2-D pipeline: one batch per node
  in flight) and the others of its pipeline host the layers it lacks; it serves from the first
  step at which such a cover exists (with every host's room for what it hosts), until its copy
  is whole. `model_layout` is the byte layout the plan assumes when the checkpoint's own is
  not at hand (the core's `ModelSpec`, the simulator's shapes).

The node workers carry the plans out (`services/node/engines/split.py`: the head's engine with
`remote_layers`, `take_layers` at the switch); the simulator times them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from shared.core.multicast import (Block, arrival_steps, cut_blocks, execution_pipelines,
                                   head_first, kway_schedule, subgroups)

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


def pipeline_stages(holdings: list[Holding], layers: int,
                    head_node: str | None = None) -> list[StageRange] | None:
    """Contiguous ranges covering 0..layers-1, in layer order, each on a node that holds it; the
    first node listed that holds the head and at least one layer is the head (the one with the
    most layers among those; `head_node`: that node, whose own instance it is). None when the
    pipeline cannot serve yet."""
    heads = [h for h in holdings if h.head and h.layers
             and (head_node is None or h.node == head_node)]
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


def transfer_hops(stages: list[StageRange], head: str) -> int:
    """Activation transfers per iteration: the head embeds, each range runs where it lies, the
    head samples; one transfer wherever consecutive steps are on different nodes."""
    path = [head, *(s.node for s in stages), head]
    return sum(a != b for a, b in zip(path, path[1:]))


def model_layout(weight_bytes: int, layers: int, head_bytes: int,
                 blocks: int) -> tuple[list[TensorSpan], list[Block]]:
    """A checkpoint as one partition: the embeddings (half the head's bytes), the decoder layers
    (equal sizes), the LM head and final norm (the other half), cut into blocks by the node
    workers' own `cut_blocks` (at tensor boundaries where near)."""
    if layers < 1 or not 0 <= head_bytes < weight_bytes:
        raise ValueError("need layers >= 1 and 0 <= head_bytes < weight_bytes")
    embed = head_bytes // 2
    per = (weight_bytes - head_bytes) // layers
    tensors = [TensorSpan("model.embed_tokens.weight", "p0", 0, embed)]
    tensors += [TensorSpan(f"model.layers.{i}.weight", "p0", embed + i * per,
                           embed + (i + 1) * per) for i in range(layers)]
    end = embed + layers * per
    tensors.append(TensorSpan("lm_head.weight", "p0", end, end + head_bytes - embed))
    total = end + head_bytes - embed
    return tensors, cut_blocks([("p0", total)], {"p0": [t.start for t in tensors]}, blocks)


def head_spans(tensors: list[TensorSpan]) -> list[tuple[str, int, int]]:
    """The (file, start, end) spans of what is not a decoder layer (`head_first`'s input)."""
    return [(t.file, t.start, t.end) for t in tensors if layer_index(t.name) is None]


@dataclass(frozen=True)
class ReceiverPlan:
    """How receiver `node` (a plan index) of a k -> n multicast serves before its copy is whole.
    `stages` name plan indices as strings (`StageRange.node`); `serve_step` is None when its
    pipeline finds no cover before the copy is whole (it then serves once it holds it all)."""

    node: int
    members: tuple[int, ...]  # its execution pipeline (Algorithm 2), itself included
    full_step: int  # steps after which it holds every block
    serve_step: int | None = None  # steps after which it serves through its pipeline
    stages: tuple[StageRange, ...] = ()
    hops: int = 0  # activation transfers per iteration while it serves through the pipeline

    def hosted(self) -> dict[int, int]:
        """Plan index -> layers that member hosts for this receiver's instance."""
        out: dict[int, int] = {}
        for s in self.stages:
            if int(s.node) != self.node:
                out[int(s.node)] = out.get(int(s.node), 0) + s.end - s.start
        return out


def receiver_plan(n: int, k: int, node: int, tensors: list[TensorSpan], cut: list[Block],
                  layers: int, first: tuple[int, ...] = (), room: dict[int, int] | None = None,
                  layer_bytes: int = 0) -> ReceiverPlan:
    """Receiver `node` of `kway_schedule(n, k, len(cut), first)` heading its own instance, its
    pipeline's other members hosting the layers it lacks (`pipeline_stages` with it as the head),
    from the first step at which they cover every layer. `room`: plan index -> bytes a member
    can still take (absent: unlimited); a member hosting r layers takes r x `layer_bytes` (a
    receiver's own instance holds the layers' weights already: hosting adds their K/V), so a
    member without room for its share is left out of the cover."""
    if not k <= node < n:
        raise ValueError(f"node {node} is not a receiver of a {k} -> {n} plan")
    got = arrival_steps(kway_schedule(n, k, len(cut), first))
    full = max(got[node].values()) + 1
    members = next(tuple(p) for p in execution_pipelines(subgroups(n, k)) if node in p)
    plan = ReceiverPlan(node, members, full)
    if len(members) < 2:
        return plan
    for step in sorted({s for m in members for s in got.get(m, {}).values() if s + 1 < full}):
        stages = _cover(members, node, got, step, tensors, cut, layers, room, layer_bytes)
        if stages is not None:
            return replace(plan, serve_step=step + 1, stages=tuple(stages),
                           hops=transfer_hops(stages, str(node)))
    return plan


def _cover(members: tuple[int, ...], node: int, got: dict[int, dict[int, int]], step: int,
           tensors: list[TensorSpan], cut: list[Block], layers: int, room: dict[int, int] | None,
           layer_bytes: int) -> list[StageRange] | None:
    """A cover with `node` as the head at `step`, leaving out members without room for their
    share (one at a time, the most overdrawn first, until every host fits or none is left)."""
    holdings = {m: layers_held(tensors, cut, {b for b, s in got.get(m, {}).items() if s <= step},
                               str(m)) for m in members}
    while True:
        stages = pipeline_stages(list(holdings.values()), layers, head_node=str(node))
        if stages is None or all(s.node == str(node) for s in stages):
            return None  # no cover yet, or it holds every layer itself (its copy is whole)
        use: dict[int, int] = {}
        for s in stages:
            if int(s.node) != node:
                use[int(s.node)] = use.get(int(s.node), 0) + s.end - s.start
        over = {m: r * layer_bytes - room[m] for m, r in use.items()
                if room is not None and m in room and r * layer_bytes > room[m]}
        if not over:
            return stages
        worst = max(over, key=lambda m: (over[m], m))
        holdings[worst] = Holding(str(worst), frozenset(), False)


@dataclass(frozen=True)
class HolderPlan:
    """How receiver `node` of a k -> n multicast serves with a DRAM holder running what it lacks."""

    serve_step: int  # steps after which it holds the head and a layer: it serves
    stages: tuple[StageRange, ...]  # its own runs (node "head") and the holder's ("holder")
    hops: int  # activation transfers per iteration until its copy is whole


HOLDER = "holder"
HEAD = "head"


def holder_plan(n: int, k: int, node: int, tensors: list[TensorSpan], cut: list[Block],
                layers: int) -> HolderPlan | None:
    """Receiver `node` of `kway_schedule(n, k, len(cut), head-first)` heading its instance with
    a DRAM holder hosting every run it lacks, formed as the node workers form it
    (services/node/pipeline_mode.py: at the first step it holds the head and a layer, with the
    layers it holds then). None when it holds every layer by then (nothing to pipeline)."""
    if not k <= node < n:
        raise ValueError(f"node {node} is not a receiver of a {k} -> {n} plan")
    got = arrival_steps(kway_schedule(n, k, len(cut), head_first(cut, head_spans(tensors))))[node]
    everything = Holding(HOLDER, frozenset(range(layers)), True)
    for step in sorted(set(got.values())):
        mine = layers_held(tensors, cut, {b for b, s in got.items() if s <= step}, HEAD)
        if mine.head and mine.layers:
            if len(mine.layers) == layers:
                return None
            stages = pipeline_stages([mine, everything], layers, head_node=HEAD)
            return HolderPlan(step + 1, tuple(stages), transfer_hops(stages, HEAD))
    return None


@functools.lru_cache(maxsize=1024)
def holder_serve(weight_bytes: int, layers: int, head_bytes: int, blocks: int, n: int,
                 k: int, node: int | None = None) -> tuple[int, int] | None:
    """(serve step, hops) of receiver `node` (None: the newest, n - 1) of a k -> n multicast
    served by a DRAM holder, over the core's layout of the checkpoint (`model_layout`);
    memoized, since a placement asks for the same few group shapes of one model again and
    again."""
    tensors, cut = model_layout(weight_bytes, layers, head_bytes, blocks)
    plan = holder_plan(n, k, n - 1 if node is None else node, tensors, cut, layers)
    return None if plan is None else (plan.serve_step, plan.hops)
