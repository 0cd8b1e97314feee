"""λScale in the simulator: model multicast between nodes and execute-while-load (λScale §4-5),
timed by the core's plans (`shared.core.multicast`). Used by SLINFER and by the baselines alike,
so "sllm with multicast" is λScale's setting (exclusive GPUs, instance-level scaling) and plain
"sllm" is its ServerlessLLM baseline (every node loads from its own tier).

What is modelled
- Locality-driven startup (§5): a node starting an instance takes the sooner of its own tier
  (`sim/storage.py`: DRAM / disk / registry) and receiving the model by multicast from the nodes
  that hold it: a node with an instance of it that is fully loaded, or with it in its DRAM tier
  (λScale's GPU and host-memory holders). Up to `max_sources` holders send (k-way, Algorithm 1).
  The core sees the choice: the node's `StorageView` reports the model in a "multicast" tier
  whose bandwidth gives that startup, so the placer's startup estimate (q + n/b) and a cold
  start's TTFT grace are the multicast's.
- Loads of one model that start while its sources still inject blocks (the first `blocks` steps
  of the session) join that multicast: N = k sources + n destinations, `kway_schedule(N, k, b)`;
  the j-th destination is node k + j of the plan and holds the whole model when the plan's last
  block reaches it, but never sooner than `blocks` steps after it joined (one block in per step).
  A later load starts a new session from the holders of that time.
- A step moves one block per link: block bytes / link bandwidth + a per-step latency (the step of
  `multicast_seconds`). A node's link carries one multicast at a time: a source is busy for its
  session's injection phase, a destination until it holds the model.
- Execute-while-load (§4.3): the core's receiver plan (`shared.core.pipeline.receiver_plan`,
  the same the placer's startup estimate uses): the blocks travel head-first in each sub-group's
  k-way order, the destinations form execution pipelines (`execution_pipelines`, Algorithm 2),
  and a destination's instance serves (the core sees the load done then) from the first step at
  which it holds the embeddings, the LM head and a layer and the destinations of its pipeline
  that joined before it hold the layers it lacks (`layers_held`: every byte of a layer's tensors
  in held blocks, the blocks cut by `cut_blocks` from the checkpoint's layout;
  `pipeline_stages` with it as the head). Each iteration costs the local compute (the stages
  compute their layers in turn) plus the plan's activation transfers (one wherever consecutive
  ranges lie on different nodes, the last returning to the head): tokens x hidden x 2 bytes over
  the link plus the step latency. With as many batches in flight as the pipeline has nodes
  (λScale's 2-D pipeline, Fig. 6a) each node computes its share of the layers of every batch, so
  each destination serving its own batch at that cost is the pipeline's throughput. The K/V a
  destination holds for another's layers is not charged to its memory here (the core's plan
  takes a `room`; the simulator's nodes do not report it to the multicaster).
- Mode switch (§4.4): once the node holds the whole model, its next iteration first rebuilds its
  requests' KV cache locally, the cheaper of recomputing it (the profile's a*tokens+b line) and
  pulling the share of it the other pipeline nodes hold (their layers') over the link.

Not modelled: contention between multicasts of different models beyond "one at a time per link",
λScale's staircase stalls (Fig. 9), GPU-direct vs host-memory paths, the core's I/O-queue term
(q) for a multicast load (the core still adds the node's disk queue: conservative).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from shared.core.config import CoreConfig
from shared.core.cost import HopCost, multicast_step_s
from shared.core.multicast import DEFAULT_BLOCKS, Block, arrival_steps, head_first, kway_schedule
from shared.core.perf_model import Profile
from shared.core.pipeline import ReceiverPlan, TensorSpan, head_spans, model_layout, receiver_plan
from shared.core.types import StorageView

STEP_LATENCY_S = 50e-6  # one RDMA round trip and block bookkeeping per step (bench/scaleout.py)
MAX_SOURCES = 4  # λScale evaluates k in {1, 2, 4}
ACTIVATION_BYTES = 2  # 16-bit activations
MULTICAST_TIER = "multicast"  # the pseudo-tier a node reports for a model it would receive
VOCAB = 32000  # Llama-2's vocabulary: the embeddings and the LM head are the model's "head"


@dataclass(frozen=True)
class ScaleoutConfig:
    link_gbps: float  # every node's link, Gb/s
    blocks: int = DEFAULT_BLOCKS  # λScale §7.6: 16 blocks gave the lowest transfer time
    step_latency_s: float = STEP_LATENCY_S
    max_sources: int = MAX_SOURCES
    execute_while_load: bool = True

    def __post_init__(self) -> None:
        if not self.link_gbps > 0:
            raise ValueError("link_gbps must be > 0")
        if self.blocks < 1 or self.max_sources < 1:
            raise ValueError("blocks and max_sources must be >= 1")
        if self.step_latency_s < 0:
            raise ValueError("step_latency_s must be >= 0")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8

    def step_s(self, model_bytes: int) -> float:
        return multicast_step_s(model_bytes, self.blocks, self.link_bytes_per_s,
                                self.step_latency_s)

    def hop_s(self, tokens: int, hidden: int) -> float:
        """One activation transfer between pipeline nodes."""
        return HopCost(self.step_latency_s, self.link_bytes_per_s,
                       hidden * ACTIVATION_BYTES).seconds(tokens)


@dataclass(frozen=True)
class Shape:
    """What decides which layers a set of blocks holds: the checkpoint's byte layout."""

    weight_bytes: int
    layers: int
    hidden: int


