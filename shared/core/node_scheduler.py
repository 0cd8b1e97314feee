"""The node's brain: token-level scheduling plus the memory subsystem, as a pure state machine.

The node worker (real engines) and the simulator (profile-timed engines) drive it the same way:

    result = sched.admit(request, instance_id, model, now)   # re-check, then commit
    result = sched.preempt_and_admit(victims, request, instance_id, model, now)  # §VIII-A
    result = sched.preempt_and_admit(..., handover_s=h)   # live: the victims hand over first
    left, ops = sched.finish_handover(victim, now)            # a victim's requests have moved
    plan = sched.step(now)                                    # what to run now (+ memory ops)
    ...execute plan.iteration and plan.start_ops...
    sched.finish_iteration(plan.iteration, now, finished)     # feed the outcome back
    sched.memop_done(op, now)                                 # a memory op completed
    sched.reclaim_idle(now)                                   # keep-alive expiry
    sched.unload_model(name, now)                             # the admin's unload-now

`NodeScheduler` is the one door callers use; behind it each mechanism is its own part, and all of
them work on one shared `node_state.NodeState` (the node's view, the memory ledger and the tables
beside them). Read the parts in this order:

- `node_timeline.MemOpTimeline`: when each instance can run again given its memory ops; every
  part syncs the node's view with the ledger through it after a change;
- `node_adapters.InstanceAdapters`: LoRA adapters on backbone instances (attach, detach,
  pre-load, offload) and the invocation rates they are weighed by (ServerlessLoRA);
- `node_memops.MemoryOps`: resizing and unloading instances, bytes held for other nodes'
  stages, a completed op, keep-alive reclaim;
- `node_admission.Admitter`: an admission re-checked on this node, then committed;
- `node_preemption.Preemption`: smaller instances make room, stop-and-resume or live;
- `node_token_loop.TokenLoop`: the next iteration, its outcome, evictions, cancellation;
- `node_layouts.Layouts`: CoCoServe layouts, pipelines, stage loads, parked requests.

Each part is built on the ones above it in this list (no part reaches into another's private
members), so a change to one mechanism stays in its file.
"""

from __future__ import annotations

from shared.core.config import CoreConfig
from shared.core.iteration import IterationChoice
from shared.core.lora import ADAPTER_LOAD_BYTES_PER_S  # the pre-loaders import it from here
from shared.core.memory import MemOp, MemoryLedger
from shared.core.node_adapters import InstanceAdapters
from shared.core.node_admission import AdmitResult, Admitter
from shared.core.node_layouts import Layouts
from shared.core.node_memops import MemoryOps
from shared.core.node_preemption import Preemption
from shared.core.node_state import NodeState, copy_instances
from shared.core.node_timeline import MemOpTimeline
from shared.core.node_token_loop import LATE_EPS_S, Eviction, StepPlan, TokenLoop
from shared.core.perf_model import PerfModel
from shared.core.types import (AdapterSpec, Hardware, InstanceLayout, ModelSpec, NodeView,
                               PipelineMode, RequestView)

__all__ = ["ADAPTER_LOAD_BYTES_PER_S", "LATE_EPS_S", "AdmitResult", "Eviction", "NodeScheduler",
           "StepPlan", "copy_instances", "new_node"]


