"""Predictive pre-warming (Shahrad et al., "Serverless in the Wild", ATC'20: the hybrid
histogram policy), per model.

Each model keeps a histogram of its idle times: from the moment its last call in flight ended to
its next call (`IdleTracker`). When the histogram says something (`policy`):
- a pre-warm delay: its instance may be gone while the model is idle and is started again that
  long after the model went idle (the head of the histogram, less a margin: early rather than
  late), and
- a keep-alive window: how long that instance (or, with no pre-warm delay, the one that just
  served) stays loaded (the tail, plus a margin, less the delay).
When it does not (too few idle times, or spread so evenly that no part of it is likelier than
another) the core's fixed keep-alive stays. The paper forecasts a model whose idle times mostly
fall beyond the histogram's range with a time series (ARIMA); that is left out here: such a
model keeps the fixed window too (`Windows.source` says which case applied).

An instance only the policy keeps (idle past the fixed keep-alive: a pre-warmed one not called
yet, or one kept for its model's tail) gives way to any admission that needs its memory, a new
instance's included (`gives_way`, which the preemption rules of `shared.core.consolidation` and
the placement's last resort for a new instance consult): the policy's guess never costs a
request its place. (Without this, the 128 x 7B run of the simulator lost more SLO-met requests
to the memory the longer windows held than it won from the cold starts they saved.)

`plan_prewarms` turns the windows into instances to start: for each idle model whose pre-warm
time has come and which has no instance anywhere, one node whose memory takes it beside what its
serving instances are about to want (`shared.core.lora.preload_room`, on the node's ledger
figures) and whose admission check (`shared.core.evaluate.evaluate`, the one a cold start
passes) accepts it. A pre-warm never preempts: a node without room is skipped. The node then
starts the instance by its own re-check (`NodeScheduler.start_instance`), which may still refuse.

Pure: time comes in as arguments; the tracker is state its owner (the placer, the simulator)
feeds with each call's start and end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from shared.core.config import CoreConfig
from shared.core.evaluate import evaluate
from shared.core.keepalive import is_idle
from shared.core.lora import preload_room
from shared.core.perf_model import PerfModel
from shared.core.types import InstanceView, ModelSpec, NodeView, RequestView, slo_for_input

PREWARM_PREFIX = "prewarm:"  # request id of the stand-in request a pre-warm is checked with


@dataclass(frozen=True)
class PrewarmConfig:
    """The histogram's shape and when it is trusted. The paper's defaults: 1-minute bins over 4
    hours, head and tail at the 5th and 99th percentiles, 10% margins, a coefficient of variation
    of the bin counts of at least 2. The simulator's 30-minute trace shrinks the bins (its
    idle times are seconds to minutes)."""

    bin_s: float = 60.0
    bins: int = 240
    head_pct: float = 5.0
    tail_pct: float = 99.0
    margin: float = 0.10
    cv_min: float = 2.0  # below: the idle times are spread evenly, the histogram predicts nothing
    min_samples: int = 5  # fewer idle times than this: not representative yet
    # More than this share of idle times beyond the range: the paper's time-series case.
    beyond_max: float = 0.5

    def __post_init__(self) -> None:
        if not self.bin_s > 0 or self.bins < 1:
            raise ValueError("bin_s must be > 0 and bins >= 1")
        if not 0 <= self.head_pct <= self.tail_pct <= 100:
            raise ValueError("need 0 <= head_pct <= tail_pct <= 100")
        if self.margin < 0 or self.cv_min < 0 or self.min_samples < 1:
            raise ValueError("margin and cv_min must be >= 0, min_samples >= 1")
        if not 0 <= self.beyond_max <= 1:
            raise ValueError("beyond_max must be in [0, 1]")

    @property
    def range_s(self) -> float:
        return self.bin_s * self.bins


@dataclass
class IdleHistogram:
    """A model's idle times: counts per bin of `PrewarmConfig.bin_s`, and those beyond the range."""

    counts: list[int]
    beyond: int = 0

    @classmethod
    def empty(cls, config: PrewarmConfig) -> IdleHistogram:
        return cls([0] * config.bins)

    @property
    def in_range(self) -> int:
        return sum(self.counts)

    @property
    def total(self) -> int:
        return self.in_range + self.beyond

    def add(self, idle_s: float, config: PrewarmConfig) -> None:
        index = int(max(0.0, idle_s) // config.bin_s)
        if index >= len(self.counts):
            self.beyond += 1
        else:
            self.counts[index] += 1

    def cv(self) -> float:
        """Coefficient of variation of the bin counts (0 for an empty histogram): high when the
        idle times gather in a few bins."""
        n = len(self.counts)
        mean = self.in_range / n
        if mean == 0:
            return 0.0
        var = sum((c - mean) ** 2 for c in self.counts) / n
        return math.sqrt(var) / mean

    def percentile_bin(self, pct: float) -> int:
        """The first bin by which `pct` percent of the in-range idle times have been seen."""
        need = max(1, math.ceil(pct / 100.0 * self.in_range))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need:
                return i
        return len(self.counts) - 1


@dataclass(frozen=True)
class Windows:
    """What the policy says for a model. `prewarm_s`: after it went idle, start an instance this
    late (0: keep the one that served instead); `keep_alive_s`: how long that instance stays
    loaded once idle. `source`: "histogram", or "fixed" (not representative) or "beyond_range"
    (the paper's time-series case, here the fixed window too)."""

    prewarm_s: float
    keep_alive_s: float
    source: str

    @property
    def predicted(self) -> bool:
        return self.source == "histogram"


def policy(hist: IdleHistogram, config: PrewarmConfig, fixed_keep_alive_s: float) -> Windows:
    """The hybrid histogram policy for one model (see the module docstring)."""
    fixed = Windows(0.0, fixed_keep_alive_s, "fixed")
    if hist.total < config.min_samples:
        return fixed
    if hist.beyond > config.beyond_max * hist.total:
        return replace(fixed, source="beyond_range")  # ARIMA in the paper: not done here
    if hist.cv() < config.cv_min:
        return fixed
    head = hist.percentile_bin(config.head_pct) * config.bin_s  # the head bin's lower edge
    tail = (hist.percentile_bin(config.tail_pct) + 1) * config.bin_s  # the tail bin's upper edge
    prewarm = head * (1 - config.margin)
    return Windows(prewarm, tail * (1 + config.margin) - prewarm, "histogram")


@dataclass
class _ModelIdle:
    hist: IdleHistogram
    active: int = 0
    idle_since: float | None = None  # None: never ran, or a call is in flight
    prewarmed: bool = False  # a pre-warm was planned in the current idle period


@dataclass
class IdleTracker:
    """Every model's idle times, fed with each call's start and end by the component that sees
    them all (the placer; the simulator)."""

    config: PrewarmConfig = field(default_factory=PrewarmConfig)
    models: dict[str, _ModelIdle] = field(default_factory=dict)

    def _of(self, model: str) -> _ModelIdle:
        if model not in self.models:
            self.models[model] = _ModelIdle(IdleHistogram.empty(self.config))
        return self.models[model]

    def started(self, model: str, now: float) -> bool:
        """A call of `model` arrived. True when it ended an idle period (one more idle time)."""
        m = self._of(model)
        m.active += 1
        if m.idle_since is None:
            return False
        m.hist.add(now - m.idle_since, self.config)
        m.idle_since, m.prewarmed = None, False
        return True

    def ended(self, model: str, now: float) -> bool:
        """A call of `model` ended (finished or dropped). True when the model is idle now."""
        m = self._of(model)
        m.active = max(0, m.active - 1)
        if m.active == 0:
            m.idle_since, m.prewarmed = now, False
            return True
        return False

    def windows(self, model: str, fixed_keep_alive_s: float) -> Windows:
        return policy(self._of(model).hist, self.config, fixed_keep_alive_s)

    def prewarm_at(self, model: str, fixed_keep_alive_s: float) -> float | None:
        """When the model's instance should be started again (None: no pre-warm due: a call is
        in flight, it never ran, its histogram predicts nothing, or it keeps its instance)."""
        m = self._of(model)
        w = self.windows(model, fixed_keep_alive_s)
        if m.idle_since is None or m.prewarmed or not w.predicted or w.prewarm_s <= 0:
            return None
        return m.idle_since + w.prewarm_s

    def mark_prewarmed(self, model: str) -> None:
        self._of(model).prewarmed = True


def keep_alive_spec(model: ModelSpec, windows: Windows) -> ModelSpec:
    """The model as its instances should keep alive under the policy (`CoreConfig.prewarm` on):
    a model registered with its own keep-alive keeps it; one whose histogram predicts keeps the
    instance that served for the policy's window when there is no pre-warm delay (the next call
    comes soon), else the fixed one (a pre-warm brings an instance back in time)."""
    if model.keep_alive_s is not None or not windows.predicted or windows.prewarm_s > 0:
        return model
    return replace(model, keep_alive_s=windows.keep_alive_s)


def gives_way(inst: InstanceView, now: float, config: CoreConfig) -> bool:
    """With pre-warming on: is `inst` idle and kept only by the policy's window (past the
    fixed `keep_alive_s`, not pinned)? Such an instance may be unloaded for any admission."""
    return (config.prewarm and is_idle(inst) and not inst.pinned
            and now >= inst.last_active + config.keep_alive_s)


def spare_instances(node: NodeView, now: float, config: CoreConfig) -> frozenset[str]:
    """The ids of the node's instances that `gives_way` (none with pre-warming off)."""
    if not config.prewarm:
        return frozenset()
    return frozenset(i.instance_id for i in node.instances if gives_way(i, now, config))


@dataclass(frozen=True)
class PrewarmPlan:
    model: str
    node_id: str
    at: float  # when to start it (now: the plan is due)
    keep_alive_s: float  # the pre-warmed instance's idle window from its start


def stand_in(model: ModelSpec, now: float) -> RequestView:
    """The request a pre-warm is checked and sized with: one prompt token, one output token (the
    smallest KV pool; a call that joins grows it as any join does)."""
    return RequestView(f"{PREWARM_PREFIX}{model.name}", model.name, 1, now, slo_for_input(1),
                       max_tokens=1)


def fits(node: NodeView, model: ModelSpec, perf: PerfModel, now: float, config: CoreConfig) -> bool:
    """May a pre-warmed instance of `model` start on `node` now, displacing nothing: the node
    takes work, the admission check of a cold start accepts it, and its bytes fit in the room the
    node's serving instances leave beside their next KV scale-ups (`preload_room`)."""
    if node.draining:
        return False
    admission = evaluate(node, None, stand_in(model, now), model, perf, now, config)
    if not admission.ok:
        return False
    return model.weight_bytes + (admission.kv_target_bytes or 0) <= preload_room(node, config.watermark)


def plan_prewarms(tracker: IdleTracker, models: Mapping[str, ModelSpec], nodes: Iterable[NodeView],
                  perf: PerfModel, now: float, config: CoreConfig) -> list[PrewarmPlan]:
    """The pre-warms due by `now`: each idle model whose pre-warm time has come and which has no
    instance that accepts work anywhere, on one node that `fits` it (the one with the most
    room; each node takes one pre-warm per call, so one view serves every check). Models in name
    order; a model no node takes now is not planned (and not retried in this idle period)."""
    nodes = sorted(nodes, key=lambda n: n.node_id)
    present = {i.model.name for n in nodes for i in n.instances if i.accepts}
    taken: set[str] = set()
    plans = []
    for name in sorted(tracker.models):
        at = tracker.prewarm_at(name, config.keep_alive_s)
        if at is None or at > now or name in present or name not in models:
            continue
        spec = models[name]
        tracker.mark_prewarmed(name)
        room = [(preload_room(n, config.watermark), n.node_id, n) for n in nodes
                if n.node_id not in taken and fits(n, spec, perf, now, config)]
        if not room:
            continue
        _, node_id, _ = max(room, key=lambda r: (r[0], r[1]))
        taken.add(node_id)
        plans.append(PrewarmPlan(name, node_id, now,
                                 tracker.windows(name, config.keep_alive_s).keep_alive_s))
    return plans
