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

Pure: views and numbers in, a `StartupChoice` out; the placer carries a multicast choice out
(`services/placer`), the node waits for the arrival before its load (`services/node/worker.py`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from shared.core.config import CoreConfig
from shared.core.evaluate import load_seconds
from shared.core.multicast import multicast_seconds
from shared.core.perf_model import Profile
from shared.core.types import ModelSpec, NodeView


class StartupMethod(str, enum.Enum):
    TIER = "tier"  # load from the node's own fastest tier (or ride a multicast already coming)
    MULTICAST = "multicast"  # receive it by a new multicast into the DRAM tier, then load


@dataclass(frozen=True)
class StartupChoice:
    method: StartupMethod
    load_s: float  # until the weights are in: the cold start's TTFT grace (§IX-A)
    tier_s: float  # what loading from the node's own tiers takes (for the record)
    arrive_s: float = 0.0  # MULTICAST: until the checkpoint is in the node's DRAM tier
    sources: tuple[str, ...] = ()  # MULTICAST: the nodes that send it


def can_receive(node: NodeView) -> bool:
    """The node runs a multicast endpoint and has a DRAM tier to receive into."""
    s = node.storage
    return s is not None and s.multicast_bytes_per_s > 0 and s.bytes_per_s.get("dram", 0) > 0


def multicast_sources(model: ModelSpec, nodes: list[NodeView], exclude: str = "") -> list[NodeView]:
    """Nodes that can send `model`: its checkpoint in their DRAM tier, an endpoint to send from."""
    return [n for n in nodes if n.node_id != exclude and n.storage is not None
            and n.storage.holds.get(model.name) == "dram" and n.storage.multicast_bytes_per_s > 0]


def receivers_on_the_way(model: ModelSpec, nodes: list[NodeView], exclude: str = "") -> int:
    """Nodes the model is being multicast to now (their views say it is arriving)."""
    return sum(1 for n in nodes if n.node_id != exclude and n.storage is not None
               and model.name in n.storage.arriving)


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


def choose_startup(node: NodeView, model: ModelSpec, profile: Profile, nodes: list[NodeView],
                   config: CoreConfig) -> StartupChoice:
    """The quicker of loading from the node's own tiers and receiving the model by multicast
    from the nodes of `nodes` that hold it (module doc). A node that holds the model in its DRAM
    tier, or to which it is already on its way, loads it (`load_seconds` counts the arrival)."""
    tier = load_seconds(node, model, profile)
    keep = StartupChoice(StartupMethod.TIER, tier, tier)
    storage = node.storage
    if not (config.enable_multicast and model.tiered and can_receive(node)) \
            or storage.holds.get(model.name) == "dram" or model.name in storage.arriving:
        return keep
    sources = multicast_sources(model, nodes, exclude=node.node_id)
    if not sources:
        return keep
    receivers = 1 + receivers_on_the_way(model, nodes, exclude=node.node_id)
    arrive = multicast_arrive_s(model.weight_bytes, sources, node, receivers, config)
    via = arrive + model.weight_bytes / storage.bytes_per_s["dram"] + profile.engine_init_s
    if via >= tier and not config.force_multicast:
        return keep
    return StartupChoice(StartupMethod.MULTICAST, via, tier, arrive,
                         tuple(sorted(n.node_id for n in sources)))


def with_arrival(node: NodeView, model: str, arrive_s: float) -> NodeView:
    """The node's view once a multicast of `model` to it is under way (lands in `arrive_s`)."""
    storage = node.storage
    if storage is None:
        raise ValueError(f"node {node.node_id} reports no tiers to receive into")
    return replace(node, storage=replace(storage, arriving={**storage.arriving, model: arrive_s}))
