"""Locality-driven startup (λScale §5, next to ServerlessLLM §6's q + n/b): how a new instance of a
model on a node gets its weights, and how long until it can run.

- **tier**: the node loads the checkpoint from the fastest of its own tiers that holds it
  (`evaluate.load_seconds`: q + n/b + the engine's start-up).
- **multicast**: nodes that hold the checkpoint in host memory (their DRAM tier) send it to this
  node in blocks over the binomial pipeline (`shared.core.multicast`, λScale §4.2); it lands in
  this node's DRAM tier, which the engine then loads from. Until it is there:
  setup + its step in the schedule the node workers run (`multicast.whole_steps`) x the step's
  time (`cost.multicast_step_s`); then n / b_dram + the engine's start-up.
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
  for a stage of the other layers) runs the layers it lacks, and every iteration pays the
  activation transfers between them (`cost.pipeline_profile`) until the copy is whole and
  the node switches to local execution. Until it serves: setup + the multicast steps until
  this node holds the head and a layer + the stage's start; it runs the layers it holds then
  and pays the hops between them and the helper's runs (`pipeline.holder_plan`, over the core's
  layout of the checkpoint: a receiver whose sub-group brings a middle run first pays four).
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
from dataclasses import dataclass, replace

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.cost import (budget_room, helper_bytes, hosted_layer_bytes, multicast_step_s,
                              pipeline_helper_loads, round_fits, stage_bytes)
from shared.core.evaluate import keeps_promises
from shared.core.multicast import head_first, whole_steps
from shared.core.perf_model import PerfModel, Profile
from shared.core.pipeline import head_spans, holder_serve, model_layout, receiver_plan
from shared.core.readiness import arrived_load_s, load_seconds
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
                       receivers: int, config: CoreConfig, position: int | None = None) -> float:
    """Seconds until `receiver`, the receiver at `position` (0-based, in joining order; None: the
    last) of a group of `receivers`, holds the model when `sources` send it: its step in the k-way
    schedule the node workers run (`multicast.whole_steps`: one binomial pipeline per source and
    its share of the receivers), each step over the slowest link among the sources and it (every
    node's link is its own figure)."""
    if not sources or receivers < 1:
        raise ValueError("need a source and a receiver")
    at = receivers - 1 if position is None else position
    if not 0 <= at < receivers:
        raise ValueError(f"position {position} is not one of {receivers} receivers")
    links = [n.storage.multicast_bytes_per_s for n in [*sources, receiver] if n.storage]
    k = len(sources)
    steps = whole_steps(k + receivers, k, config.multicast_blocks)[k + at]
    return config.multicast_setup_s + steps * multicast_step_s(
        model_bytes, config.multicast_blocks, min(links), config.multicast_step_latency_s)


def pipeline_helper(model: ModelSpec, sources: list[NodeView], perf: PerfModel | None = None,
                    config: CoreConfig | None = None,
                    now: float | None = None) -> NodeView | None:
    """The source with the most free memory, if it has room for the stage (`stage_bytes`) and
    the stage's share of its compute, on top of what its stages take already, leaves what it
    serves on time (`takes_load`: the stage runs every layer but one of every iteration of the
    new instance)."""
    need = stage_bytes(model)
    load = (model.layers - 1) / max(1, model.layers)
    config = config or CoreConfig()
    roomy = [n for n in sources if not n.draining and budget_room(n) >= need
             and takes_load(n, n.stage_load + load, perf, config, now)]
    return max(roomy, key=lambda n: (budget_room(n), n.node_id), default=None)


def takes_load(node: NodeView, load: float, perf: PerfModel | None, config: CoreConfig,
               now: float | None) -> bool:
    """May `node` host pipeline stages that take `load` of its compute (all it would host)?
    Its busy instances still fit one decode round each within their tightest TPOT
    (`cost.round_fits`) and, where the caller knows the time, the requests it already admitted
    still meet their deadlines, a waiting prefill included (`evaluate.keeps_promises`): a
    stage that takes 7/8 of a node makes each of its own iterations 8 times as long."""
    if not round_fits(node, load, perf, config):
        return False
    return perf is None or now is None or keeps_promises(node, node.instances, load, perf,
                                                         config, now)


def _pipelinable(model: ModelSpec, config: CoreConfig) -> bool:
    """Execute-while-load is on and the model's shape (layers, head, activations) is known."""
    return (config.enable_pipeline and model.layers > 1 and model.token_bytes > 0
            and 0 < model.head_bytes < model.weight_bytes)


def plan_pipeline(node: NodeView, model: ModelSpec, profile: Profile, sources: list[NodeView],
                  receivers: int, config: CoreConfig,
                  perf: PerfModel | None = None, position: int | None = None,
                  now: float | None = None) -> PipelineMode | None:
    """How the new instance would serve through a pipeline (None: it cannot: the model's shape
    is unknown, or no source has room for the stage and the compute for it)."""
    if not _pipelinable(model, config):
        return None
    helper = pipeline_helper(model, sources, perf, config, now)
    if helper is None:
        return None
    k = len(sources)
    at = receivers - 1 if position is None else position
    plan = holder_serve(model.weight_bytes, model.layers, model.head_bytes,
                        config.multicast_blocks, k + receivers, k, k + at)
    if plan is None:
        return None
    steps, hops = plan
    link = min(n.storage.multicast_bytes_per_s for n in [*sources, node])
    step_s = multicast_step_s(model.weight_bytes, config.multicast_blocks, link,
                              config.multicast_step_latency_s)
    serve = config.multicast_setup_s + steps * step_s + config.pipeline_setup_s \
        + profile.engine_init_s
    return PipelineMode(hops, config.pipeline_hop_latency_s, link, model.token_bytes, serve,
                        (helper.node_id,))


def receivers_in_order(model: ModelSpec, nodes: list[NodeView], exclude: str = "") -> list[NodeView]:
    """The nodes the model is on its way to, in the order they joined its multicast: a later
    joiner's arrival is estimated over a group as large or larger (`multicast_arrive_s`), so by
    arrival, then node id (the order the placer hands the destinations to the multicast)."""
    on_way = [n for n in nodes if n.node_id != exclude and n.storage is not None
              and model.name in n.storage.arriving]
    return sorted(on_way, key=lambda n: (n.storage.arriving[model.name], n.node_id))


def plan_receiver_pipeline(node: NodeView, model: ModelSpec, profile: Profile,
                           sources: list[NodeView], receivers: list[NodeView],
                           config: CoreConfig, perf: PerfModel | None = None,
                           now: float | None = None) -> PipelineMode | None:
    """How the new instance would serve with the receivers of its execution pipeline hosting the
    layers it lacks (`receiver_plan`: this node joins last, after `receivers`); None when that
    pipeline has no cover before its copy is whole (alone in it, or no room on the others). A
    receiver that could not take the ranges it is given (`takes_load`: its own busy instances'
    TPOT, its admitted requests' deadlines) hosts nothing: the plan is made again without it."""
    if not (config.enable_receiver_pipelines and _pipelinable(model, config)) or not receivers:
        return None
    k, order = len(sources), [*receivers, node]
    n = k + len(order)
    tensors, cut = model_layout(model.weight_bytes, model.layers, model.head_bytes,
                                config.multicast_blocks)
    room = {k + i: -1 if r.draining else budget_room(r) for i, r in enumerate(receivers)}
    name = {k + i: x.node_id for i, x in enumerate(order)}
    index = {x.node_id: k + i for i, x in enumerate(receivers)}
    while True:
        plan = receiver_plan(n, k, n - 1, tensors, cut, model.layers,
                             head_first(cut, head_spans(tensors)), room, hosted_layer_bytes(model))
        if plan.serve_step is None:
            return None
        ranges = tuple(HostedRange(name[int(s.node)], s.start, s.end) for s in plan.stages
                       if int(s.node) != n - 1)
        mode = PipelineMode(plan.hops, config.pipeline_hop_latency_s, 0.0, model.token_bytes,
                            0.0, tuple(dict.fromkeys(r.helper for r in ranges)), ranges=ranges)
        busy = _too_busy(model, mode, {x.node_id: x for x in receivers}, perf, config, now)
        if not busy:
            break
        if all(room[index[h]] < 0 for h in busy):
            return None  # (the plan ignored a refusal: never loop on it)
        room.update({index[h]: -1 for h in busy})  # it has no compute to spare: no room
    link = min(x.storage.multicast_bytes_per_s for x in [*sources, *order])
    step_s = multicast_step_s(model.weight_bytes, len(cut), link,
                              config.multicast_step_latency_s)
    serve = config.multicast_setup_s + plan.serve_step * step_s + config.pipeline_setup_s \
        + profile.engine_init_s
    return replace(mode, hop_bytes_per_s=link, until=serve)


def _too_busy(model: ModelSpec, mode: PipelineMode, nodes: dict[str, NodeView],
              perf: PerfModel | None, config: CoreConfig, now: float | None) -> list[str]:
    """The helpers of `mode` that cannot take the layers it gives them on top of the stages
    they run already (`takes_load`)."""
    loads = pipeline_helper_loads(model, mode)
    return [h for h in mode.helpers
            if not takes_load(nodes[h], nodes[h].stage_load + loads[h], perf, config, now)]


def choose_startup(node: NodeView, model: ModelSpec, profile: Profile, ctx: DecisionContext,
                   group: tuple[int, int] | None = None) -> StartupChoice:
    """The soonest of loading from the node's own tiers, receiving the model by multicast from
    the nodes of `ctx` that hold it, and serving through a pipeline while it arrives (module
    doc). A node that holds the model in its DRAM tier, or to which it is already on its way,
    loads it (`load_seconds` counts the arrival). The node joins the receivers on their way
    last; `group` = (position, receivers): it is the receiver at that position of a group of
    that many instead (a burst's instances, priced once the burst's group is known)."""
    nodes, config, perf = ctx.nodes, ctx.config, ctx.perf
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
    position, receivers = group if group is not None else (len(on_way), 1 + len(on_way))
    arrive = multicast_arrive_s(model.weight_bytes, sources, node, receivers, config, position)
    via = arrived_load_s(model, arrive, storage.bytes_per_s["dram"], profile)
    names = tuple(sorted(n.node_id for n in sources))
    modes = [plan_pipeline(node, model, profile, sources, receivers, config, perf, position,
                           ctx.now)]
    if group is None:  # receivers host for the newest only as it joins (`receiver_plan`)
        modes.append(plan_receiver_pipeline(node, model, profile, sources, on_way, config, perf,
                                            ctx.now))
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


def with_helper_stages(nodes: list[NodeView], model: ModelSpec,
                       choice: StartupChoice) -> list[NodeView]:
    """The views once the helpers of a pipelined startup hold their stages: a DRAM holder the
    stage of the layers the new instance lacks, a receiver its ranges' K/V (`helper_bytes`),
    each with the share of its compute the stage takes (`pipeline_helper_loads`). The next
    decision on these views must not count the same room, nor the same compute; a helper's own
    view shows the stage once it reserved it."""
    if choice.pipeline is None:
        return nodes
    need = helper_bytes(model, choice.pipeline)
    load = pipeline_helper_loads(model, choice.pipeline)
    return [replace(n, budget_bytes=n.budget_bytes + need[n.node_id],
                    stage_load=n.stage_load + load[n.node_id])
            if n.node_id in need else n for n in nodes]
