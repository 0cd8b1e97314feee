"""NodeScheduler's parking of a request outside its instance's batches (a live migration's two
sides) and the pipeline a node records for an instance: the node worker edits the core's
request lists only through these."""

from dataclasses import replace

from shared.core.iteration import IterationKind
from shared.core.types import Hardware, PipelineMode

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request


def _two_requests():
    spec = model("m")
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)))
    iid = loaded(sched, None, request("a", ttft=5.0), spec)
    sched.admit(request("b", ttft=5.0), iid, spec, 0.0)
    return sched, iid


def _batched(sched, now: float) -> set[str]:
    """Every request the next iterations run (prefills first, then one decode)."""
    seen: set[str] = set()
    for _ in range(4):
        plan = sched.step(now)
        if plan.iteration is None:
            break
        seen |= set(plan.iteration.request_ids)
        sched.finish_iteration(plan.iteration, now + 0.01)
        now += 0.01
        if plan.iteration.kind is IterationKind.DECODE:
            break
    return seen


def test_a_parked_request_keeps_its_memory_but_leaves_the_batches_until_unparked():
    sched, iid = _two_requests()
    budget = sched.ledger.budget
    view = sched.park(iid, "b")
    assert view is not None and view.request_id == "b"
    assert sched.ledger.budget == budget  # still counted
    assert _batched(sched, 0.0) == {"a"}
    assert sched.park(iid, "b") is None  # not in the batches any more
    assert sched.unpark(iid, view)
    assert "b" in _batched(sched, 1.0)


def test_commit_parked_joins_the_batches_prefilled_with_its_tokens():
    sched, iid = _two_requests()
    view = sched.park(iid, "b")
    assert sched.commit_parked(iid, view, generated=7, now=2.0)
    inst = sched.node.instance(iid)
    assert view in inst.requests and view.prefilled and view.generated == 7
    assert inst.last_active == 2.0
    assert not sched.commit_parked("gone", view, 1, 3.0)
    assert not sched.unpark("gone", view)
    assert sched.park("gone", "a") is None


def test_set_pipeline_replaces_a_planned_pipeline_and_clears_it():
    sched, iid = _two_requests()
    mode = PipelineMode(hops=2, hop_latency_s=0.001, hop_bytes_per_s=1e9, token_bytes=8192,
                        until=9.0, helpers=("h",))
    sched.set_pipeline(iid, mode)  # no pipeline planned for it: nothing to replace
    assert sched.node.instance(iid).pipeline is None
    sched.node.instance(iid).pipeline = mode
    formed = replace(mode, hops=4, stages=("h:1",))
    sched.set_pipeline(iid, formed)
    assert sched.node.instance(iid).pipeline == formed
    sched.set_pipeline(iid, None)
    assert sched.node.instance(iid).pipeline is None