def layout(shape: Shape, blocks: int) -> tuple[list[TensorSpan], list[Block]]:
    """The checkpoint as the core lays it out (`shared.core.pipeline.model_layout`): the
    embeddings, the decoder layers (equal sizes), the LM head, cut at tensor boundaries."""
    head = min(VOCAB * shape.hidden * 2, shape.weight_bytes // 4)
    return model_layout(shape.weight_bytes, shape.layers, 2 * head, blocks)


@dataclass(frozen=True)
class PlanTimes:
    """Per destination of a k -> N plan: the step after which it holds every block, and (with a
    shape) how it serves meanwhile (`shared.core.pipeline.receiver_plan`: its execution
    pipeline among the plan's destinations, the step its cover exists, its hops)."""

    full: dict[int, int]
    plans: dict[int, ReceiverPlan]


@functools.lru_cache(maxsize=1024)
def plan_times(n: int, k: int, blocks: int, shape: Shape | None = None) -> PlanTimes:
    """`shape` given: the blocks travel head-first (what the node workers send when a receiver
    may serve through a pipeline, `multicast.head_first`; the number of steps does not change)
    and every destination's receiver plan is the core's; without it, only the full times."""
    if shape is None:
        got = arrival_steps(kway_schedule(n, k, blocks))
        return PlanTimes({node: max(s.values()) + 1 for node, s in got.items()}, {})
    tensors, cut = layout(shape, blocks)
    first = head_first(cut, head_spans(tensors))
    plans = {node: receiver_plan(n, k, node, tensors, cut, shape.layers, first)
             for node in range(k, n)}
    return PlanTimes({node: p.full_step for node, p in plans.items()}, plans)


@dataclass(frozen=True)
class Startup:
    """How a new instance would get its weights by multicast, in seconds from now."""

    ready_s: float  # until it can serve: in its pipeline, or locally
    full_s: float  # until it holds the whole model (== ready_s without execute-while-load)
    hops: int = 0  # activation transfers per iteration before full_s (0: serves locally only)
    remote: float = 0.0  # the share of its layers the other receivers run meanwhile


@dataclass(frozen=True)
class Load:
    """One load the multicaster saw (for the benchmarks' account of how a spike scaled out)."""

    at: float
    model: str
    node: str
    how: str  # the node's own tier, "multicast" or "pipeline"
    ready_s: float
    sources: int = 0  # multicast: the session's sources (k)
    dests: int = 0  # multicast: its destinations so far, this one included


@dataclass
class _Session:
    model: str
    start: float
    sources: tuple[str, ...]
    step_s: float
    inject_until: float  # the sources send new blocks until then; later loads start afresh
    dests: list[str] = field(default_factory=list)


@dataclass
class _Mode:
    until: float  # when the node holds the whole model (the mode switch)
    hops: int
    remote: float  # the share of its layers (and so of its K/V) run elsewhere until then


class Multicaster:
    """The cluster's multicasts: sessions per model, link occupancy, instances in pipeline mode."""

    def __init__(self, config: ScaleoutConfig, hidden: dict[str, int],
                 shapes: dict[str, Shape] | None = None) -> None:
        self.config = config
        self.hidden = hidden  # model -> hidden size (activation bytes per token / 2)
        # model -> its checkpoint's shape: pipelines are `shared.core.pipeline`'s stage covers
        # (without one: a pipeline serves once its nodes hold every block between them)
        self.shapes = shapes or {}
        self.sessions: dict[str, _Session] = {}
        self.link_free: dict[str, float] = {}  # node -> when its link is free
        self.arriving: dict[tuple[str, str], float] = {}  # (node, model) -> when it has it all
        self.modes: dict[str, _Mode] = {}  # instance id -> serving in a pipeline until
        self.loads: list[Load] = []  # every load started through `start_load`, in order

    # --- startup ------------------------------------------------------------------------------
    def holds(self, node: str, model: str, now: float) -> bool:
        """False while a load of the model into the node's DRAM tier is still under way."""
        return self.arriving.get((node, model), 0.0) <= now

    def is_holder(self, node: str, model: str, ready_instances: list[str], in_dram: bool,
                  now: float) -> bool:
        """Can the node send the model: an instance of it that is loaded (not still serving in
        a pipeline while its blocks arrive), or a copy in its DRAM tier that is not arriving."""
        if any(not self.in_pipeline(iid, now) for iid in ready_instances):
            return True
        return in_dram and self.holds(node, model, now)

    def _joinable(self, model: str, dest: str, now: float) -> _Session | None:
        s = self.sessions.get(model)
        if s is None or now >= s.inject_until or dest in s.dests or dest in s.sources:
            return None
        return s

    def _plan(self, model: str, nbytes: int, dest: str, holders: list[str],
              now: float) -> tuple[Startup, _Session, bool] | None:
        """The startup of `model` on `dest` by multicast now, with the session it would use
        (and whether that session is new); None when no other node holds the model."""
        session = self._joinable(model, dest, now)
        new = session is None
        if new:
            ready = sorted((self.link_free.get(h, 0.0), h) for h in set(holders) if h != dest)
            sources = tuple(h for _, h in ready[:self.config.max_sources])
            if not sources:
                return None
            start = max([now, *(self.link_free.get(h, 0.0) for h in sources)])
            step = self.config.step_s(nbytes)
            session = _Session(model, start, sources, step, start + self.config.blocks * step)
        k = len(session.sources)
        j = k + len(session.dests)  # this destination's node index in the plan
        times = plan_times(j + 1, k, self.config.blocks, self.shapes.get(model))
        step, blocks = session.step_s, self.config.blocks
        receive = max(now, self.link_free.get(dest, 0.0))
        full = max(session.start + times.full[j] * step, receive + blocks * step)
        plan = times.plans.get(j)
        if self.config.execute_while_load and plan is not None and plan.serve_step is not None:
            # never before it could have taken its share of the blocks since it joined
            pipe = max(session.start + plan.serve_step * step,
                       receive + math.ceil(blocks / len(plan.members)) * step)
            if pipe < full:
                remote = sum(plan.hosted().values()) / self.shapes[model].layers
                return Startup(pipe - now, full - now, plan.hops, remote), session, new
        return Startup(full - now, full - now), session, new

    def estimate(self, model: str, nbytes: int, dest: str, holders: list[str],
                 now: float) -> Startup | None:
        """`holders`: the nodes that can send the model now (`is_holder`)."""
        planned = self._plan(model, nbytes, dest, holders, now)
        return None if planned is None else planned[0]

    def start(self, model: str, nbytes: int, dest: str, holders: list[str], now: float,
              instance_id: str) -> Startup:
        """Commit the multicast `estimate` gave: the destination joins (or opens) the session."""
        planned = self._plan(model, nbytes, dest, holders, now)
        assert planned is not None, "start() after an estimate that found a holder"
        startup, session, new = planned
        if new:
            self.sessions[model] = session
            for src in session.sources:
                self.link_free[src] = max(self.link_free.get(src, 0.0), session.inject_until)
        session.dests.append(dest)
        self.link_free[dest] = now + startup.full_s
        if startup.hops:
            self.modes[instance_id] = _Mode(now + startup.full_s, startup.hops, startup.remote)
        return startup

    def note_arriving(self, node: str, model: str, done_at: float) -> None:
        """A load into the node's DRAM tier (from a slower tier or by multicast): the copy is
        there at once in `NodeStorage`'s books but cannot be sent before it is done."""
        self.arriving[(node, model)] = max(self.arriving.get((node, model), 0.0), done_at)

    # --- execution ----------------------------------------------------------------------------
    def iteration_extra(self, instance_id: str, model: str, tokens: int, context_tokens: int,
                        kv_bytes_per_token: int, profile: Profile, now: float) -> float:
        """Seconds an iteration of the instance costs beyond its local time: the pipeline's
        activation hops while it serves in a pipeline; once, after it holds the whole model,
        rebuilding its requests' KV cache locally (the mode switch)."""
        mode = self.modes.get(instance_id)
        if mode is None:
            return 0.0
        if now < mode.until:
            return mode.hops * self.config.hop_s(tokens, self.hidden[model])
        del self.modes[instance_id]
        if context_tokens <= 0:
            return 0.0
        share = mode.remote
        pull = self.config.step_latency_s + (context_tokens * kv_bytes_per_token * share
                                             / self.config.link_bytes_per_s)
        return min(profile.migration_s(context_tokens), pull)

    def in_pipeline(self, instance_id: str, now: float) -> bool:
        mode = self.modes.get(instance_id)
        return mode is not None and now < mode.until


def start_load(mc: Multicaster, storage: Any, model: str, nbytes: int, node: str,
               holders: list[str], now: float, instance_id: str) -> tuple[str, float]:
    """The node starts a load: from its own tier, or by multicast if that serves sooner.
    Returns (how: a tier, "multicast" or "pipeline", seconds until the instance can serve)."""
    cached = model in storage.dram
    tier, tier_s = storage.estimate(model, nbytes, now)
    startup = mc.estimate(model, nbytes, node, holders, now)
    if startup is None or startup.ready_s >= tier_s:
        tier, seconds = storage.load(model, nbytes, now)
        if not cached:
            mc.note_arriving(node, model, now + seconds)
        mc.loads.append(Load(now, model, node, tier, seconds))
        return tier, seconds
    startup = mc.start(model, nbytes, node, holders, now, instance_id)
    storage.cache(model, nbytes)  # the received checkpoint lands in the node's DRAM tier
    if not cached:
        mc.note_arriving(node, model, now + startup.full_s)
    how = "pipeline" if startup.hops else MULTICAST_TIER
    session = mc.sessions[model]
    mc.loads.append(Load(now, model, node, how, startup.ready_s, len(session.sources),
                         len(session.dests)))
    return how, startup.ready_s


def annotate(view: StorageView, mc: Multicaster, storage: Any, model: str, nbytes: int,
             node: str, holders: list[str], now: float) -> StorageView:
    """The node's tiers as the core should see them for a new instance of `model`: the model in
    the multicast pseudo-tier when receiving it would serve sooner than the node's own tier."""
    startup = mc.estimate(model, nbytes, node, holders, now)
    if startup is None or startup.ready_s >= storage.estimate(model, nbytes, now)[1]:
        return view
    return replace(view, bytes_per_s={**view.bytes_per_s,
                                      MULTICAST_TIER: nbytes / max(startup.ready_s, 1e-9)},
                   holds={**view.holds, model: MULTICAST_TIER})


# --- load spikes (the workload λScale is about) ---------------------------------------------------

@dataclass(frozen=True)
class Spikes:
    """`count` bursts of `requests` arrivals of one model within `window_s`, evenly spread over
    the run, each on a model drawn (seeded) from all deployed ones; one node's DRAM tier holds
    each spiked model at the start (λScale's k >= 1: a copy kept in host memory somewhere)."""

    count: int = 0
    requests: int = 200
    window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.count < 0 or self.requests < 1 or not self.window_s > 0:
            raise ValueError("spikes: count >= 0, requests >= 1, window_s > 0")

    def models(self, names: list[str], seed: int) -> list[str]:
        rng = random.Random(seed ^ 0x5B1CE)
        return [rng.choice(sorted(names)) for _ in range(self.count)]

    def times(self, duration: float) -> list[float]:
        return [(i + 0.5) * duration / self.count for i in range(self.count)]


def spike_arrivals(spikes: Spikes, base: list, names: list[str], duration: float, seed: int,
                   lengths: Any, max_context: dict[str, int]) -> list:
    """The workload's arrivals plus the spikes' (sorted by time, then model, as the base is)."""
    from sim.workload import Arrival

    rng = random.Random(seed ^ 0x5B1CF)
    out = list(base)
    for model, t0 in zip(spikes.models(names, seed), spikes.times(duration)):
        for _ in range(spikes.requests):
            t = t0 + rng.random() * spikes.window_s
            inp, outp = lengths.sample(rng, max_context[model])
            out.append(Arrival(time=t, model=model, input_len=inp, output_len=outp))
    out.sort(key=lambda a: (a.time, a.model))
    return out


# --- configuration from the command line / SimConfig.extra ---------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (λScale multicast, CoCoServe module scaling)")
    g.add_argument("--link-gbps", type=float,
                   help="λScale: new instances receive a model that another node holds by "
                        "binomial multicast over links of this bandwidth (needs --storage "
                        "tiered or registry)")
    g.add_argument("--multicast-blocks", type=int, default=DEFAULT_BLOCKS)
    g.add_argument("--no-execute-while-load", action="store_true",
                   help="destinations serve only once they hold the whole model")
    g.add_argument("--cocoserve", action="store_true",
                   help="CoCoServe (slinfer only): an instance under a spike replicates layers "
                        "onto idle nodes instead of scaling out; replicas are shed under pressure")
    g.add_argument("--cocoserve-empty-hosts", action="store_true",
                   help="CoCoServe may also put replicas on empty nodes (default: only on nodes "
                        "that already hold an instance, CoCoServe's idle fragments)")
    g.add_argument("--burst", action="store_true",
                   help="slinfer: a new instance of a model whose recent arrivals outgrow it "
                        "starts the instances they need at once (shared/core/burst.py)")
    g.add_argument("--spikes", type=int, default=0, help="load spikes added to the workload")
    g.add_argument("--spike-requests", type=int, default=200)
    g.add_argument("--spike-window", type=float, default=10.0)


def extra_from(args: argparse.Namespace) -> dict[str, Any]:
    """The SimConfig.extra entries of these flags (none when they are not given, so a default
    run's report is unchanged)."""
    extra: dict[str, Any] = {}
    if args.link_gbps is not None:
        extra["scaleout"] = {"link_gbps": args.link_gbps, "blocks": args.multicast_blocks,
                             "execute_while_load": not args.no_execute_while_load}
    if args.cocoserve:
        extra["cocoserve"] = {"link_gbps": args.link_gbps or 100.0,
                              "empty_hosts": args.cocoserve_empty_hosts}
    if args.burst:
        extra["burst"] = {}
    if args.spikes:
        extra["spikes"] = {"count": args.spikes, "requests": args.spike_requests,
                           "window_s": args.spike_window}
    return extra


def config_of(extra: dict[str, Any]) -> ScaleoutConfig | None:
    return ScaleoutConfig(**extra["scaleout"]) if "scaleout" in extra else None


def burst_settings(extra: dict[str, Any]) -> dict[str, Any]:
    """CoreConfig's burst scale-out fields from SimConfig.extra["burst"] ({} for the defaults,
    or window_s / max / max_startup_s); none without it, so a default run's config is CoreConfig's."""
    if "burst" not in extra:
        return {}
    burst = dict(extra["burst"])
    unknown = set(burst) - {"window_s", "max", "max_startup_s"}
    if unknown:
        raise ValueError(f"burst: unknown settings {sorted(unknown)} (window_s, max, max_startup_s)")
    out: dict[str, Any] = {"burst_scaleout": True}
    if "window_s" in burst:
        out["burst_window_s"] = float(burst["window_s"])
    if "max" in burst:
        out["burst_max"] = int(burst["max"])
    if "max_startup_s" in burst:
        out["burst_max_startup_s"] = float(burst["max_startup_s"])
    return out


def spikes_of(extra: dict[str, Any]) -> Spikes | None:
    return Spikes(**extra["spikes"]) if "spikes" in extra else None


def prime(spikes: Spikes, storage: dict[str, Any], names: list[str], nbytes: dict[str, int],
          seed: int) -> None:
    """Spike i's model starts in the DRAM tier of node i mod nodes (sorted by id)."""
    nodes = sorted(storage)
    for i, model in enumerate(spikes.models(names, seed)):
        storage[nodes[i % len(nodes)]].cache(model, nbytes[model])


def check(cfg: Any) -> None:
    """Reject a SimConfig whose scale-out settings cannot run (a clear error, not a silent no-op)."""
    extra = cfg.extra
    if "scaleout" in extra:
        config_of(extra)
        if cfg.storage == "dram":
            raise ValueError("--link-gbps needs --storage tiered or registry: with every checkpoint "
                             "in every node's DRAM (the default) no node needs the network")
    if "cocoserve" in extra and cfg.system != "slinfer":
        raise ValueError("--cocoserve runs on the slinfer system only")
    if "burst" in extra:
        if cfg.system != "slinfer":
            raise ValueError("--burst runs on the slinfer system only (the core decides it)")
        CoreConfig(**burst_settings(extra))  # its own range checks
    spikes_of(extra)


def multicaster(cfg: Any, cluster: Any, storage: dict[str, Any] | None) -> Multicaster | None:
    """The run's multicaster (None without --link-gbps); primes the spiked models' DRAM copies."""
    from sim.profiles import SHAPES

    extra = cfg.extra
    spikes = spikes_of(extra)
    names = sorted(cluster.specs)
    if spikes is not None and storage is not None:
        prime(spikes, storage, names, {m: s.weight_bytes for m, s in cluster.specs.items()}, cfg.seed)
    config = config_of(extra)
    if config is None:
        return None
    return Multicaster(config, {m: SHAPES[size].hidden for m, size in cluster.sizes.items()},
                       {m: Shape(cluster.specs[m].weight_bytes, SHAPES[size].layers, SHAPES[size].hidden)
                        for m, size in cluster.sizes.items()})


def cocoserve_settings(cfg: Any, cluster: Any) -> tuple | None:
    """CoCoServe's (link Gb/s, model -> layers, model -> hidden size, replicas on empty nodes
    too); None without --cocoserve."""
    from sim.profiles import SHAPES

    if "cocoserve" not in cfg.extra:
        return None
    shapes = {m: SHAPES[size] for m, size in cluster.sizes.items()}
    return (float(cfg.extra["cocoserve"].get("link_gbps", 100.0)),
            {m: s.layers for m, s in shapes.items()}, {m: s.hidden for m, s in shapes.items()},
            bool(cfg.extra["cocoserve"].get("empty_hosts", False)))
