"""What a simulated mechanism (CoCoServe's `sim/cocoserve.py`) drives the simulated SLINFER
cluster through: its nodes, the models, the profiles, the clock and the recorder, and the two
ways a node's decision is carried out. `sim/slinfer_system.py` implements it; the mechanism names
only this, so the system can build the mechanism without the two importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.core.config import CoreConfig
from shared.core.memory import MemOp
from shared.core.node_scheduler import AdmitResult, NodeScheduler
from shared.core.perf_model import PerfModel
from shared.core.types import ModelSpec, RequestView
from sim.engine import EventLoop, Recorder
from sim.storage import NodeStorage


@dataclass
class SimNode:
    sched: NodeScheduler
    busy: bool = False  # an iteration is in flight
    reclaim_at: float | None = None  # a keep-alive check is scheduled for this time
    checked_at: float = -1.0  # time of the last keep-alive check (to avoid re-checking at once)
    ops_running: dict[int, MemOp] = field(default_factory=dict)
    storage: NodeStorage | None = None  # checkpoint tiers (None: the profile's load time)
    # live preemptions whose handover is due once the victim's iteration in flight ends
    handovers: list[tuple] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.sched.node.node_id


class ClusterPort(Protocol):
    nodes: dict[str, SimNode]
    models: dict[str, ModelSpec]  # the mechanism may refine a spec (layers, activation size)
    perf: PerfModel
    config: CoreConfig
    loop: EventLoop  # bound before the run starts
    rec: Recorder

    def start_ops(self, sn: SimNode, ops) -> None:
        """Run a node's memory ops on the event loop."""

    def admitted(self, sn: SimNode, view: RequestView, cold: bool, result: AdmitResult) -> bool:
        """Carry out a node's answer to an admission, as the node worker does."""
