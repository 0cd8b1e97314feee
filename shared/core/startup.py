"""Locality-driven startup (λScale §5, next to ServerlessLLM §6's q + n/b): how a new instance of a
model on a node gets its weights, and how long until it can run.

- **tier**: the node loads the checkpoint from the fastest of its own tiers that holds it
  (`evaluate.load_seconds`: q + n/b + the engine's start-up).
- **multicast**: nodes that hold the checkpoint in host memory (their DRAM tier) send it to this
  node in blocks over the binomial pipeline (`shared.core.multicast`, λScale §4.2); it lands in
  this node's DRAM tier, which the engine then loads from. Until it is there:
  setup + `multicast_seconds(n, blocks, group, link)`; then n / b_dram + the engine's start-up.
  With s sources the receivers split into s sub-groups (k-way transfer), each one binomial
  pipeline of its source and its share of the receivers.

A node can receive only with a multicast endpoint and a DRAM tier (its `StorageView` reports a
link bandwidth, declared or measured); a node can send when its DRAM tier holds the model. The
estimate counts the receivers already on their way (`StorageView.arriving`), so the nodes of one
burst are estimated as one group, the way the placer then sends them the model: one multicast.

- **pipeline** (execute-while-load, λScale §4.3): the model comes by multicast as above, but
  the instance serves before its copy is whole: once this node holds the head (embeddings,
  final norm, LM head: the multicast sends their blocks first, `multicast.head_first`) and one
  layer, a *helper* (a node holding the model in its DRAM tier: a multicast source with room
  for a stage of the other layers) runs the layers it lacks, and every iteration pays two
  activation transfers (`modules.pipeline_profile`) until the copy is whole and the node
  switches to local execution. Until it serves: setup + the multicast steps until this node's
  first blocks are in (`pipeline_serve_steps`, from the k-way schedule) + the stage's start.
  It is chosen when it serves sooner than the whole copy or the node's own tiers would; the
  admission then validates the request against the pipeline's slower profile.
  With `enable_receiver_pipelines` the helpers may also be the other receivers of the burst
  (λScale Algorithm 2, `plan_receiver_pipeline`): the k-way orders give each sub-group's
  receivers a different part of the model first, so this node and the receivers of its
  execution pipeline that joined before it hold every layer between them long before any holds
  the whole model; they host the layers it lacks (each at the cost of those layers' K/V: its
  own instance holds their weights already), hops as the ranges alternate. The sooner of the
  two pipelines is chosen.

Pure: views and numbers in, a `StartupChoice` out; the placer carries a multicast choice out
(`services/placer`), the node waits for the arrival before its load (`services/node/memops.py`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from shared.core.config import CoreConfig
from shared.core.evaluate import load_seconds
from shared.core.modules import share_spec
from shared.core.multicast import (arrival_steps, head_first, kway_orders, kway_schedule,
                                   multicast_seconds)
from shared.core.perf_model import Profile
from shared.core.pipeline import head_spans, model_layout, receiver_plan
from shared.core.types import HostedRange, ModelSpec, NodeView, PipelineMode


class StartupMethod(str, enum.Enum):
    TIER = "tier"  # load from the node's own fastest tier (or ride a multicast already coming)
    MULTICAST = "multicast"  # receive it by a new multicast into the DRAM tier, then load
    PIPELINE = "pipeline"  # receive it by multicast, serving through a pipeline meanwhile


@dataclass(frozen=True)
class StartupChoice:
    method: StartupMethod
    load_s: float  # until the weights are in: the cold start's TTFT grace (§IX-A)
    tier_s: float  # what loading from the node's own tiers takes (for the record)
    arrive_s: float = 0.0  # MULTICAST, PIPELINE: until the checkpoint is in the node's DRAM tier
    sources: tuple[str, ...] = ()  # MULTICAST, PIPELINE: the nodes that send it
    # PIPELINE: how it serves until its copy is whole (`until`: seconds until it serves, = load_s)
    pipeline: PipelineMode | None = None


def can_receive(node: NodeView) -> bool:
    """The node runs a multicast endpoint and has a DRAM tier to receive into."""
    s = node.storage
    return s is not None and s.multicast_bytes_per_s > 0 and s.bytes_per_s.get("dram", 0) > 0


def multicast_sources(model: ModelSpec, nodes: list[NodeView], exclude: str = "") -> list[NodeView]:
    """Nodes that can send `model`: its checkpoint in their DRAM tier, an endpoint to send from."""
    return [n for n in nodes if n.node_id != exclude and n.storage is not None
            and n.storage.holds.get(model.name) == "dram" and n.storage.multicast_bytes_per_s > 0]


def multicast_arrive_s(model_bytes: int, sources: list[NodeView], receiver: NodeView,
                       receivers: int, config: CoreConfig) -> float:
    """Seconds until `receivers` nodes (this one among them) hold the model when `sources` send
    it: the receivers split evenly into one sub-group per source (k-way), each a binomial
    pipeline over the slowest link among its nodes (every node's link is its own figure)."""
    if not sources or receivers < 1:
        raise ValueError("need a source and a receiver")
    links = [n.storage.multicast_bytes_per_s for n in [*sources, receiver] if n.storage]
    link = min(links)
    group = math.ceil(receivers / len(sources)) + 1  # a source and its share of receivers
    return config.multicast_setup_s + multicast_seconds(
        model_bytes, config.multicast_blocks, group, link, config.multicast_step_latency_s)


def head_blocks(model: ModelSpec, blocks: int) -> int:
    """Blocks a receiver needs before it can head a pipeline, counted in a head-first order: the
    head's (its final norm lies apart from the embeddings and the LM head: one more block), then
    one layer's (one more where the layer straddles a cut)."""
    block = model.weight_bytes / blocks
    layer = (model.weight_bytes - model.head_bytes) / model.layers
    return min(blocks, math.ceil(model.head_bytes / block) + 1 + math.ceil(layer / block) + 1)


def pipeline_serve_steps(sources: int, receivers: int, blocks: int, need: int) -> int:
    """Steps of a k-way multicast (k = `sources`, head-first order) until the newest of
    `receivers` (node k + receivers - 1 of the plan, the way a burst's nodes join it) holds the
    first `need` blocks of its sub-group's order."""
    if sources < 1 or receivers < 1 or not 1 <= need <= blocks:
        raise ValueError("need a source, a receiver and 1 <= need <= blocks")
    first = tuple(range(need))  # which blocks does not matter here, only how many go first
    node = sources + receivers - 1
    order = kway_orders(blocks, sources, first)[(node - sources) % sources]
    got = arrival_steps(kway_schedule(sources + receivers, sources, blocks, first))[node]
    return max(got[b] for b in order[:need]) + 1


def stage_bytes(model: ModelSpec) -> int:
    """What a helper's stage may hold at most: every layer but one with their K/V for a full
    context (the head node holds at least one layer when the pipeline starts)."""
    remote = model.layers - 1
    weights = share_spec(model, remote, model.layers, model.head_bytes, head=False).weight_bytes
    return weights + model.kv_bytes_per_token * remote // model.layers * model.max_context


def pipeline_helper(model: ModelSpec, sources: list[NodeView]) -> NodeView | None:
    """The source with the most free memory, if it has room for the stage (`stage_bytes`)."""
    need = stage_bytes(model)
    roomy = [n for n in sources if not n.draining and n.memory_bytes - n.budget_bytes >= need]
    return max(roomy, key=lambda n: (n.memory_bytes - n.budget_bytes, n.node_id), default=None)


def _pipelinable(model: ModelSpec, config: CoreConfig) -> bool:
    """Execute-while-load is on and the model's shape (layers, head, activations) is known."""
    return (config.enable_pipeline and model.layers > 1 and model.token_bytes > 0
            and 0 < model.head_bytes < model.weight_bytes)


def plan_pipeline(node: NodeView, model: ModelSpec, profile: Profile, sources: list[NodeView],
                  receivers: int, config: CoreConfig) -> PipelineMode | None:
    """How the new instance would serve through a pipeline (None: it cannot: the model's shape
    is unknown, or no source has room for the stage)."""
    if not _pipelinable(model, config):
        return None
    helper = pipeline_helper(model, sources)
    if helper is None:
        return None
    blocks = config.multicast_blocks
    link = min(n.storage.multicast_bytes_per_s for n in [*sources, node])
    steps = pipeline_serve_steps(len(sources), receivers, blocks, head_blocks(model, blocks))
    step_s = model.weight_bytes / blocks / link + config.multicast_step_latency_s
    serve = config.multicast_setup_s + steps * step_s + config.pipeline_setup_s \
        + profile.engine_init_s
    return PipelineMode(2, config.pipeline_hop_latency_s, link, model.token_bytes, serve,
                        (helper.node_id,))


def hosted_layer_bytes(model: ModelSpec) -> int:
    """What hosting one layer for another receiver's instance adds on a receiver: that layer's
    K/V for a full context (its own instance holds the layer's weights already)."""
    return model.kv_bytes_per_token // max(1, model.layers) * model.max_context


def helper_bytes(model: ModelSpec, mode: PipelineMode) -> dict[str, int]:
    """What each helper of `mode` holds for the instance: a DRAM holder the stage of every layer
    it lacks (`stage_bytes`), a receiver its ranges' K/V (`hosted_layer_bytes`)."""
    if not mode.ranges:
        return {h: stage_bytes(model) for h in mode.helpers}
    out: dict[str, int] = {}
    for r in mode.ranges:
        out[r.helper] = out.get(r.helper, 0) + (r.end - r.start) * hosted_layer_bytes(model)
    return out


def receivers_in_order(model: ModelSpec, nodes: list[NodeView], exclude: str = "") -> list[NodeView]:
    """The nodes the model is on its way to, in the order they joined its multicast: a later
    joiner's arrival is estimated over a group as large or larger (`multicast_arrive_s`), so by
    arrival, then node id (the order the placer hands the destinations to the multicast)."""
    on_way = [n for n in nodes if n.node_id != exclude and n.storage is not None
              and model.name in n.storage.arriving]
    return sorted(on_way, key=lambda n: (n.storage.arriving[model.name], n.node_id))


def plan_receiver_pipeline(node: NodeView, model: ModelSpec, profile: Profile,
                           sources: list[NodeView], receivers: list[NodeView],
                           config: CoreConfig) -> PipelineMode | None:
    """How the new instance would serve with the receivers of its execution pipeline hosting the
    layers it lacks (`receiver_plan`: this node joins last, after `receivers`); None when that
    pipeline has no cover before its copy is whole (alone in it, or no room on the others)."""
    if not (config.enable_receiver_pipelines and _pipelinable(model, config)) or not receivers:
        return None
    k, order = len(sources), [*receivers, node]
    n = k + len(order)
    tensors, cut = model_layout(model.weight_bytes, model.layers, model.head_bytes,
                                config.multicast_blocks)
    room = {k + i: -1 if r.draining else r.memory_bytes - r.budget_bytes
            for i, r in enumerate(receivers)}
    plan = receiver_plan(n, k, n - 1, tensors, cut, model.layers,
                         head_first(cut, head_spans(tensors)), room, hosted_layer_bytes(model))
    if plan.serve_step is None:
        return None
    link = min(x.storage.multicast_bytes_per_s for x in [*sources, *order])
    step_s = model.weight_bytes / len(cut) / link + config.multicast_step_latency_s
    serve = config.multicast_setup_s + plan.serve_step * step_s + config.pipeline_setup_s \
        + profile.engine_init_s
    name = {k + i: x.node_id for i, x in enumerate(order)}
    ranges = tuple(HostedRange(name[int(s.node)], s.start, s.end) for s in plan.stages
                   if int(s.node) != n - 1)
    helpers = tuple(dict.fromkeys(r.helper for r in ranges))
    return PipelineMode(plan.hops, config.pipeline_hop_latency_s, link, model.token_bytes, serve,
                        helpers, ranges=ranges)


def choose_startup(node: NodeView, model: ModelSpec, profile: Profile, nodes: list[NodeView],
                   config: CoreConfig) -> StartupChoice:
    """The soonest of loading from the node's own tiers, receiving the model by multicast from
    the nodes of `nodes` that hold it, and serving through a pipeline while it arrives (module
    doc). A node that holds the model in its DRAM tier, or to which it is already on its way,
    loads it (`load_seconds` counts the arrival)."""
    tier = load_seconds(node, model, profile)
    keep = StartupChoice(StartupMethod.TIER, tier, tier)
    storage = node.storage
    if not (config.enable_multicast and model.tiered and can_receive(node)) \
            or storage.holds.get(model.name) == "dram" or model.name in storage.arriving:
        return keep
    sources = multicast_sources(model, nodes, exclude=node.node_id)
    if not sources:
        return keep
    on_way = receivers_in_order(model, nodes, exclude=node.node_id)  # the group it joins
    receivers = 1 + len(on_way)
    arrive = multicast_arrive_s(model.weight_bytes, sources, node, receivers, config)
    via = arrive + model.weight_bytes / storage.bytes_per_s["dram"] + profile.engine_init_s
    names = tuple(sorted(n.node_id for n in sources))
    modes = [plan_pipeline(node, model, profile, sources, receivers, config),
             plan_receiver_pipeline(node, model, profile, sources, on_way, config)]
    mode = min((m for m in modes if m is not None), key=lambda m: m.until, default=None)
    if mode is not None and mode.until < min(via, tier):
        return StartupChoice(StartupMethod.PIPELINE, mode.until, tier, arrive, names, mode)
    if via >= tier and not config.force_multicast:
        return keep
    return StartupChoice(StartupMethod.MULTICAST, via, tier, arrive, names)


def with_arrival(node: NodeView, model: str, arrive_s: float,
                 pipeline: PipelineMode | None = None) -> NodeView:
    """The node's view once a multicast of `model` to it is under way (lands in `arrive_s`);
    with `pipeline`, a new instance of it there serves through that pipeline meanwhile."""
    storage = node.storage
    if storage is None:
        raise ValueError(f"node {node.node_id} reports no tiers to receive into")
    pipes = storage.pipelines if pipeline is None else {**storage.pipelines, model: pipeline}
    return replace(node, storage=replace(storage, arriving={**storage.arriving, model: arrive_s},
                                         pipelines=pipes))


def with_startup(node: NodeView, model: str, choice: StartupChoice) -> NodeView:
    """The node's view with `choice` under way (unchanged for a load from its own tiers)."""
    if choice.method is StartupMethod.TIER:
        return node
    return with_arrival(node, model, choice.arrive_s, choice.pipeline)
