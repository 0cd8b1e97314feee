"""What the parts of a node's scheduler share (`node_scheduler` lists the parts).

One `NodeState` per node: the node's view (instances, their requests and KV sizes), the memory
ledger that approves and orders every byte, and the small tables the mechanisms keep beside them
(op estimates, adapter use, call rates, live preemptors' waits, stage loads, the running
iteration). Every part reads and changes the node through this one object, so no part keeps a copy
of another's facts. Its methods answer questions about the node (and number new instances); the
parts make the changes, and each change to the ledger is followed by
`node_timeline.MemOpTimeline.sync`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.core.config import CoreConfig
from shared.core.cost import instance_profile
from shared.core.lora import CallRates
from shared.core.memory import MemoryLedger
from shared.core.perf_model import PerfModel, Profile
from shared.core.types import InstanceView, ModelSpec, NodeView, adapter_owner


@dataclass
class NodeState:
    node: NodeView  # authoritative state of this node (instances, requests, KV sizes)
    perf: PerfModel
    config: CoreConfig
    ledger: MemoryLedger = field(init=False)
    next_instance: int = 1  # the number in the next new instance's id
    op_estimates: dict[int, float] = field(default_factory=dict)  # op id -> its estimated duration
    adapter_of: dict[str, str] = field(default_factory=dict)  # request -> its adapter
    # Model or adapter -> its recent admission times (a request through an adapter counts for the
    # adapter and for its backbone): the invocation rates offloading and pre-loading weigh
    # artifacts by (ServerlessLoRA §4.1, §4.3).
    rates: CallRates = field(default_factory=CallRates)
    # Live preemption: preemptor instance -> the victims it waits for (runs nothing until they
    # are unloaded: the handover the admission was validated with).
    waits_for: dict[str, set[str]] = field(default_factory=dict)
    loads: dict[str, float] = field(default_factory=dict)  # hold key -> its compute share (`hold`)
    started: tuple[str, float] | None = None  # the running iteration's instance, its start

    def __post_init__(self) -> None:
        self.ledger = MemoryLedger(self.node.memory_bytes)

    def view(self) -> NodeView:
        """A snapshot for the placer (and for evaluate()): copies, safe to publish."""
        return replace(self.node, instances=copy_instances(self.node.instances))

    def find(self, instance_id: str) -> InstanceView | None:
        return self.node.instance(instance_id)

    def instance(self, instance_id: str) -> InstanceView:
        inst = self.find(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id}")
        return inst

    def new_instance_id(self, model: ModelSpec) -> str:
        iid = f"{model.name}@{self.node.node_id}#{self.next_instance}"
        self.next_instance += 1
        return iid

    def kv_capacity_bytes(self, instance_id: str) -> int:
        """KV bytes the instance really holds now (what the engine was last resized to)."""
        inst = self.instance(instance_id)
        return max(0, self.ledger.allocated(instance_id) - inst.model.weight_bytes)

    def kv_capacity_tokens(self, inst: InstanceView) -> int:
        """Whole blocks only: the engine rounds its pool down to blocks."""
        block_bytes = max(1, inst.model.kv_bytes_per_token) * inst.model.kv_block_tokens
        return self.kv_capacity_bytes(inst.instance_id) // block_bytes * inst.model.kv_block_tokens

    def running_ops(self) -> set[str]:
        """Ledger entries (instances, adapters, held keys) with a memory op running."""
        return {op.instance_id for op in self.ledger.running()}

    def adapters_busy(self) -> set[str]:
        """Instances with an adapter op running or parked: they run nothing until it is done."""
        ops = (*self.ledger.running(), *self.ledger.parked())
        return {owner[0] for op in ops if (owner := adapter_owner(op.instance_id)) is not None}

    def profile(self, inst: InstanceView) -> Profile:
        profile = instance_profile(self.perf, inst, self.node.hardware)
        if profile is None:
            raise KeyError(f"no profile for {inst.model.name} on {self.node.hardware.value}")
        return profile

    def publish_stage_load(self) -> None:
        """The node's `stage_load` is the sum of what its held stages take."""
        self.node.stage_load = sum(self.loads.values())


def copy_instances(instances: list[InstanceView]) -> list[InstanceView]:
    """Copies deep enough that changing requests on them leaves the originals untouched."""
    return [replace(i, requests=[replace(r) for r in i.requests], adapters=dict(i.adapters),
                    prefill_progress=dict(i.prefill_progress))
            for i in instances]
