"""The placer's decision spans: one `place <model>` span per decision, a child of the gateway's
request span (through the request message's headers), current while the decision is carried
out so node commands carry its context. It starts bare; what was decided and why (every
candidate with the core's admission answer, preemptions and migrations, the chosen node and
instance, the node's answer, the time queued) is written when it ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from services.placer.intake import Pending
from shared import telemetry as tm
from shared.core.placement import PlacementPlan
from shared.core.startup import StartupChoice

_tracer = trace.get_tracer("slinfer.placer")


@contextmanager
def decision_span(p: Pending, plan: PlacementPlan | None) -> Iterator[dict]:
    """The decision's span; yields the dict where carrying it out notes what it learned (the
    node's answer), written as attributes last, off the way to the node."""
    now, tries, last_refusal = time.time(), p.tries, p.last_refusal  # as they were when decided
    span = _tracer.start_span(f"place {p.request.model}", context=p.trace_parent)
    outcome: dict = {}
    with trace.use_span(span, end_on_exit=True):
        try:
            yield outcome
        finally:
            if span.is_recording():
                span.set_attributes({**decision_attributes(p, plan, now, tries, last_refusal),
                                     **outcome})
                if plan is not None:
                    for a in plan.attempts:
                        span.add_event("admission", {"slinfer.node_id": a.node_id,
                                                     "slinfer.instance_id": a.instance_id or "(new)",
                                                     "slinfer.admit_reason": a.reason.value})


def decision_attributes(p: Pending, plan: PlacementPlan | None, now: float, tries: int,
                        last_refusal: str) -> dict:
    """The decision as it was taken at `now`, with the refusals seen before it."""
    req = p.request
    attrs = {tm.MODEL: req.model, "slinfer.request_id": req.request_id,
             "slinfer.placement.queued_s": now - p.received,  # in this placer's queue
             "slinfer.placement.waited_s": now - req.arrival,  # since the gateway took it
             "slinfer.placement.queue_decisions": p.queue_decisions,
             "slinfer.placement.refusals": tries,
             "slinfer.resumed_tokens": len(req.resumed_token_ids)}
    if last_refusal:
        attrs["slinfer.placement.last_refusal"] = last_refusal
    if plan is None:
        return attrs
    attrs["slinfer.placement.action"] = plan.action.value
    attrs["slinfer.placement.attempts"] = [
        f"{a.node_id}/{a.instance_id or '(new)'}: {a.reason.value}" for a in plan.attempts]
    if plan.node_id is not None:
        attrs["slinfer.placement.node_id"] = plan.node_id
        attrs["slinfer.placement.instance_id"] = plan.instance_id or "(new)"
    if plan.admission is not None:
        attrs["slinfer.placement.admit_reason"] = plan.admission.reason.value
        if plan.admission.kv_target_bytes is not None:
            attrs["slinfer.placement.kv_target_bytes"] = plan.admission.kv_target_bytes
    if plan.preempt:
        attrs["slinfer.placement.preempt"] = list(plan.preempt)
        attrs["slinfer.placement.migrations"] = [
            f"{m.request_id}: {m.from_instance} -> {m.to_node}/{m.to_instance}" for m in plan.migrations]
        attrs["slinfer.placement.preempt_live"] = plan.live
        attrs["slinfer.placement.handover_s"] = plan.handover_s
        if plan.preempt_why:
            attrs["slinfer.placement.preempt_why"] = plan.preempt_why
    return attrs


def startup_label(startup: StartupChoice) -> str:
    label = f"{startup.method.value} from {','.join(startup.sources)}"
    if startup.pipeline is not None:
        label += f", layers it lacks on {','.join(startup.pipeline.helpers)}"
    return label
