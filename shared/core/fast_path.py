"""The warm fast path's choice: which existing instance a gateway sends a request to directly,
without the request stream and a placer's decision (services/gateway/direct.py).

It is the candidate `place` would try first for a ROUTE (CPU nodes first, then the largest batch:
`route_candidates`, which `place` walks), read from a view that may be a little stale. It needs no profile and decides
nothing: the node's admission re-checks the request on its own state with the same core
(`NodeScheduler.admit`) and refuses what would break an SLO, and a refusal sends the request on
to the placers, who see the whole cluster. So the choice only has to be right often, and cheap.

Left to the placers: a request with an adapter its instance has not attached (attaching one is
priced by `place`), and a model with no instance that takes requests (a cold start).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.core.consolidation import route_candidates
from shared.core.types import NodeView


@dataclass(frozen=True)
class WarmRoute:
    node_id: str
    instance_id: str


def warm_route(nodes: list[NodeView], model: str, adapter: str | None = None) -> WarmRoute | None:
    """The instance of `model` a request goes to first (with `adapter` attached, if it names
    one), on a node that takes new work; None: the placers decide."""
    for node, inst in route_candidates([n for n in nodes if not n.draining], model):
        if adapter is None or adapter in inst.adapters:
            return WarmRoute(node.node_id, inst.instance_id)
    return None