class NodeScheduler:
    """One node's scheduler: each method hands the call to the part that owns its mechanism
    (the part's method says what it does). `node`, `perf`, `config` and `ledger` are the shared
    state's; `perf` may be replaced (online calibration) and every part sees the new one."""

    def __init__(self, node: NodeView, perf: PerfModel, config: CoreConfig | None = None) -> None:
        self.state = NodeState(node, perf, config if config is not None else CoreConfig())
        self.timeline = MemOpTimeline(self.state)
        self.adapters = InstanceAdapters(self.state, self.timeline)
        self.memops = MemoryOps(self.state, self.timeline, self.adapters)
        self.admitter = Admitter(self.state, self.timeline, self.memops, self.adapters)
        self.preemption = Preemption(self.state, self.timeline, self.memops, self.adapters,
                                     self.admitter)
        self.tokens = TokenLoop(self.state, self.memops)
        self.layouts = Layouts(self.state, self.timeline)

    # --- the shared state --------------------------------------------------------------------
    @property
    def node(self) -> NodeView:
        """Authoritative state of this node (instances, requests, KV sizes)."""
        return self.state.node

    @property
    def perf(self) -> PerfModel:
        return self.state.perf

    @perf.setter
    def perf(self, perf: PerfModel) -> None:  # calibration swaps in what it learned
        self.state.perf = perf

    @property
    def config(self) -> CoreConfig:
        return self.state.config

    @property
    def ledger(self) -> MemoryLedger:
        return self.state.ledger

    def view(self) -> NodeView:
        return self.state.view()

    def kv_capacity_bytes(self, instance_id: str) -> int:
        return self.state.kv_capacity_bytes(instance_id)

    # --- admission and preemption ------------------------------------------------------------
    def admit(self, request: RequestView, instance_id: str | None, model: ModelSpec, now: float,
              adapter: AdapterSpec | None = None, not_before: float | None = None) -> AdmitResult:
        return self.admitter.admit(request, instance_id, model, now, adapter, not_before)

    def start_instance(self, like: RequestView, model: ModelSpec, now: float) -> AdmitResult:
        return self.admitter.start_instance(like, model, now)

    def preempt_and_admit(self, victims: list[str], request: RequestView, instance_id: str | None,
                          model: ModelSpec, now: float, adapter: AdapterSpec | None = None,
                          handover_s: float | None = None) -> AdmitResult:
        return self.preemption.preempt_and_admit(victims, request, instance_id, model, now,
                                                 adapter, handover_s)

    def preempt(self, instance_ids: list[str], now: float) -> tuple[list[RequestView], list[MemOp]]:
        return self.preemption.preempt(instance_ids, now)

    def handing_over(self) -> list[str]:
        return self.preemption.handing_over()

    def finish_handover(self, instance_id: str,
                        now: float) -> tuple[list[RequestView], list[MemOp]]:
        return self.preemption.finish_handover(instance_id, now)

    # --- LoRA adapters -----------------------------------------------------------------------
    def detach_adapter(self, instance_id: str, adapter: str, now: float) -> list[MemOp]:
        return self.adapters.detach(instance_id, adapter, now)

    def preload_adapter(self, instance_id: str, adapter: AdapterSpec, now: float) -> list[MemOp]:
        return self.adapters.preload(instance_id, adapter, now)

    def offloadable(self, now: float, keep: str | None = None) -> list[tuple[str, str, int]]:
        return self.adapters.offloadable(now, keep)

    def rate(self, name: str, now: float) -> float:
        return self.adapters.rate(name, now)

    def adapter_rate(self, adapter: str, now: float) -> float:
        return self.adapters.rate(adapter, now)

    def called(self) -> list[str]:
        return self.adapters.called()

    # --- the token-level loop ----------------------------------------------------------------
    def step(self, now: float) -> StepPlan:
        return self.tokens.step(now)

    def finish_iteration(self, choice: IterationChoice, now: float,
                         finished: set[str] = frozenset()) -> list[MemOp]:
        return self.tokens.finish_iteration(choice, now, finished)

    def evict_for_memory(self, instance_id: str, now: float) -> Eviction | None:
        return self.tokens.evict_for_memory(instance_id, now)

    def abort_iteration(self, now: float) -> None:
        self.tokens.abort_iteration(now)

    def cancel(self, request_id: str, now: float) -> list[MemOp]:
        return self.tokens.cancel(request_id, now)

    # --- memory ops --------------------------------------------------------------------------
    def memop_done(self, op: MemOp, now: float) -> list[MemOp]:
        return self.memops.memop_done(op, now)

    def reclaim_idle(self, now: float) -> list[MemOp]:
        return self.memops.reclaim_idle(now)

    def next_reclaim_at(self) -> float | None:
        return self.memops.next_reclaim_at()

    def unload_model(self, model: str, now: float) -> list[MemOp]:
        return self.memops.unload_model(model, now)

    def hold(self, key: str, nbytes: int, now: float,
             load: float | None = None) -> tuple[bool, list[MemOp]]:
        return self.memops.hold(key, nbytes, now, load)

    # --- layouts, pipelines and parked requests ----------------------------------------------
    def set_layout(self, instance_id: str, layout: InstanceLayout | None,
                   now: float) -> tuple[bool, list[MemOp]]:
        return self.layouts.set_layout(instance_id, layout, now)

    def set_pipeline(self, instance_id: str, mode: PipelineMode | None) -> None:
        self.layouts.set_pipeline(instance_id, mode)

    def stage_measured(self, key: str, load: float) -> None:
        self.layouts.stage_measured(key, load)

    def park(self, instance_id: str, request_id: str) -> RequestView | None:
        return self.layouts.park(instance_id, request_id)

    def unpark(self, instance_id: str, view: RequestView) -> bool:
        return self.layouts.unpark(instance_id, view)

    def commit_parked(self, instance_id: str, view: RequestView, generated: int,
                      now: float) -> bool:
        return self.layouts.commit_parked(instance_id, view, generated, now)


def new_node(node_id: str, hardware: Hardware, memory_bytes: int, perf: PerfModel,
             config: CoreConfig | None = None, matrix_accel: bool = False) -> NodeScheduler:
    node = NodeView(node_id, hardware, memory_bytes, matrix_accel=matrix_accel)
    return NodeScheduler(node, perf, config or CoreConfig())
