"""What every cluster-level decision reads: the nodes' views, the profiles, the time and the
core's knobs (and the specs of the models the cluster serves), as one value.

Placement, consolidation, burst scale-out, module scaling and the startup choice all decide on
the same cluster at the same moment; passing that moment as one frozen value keeps their
signatures short and makes "the same views, the same clock" a property of the call, not of
parameter order. A decision that looks at another state (the views with a planned instance in
them, the nodes without some) asks for a copy with `with_nodes`.

The context only carries its inputs: the core reads them, never changes them (the simulator
hands over the node schedulers' own views, tests/core/test_placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from shared.core.config import CoreConfig
from shared.core.perf_model import PerfModel, Profile
from shared.core.types import Hardware, ModelSpec, NodeView


@dataclass(frozen=True, eq=False)
class DecisionContext:
    nodes: list[NodeView]  # the cluster as the decision sees it
    perf: PerfModel
    now: float  # the decider's clock, the one the views are relative to
    config: CoreConfig
    # the specs of the models the views' requests belong to (preemption moves them)
    models: Mapping[str, ModelSpec] = field(default_factory=dict)

    def with_nodes(self, nodes: list[NodeView]) -> DecisionContext:
        """The same moment over other views (a trial state, a subset of the nodes)."""
        return replace(self, nodes=nodes)

    def with_model(self, model: ModelSpec) -> DecisionContext:
        """The context knowing `model`'s spec too (the request being placed brings it)."""
        if self.models.get(model.name) is model:
            return self
        return replace(self, models={**self.models, model.name: model})

    def profile(self, model: str, hardware: Hardware) -> Profile | None:
        return self.perf.get(model, hardware)
