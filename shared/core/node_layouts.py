"""Where an instance's layers and requests are: CoCoServe layouts, pipelines, the stages a node
runs for others, and requests held out of the batches during a live migration.

- `set_layout`: after layers move off (a shed) or come back, the instance's ledger entry follows
  its local share of the weights and K/V.
- `set_pipeline`: the pipeline the instance really serves through, for shadow validation.
- `stage_measured`: the compute share a held stage (`MemoryOps.hold`) really took.
- `park`/`unpark`/`commit_parked`: a live migration takes a request out of its instance's
  batches while its memory stays counted, then puts it back or commits it.
"""

from __future__ import annotations

from shared.core.cost import kv_for_layers, layout_spec, reservations_cover
from shared.core.memory import MemOp, MemOpKind
from shared.core.node_state import NodeState
from shared.core.node_timeline import MemOpTimeline
from shared.core.types import InstanceLayout, PipelineMode, RequestView


class Layouts:
    def __init__(self, state: NodeState, timeline: MemOpTimeline) -> None:
        self.state = state
        self.timeline = timeline

    def set_layout(self, instance_id: str, layout: InstanceLayout | None,
                   now: float) -> tuple[bool, list[MemOp]]:
        """CoCoServe: the instance's layers now run as `layout` says (None: all of them here).
        Its bytes on this node follow: its share's weights (`modules.layout_spec`) and its K/V
        pool per local layer (the block count is kept: moved layers take their pools along,
        rounded up so the engine keeps every block). Fewer local layers shrink its ledger entry
        (the op changes nothing on the engine, whose memory the move already freed); more
        (layers taken back) must fit the budget first, else False and nothing changes; so
        for new stages whose hosts reserved less than their share of its pool now."""
        inst = self.state.instance(instance_id)
        full = inst.layout.model if inst.layout is not None else inst.model
        if full.layers <= 0:
            raise ValueError(f"{full.name} has no layer count: its layers cannot move")
        if layout is not None and layout.model != full:
            raise ValueError(f"a layout of {layout.model.name} for an instance of {full.name}")
        layout = layout if layout is not None and layout.runs else None
        before = inst.layout.local_layers() if inst.layout is not None else full.layers
        after = layout.local_layers() if layout is not None else full.layers
        if not 0 < after <= full.layers:
            raise ValueError(f"an instance keeps 1 to {full.layers} layers here, not {after}")
        if layout is not None and not reservations_cover(inst, layout):
            return False, []  # its pool outgrew what the new stages' hosts reserved
        spec = layout_spec(layout) if after < full.layers else full  # replicas move nothing off
        kv = kv_for_layers(inst.kv_bytes, before, after)
        ok, ops = self.state.ledger.request(MemOpKind.SCALE, instance_id, spec.weight_bytes + kv,
                                            now)
        if not ok:
            return False, []
        # The engine moved the layers (and their pools) before: the op only brings the ledger
        # along and holds the instance up for no time (priced as a resize, it would stop it for
        # one that the admissions and the module planner never saw).
        for op in (*self.state.ledger.running(), *self.state.ledger.parked()):
            if op.instance_id == instance_id:
                self.state.op_estimates.setdefault(op.op_id, 0.0)
        inst.model, inst.kv_bytes, inst.layout = spec, kv, layout
        self.timeline.sync(now)
        return True, ops

    def set_pipeline(self, instance_id: str, mode: PipelineMode | None) -> None:
        """The instance serves through the pipeline `mode` as it really formed (None: it runs
        every layer here); shadow validation then prices its requests with those hops."""
        inst = self.state.find(instance_id)
        if inst is not None and (mode is None or inst.pipeline is not None):
            inst.pipeline = mode

    def stage_measured(self, key: str, load: float) -> None:
        """The share of the node's compute the stage held under `key` took, as the node
        measured it (`busy.BusyMeter`): it replaces the planned figure in `stage_load`."""
        if key in self.state.loads:
            self.state.loads[key] = min(1.0, max(0.0, load))
            self.state.publish_stage_load()

    # --- requests held out of the batches (live migration) ------------------------------------
    def park(self, instance_id: str, request_id: str) -> RequestView | None:
        """Take a request out of its instance's batches, its memory still counted: a live
        migration's destination before the commit, or its source while the commit is asked.
        The request's view (None: not on that instance), for `unpark` or `commit_parked`."""
        inst = self.state.find(instance_id)
        view = next((r for r in inst.requests if r.request_id == request_id), None) \
            if inst is not None else None
        if view is not None:
            inst.requests.remove(view)
        return view

    def unpark(self, instance_id: str, view: RequestView) -> bool:
        """A parked request goes back into its instance's batches as it was (False: the
        instance is gone)."""
        inst = self.state.find(instance_id)
        if inst is None:
            return False
        inst.requests.append(view)
        return True

    def commit_parked(self, instance_id: str, view: RequestView, generated: int,
                      now: float) -> bool:
        """A migrated request joins its instance's batches, prefilled, with `generated` output
        tokens (its KV computed here); False: the instance is gone."""
        inst = self.state.find(instance_id)
        if inst is None:
            return False
        view.generated, view.prefilled = generated, True
        inst.requests.append(view)
        inst.last_active = now
        return True
