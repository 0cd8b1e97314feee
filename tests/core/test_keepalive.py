"""Keep-alive per instance (Ollama's semantics) and pinning, in the node's core: the window a
model was registered with, a request's own keep_alive overriding it, 0 and negative windows,
pinned instances never reclaimed nor preempted, and the admin's unload-now."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.consolidation import preemption_victims
from shared.core.keepalive import FOREVER, parse_keep_alive, pin_shortfall
from shared.core.memory import MemOpKind
from shared.core.types import Hardware, InstanceStatus, InstanceView, NodeView

from tests.core.factories import flat_profile, loaded, model, node, perf_for, request

DEFAULT_S = 1.0


def _idle_instance(spec, keep_alive_s=None, config_s=DEFAULT_S):
    """A node with one instance of `spec` that served one request (keep_alive as given) and
    went idle at t=0.2."""
    sched = node(perf=perf_for(flat_profile(spec.name, Hardware.GPU)),
                 config=CoreConfig(keep_alive_s=config_s))
    iid = loaded(sched, None, replace(request("a", spec.name, max_tokens=1),
                                      keep_alive_s=keep_alive_s), spec)
    plan = sched.step(0.0)
    sched.finish_iteration(plan.iteration, 0.2, finished={"a"})
    for op in sched.ledger.running():  # a lazy KV shrink on finishing: done before the clock
        sched.memop_done(op, 0.2)
    return sched, iid


def _reclaimed(sched, iid, now):
    ops = sched.reclaim_idle(now)
    return any(o.kind is MemOpKind.UNLOAD and o.instance_id == iid for o in ops)


def test_registered_keep_alive_replaces_the_default():
    sched, iid = _idle_instance(replace(model("m"), keep_alive_s=5.0))
    assert sched.next_reclaim_at() == pytest.approx(5.2)
    assert not _reclaimed(sched, iid, 1.5)  # the default (1 s) has passed: still loaded
    assert _reclaimed(sched, iid, 5.2)


def test_request_keep_alive_overrides_the_model():
    sched, iid = _idle_instance(replace(model("m"), keep_alive_s=5.0), keep_alive_s=30.0)
    assert sched.next_reclaim_at() == pytest.approx(30.2)
    assert not _reclaimed(sched, iid, 10.0)
    assert _reclaimed(sched, iid, 30.2)


def test_the_last_request_sets_the_window():
    spec = model("m")
    sched, iid = _idle_instance(spec, keep_alive_s=30.0)
    loaded(sched, iid, request("b", arrival=1.0, max_tokens=1), spec, now=1.0)  # the model's
    plan = sched.step(1.0)
    sched.finish_iteration(plan.iteration, 1.2, finished={"b"})
    for op in sched.ledger.running():
        sched.memop_done(op, 1.2)
    assert sched.next_reclaim_at() == pytest.approx(1.2 + DEFAULT_S)


def test_keep_alive_zero_unloads_as_soon_as_idle():
    sched, iid = _idle_instance(model("m"), keep_alive_s=0.0)
    assert sched.next_reclaim_at() == pytest.approx(0.2)
    assert _reclaimed(sched, iid, 0.2)
    assert sched.view().instance(iid).status is InstanceStatus.UNLOADING


def test_negative_keep_alive_never_unloads():
    sched, iid = _idle_instance(model("m"), keep_alive_s=FOREVER)
    assert sched.next_reclaim_at() is None
    assert not _reclaimed(sched, iid, 1e9)


def test_pinned_instance_is_never_reclaimed_nor_preempted():
    spec = replace(model("m"), min_instances=1)
    sched, iid = _idle_instance(spec, keep_alive_s=0.0)  # pinning outranks the request's window
    assert sched.next_reclaim_at() is None
    assert not _reclaimed(sched, iid, 1e9)
    inst = sched.view().instance(iid)
    assert inst.pinned and inst.status is InstanceStatus.READY
    assert sched.ledger.budget >= spec.weight_bytes  # its memory stays counted
    busy = replace(inst, instance_id="other", pinned=False,
                   requests=[request("x"), request("y")])
    view = sched.view()
    view.instances.append(busy)
    assert preemption_victims(view, busy) == []


def test_unpinned_idle_instance_is_a_preemption_victim():
    sched, iid = _idle_instance(model("m"))  # the control for the test above
    view = sched.view()
    busy = replace(view.instance(iid), instance_id="other", requests=[request("x")])
    view.instances.append(busy)
    assert [v.instance_id for v in preemption_victims(view, busy)] == [iid]


def test_unload_model_unloads_idle_now_and_busy_when_done():
    spec = replace(model("m"), min_instances=1)
    sched, idle = _idle_instance(spec)
    busy = loaded(sched, None, request("b", arrival=0.3, max_tokens=4), spec, now=0.3)
    ops = sched.unload_model("m", 0.4)
    assert [o.instance_id for o in ops if o.kind is MemOpKind.UNLOAD] == [idle]
    assert sched.view().instance(busy).status is not InstanceStatus.UNLOADING
    plan = sched.step(0.5)
    while plan.iteration is not None:
        sched.finish_iteration(plan.iteration, 0.6, finished={"b"})
        plan = sched.step(0.6)
    for op in sched.ledger.running():
        sched.memop_done(op, 0.6)
    assert _reclaimed(sched, busy, 0.6)  # window 0, no longer pinned


@pytest.mark.parametrize("text,seconds", [
    (300, 300.0), (0, 0.0), (2.5, 2.5), ("300", 300.0), ("0", 0.0), ("5m", 300.0),
    ("1h", 3600.0), ("1h30m", 5400.0), ("30s", 30.0), ("250ms", 0.25), ("1.5m", 90.0),
    (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER)])
def test_parse_keep_alive(text, seconds):
    assert parse_keep_alive(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "5x", "m", "5 m", "five", True, None, [1], float("nan"),
                                 float("inf"), "inf", "5m garbage"])
def test_parse_keep_alive_refuses(bad):
    with pytest.raises(ValueError):
        parse_keep_alive(bad)


@settings(max_examples=60, deadline=None)
@given(windows=st.lists(st.one_of(st.none(), st.just(FOREVER), st.floats(0, 100)),
                        min_size=1, max_size=4),
       pinned=st.lists(st.booleans(), min_size=4, max_size=4),
       now=st.floats(0, 200))
def test_reclaim_agrees_with_next_reclaim_at(windows, pinned, now):
    """What `reclaim_idle(now)` unloads is exactly the idle instances whose expiry, as each
    one's own window sets it, is at or before `now`; `next_reclaim_at` names the first."""
    sched = node(perf=perf_for(flat_profile("m", Hardware.GPU)),
                 config=CoreConfig(keep_alive_s=DEFAULT_S))
    ids = []
    for k, w in enumerate(windows):
        spec = replace(model("m", weight_gb=0.1), min_instances=int(pinned[k]))
        ids.append(loaded(sched, None, replace(request(f"r{k}", max_tokens=1), keep_alive_s=w),
                          spec))
        for inst in sched.node.instances:  # admitted empty-handed: idle since t=0
            inst.requests.clear()
    expiry = {}
    for k, iid in enumerate(ids):
        w = DEFAULT_S if windows[k] is None else windows[k]
        expiry[iid] = None if pinned[k] or w < 0 else w
    due = [t for t in expiry.values() if t is not None]
    assert sched.next_reclaim_at() == (min(due) if due else None)
    ops = sched.reclaim_idle(now)
    gone = {o.instance_id for o in ops if o.kind is MemOpKind.UNLOAD}
    assert gone == {i for i, t in expiry.items() if t is not None and now >= t}


def test_pin_shortfall_counts_serving_instances_on_nodes_that_take_work():
    spec = model("m")

    def inst(iid, status=InstanceStatus.READY):
        return InstanceView(iid, spec, "n", status)

    up = NodeView("a", Hardware.GPU, 10, instances=[inst("1"), inst("2", InstanceStatus.LOADING),
                                                    inst("3", InstanceStatus.UNLOADING),
                                                    inst("4", InstanceStatus.HANDOVER)])
    draining = NodeView("b", Hardware.GPU, 10, instances=[inst("5")], draining=True)
    assert pin_shortfall({"m": 2}, [up, draining]) == {}  # ready + loading
    assert pin_shortfall({"m": 3, "other": 1}, [up, draining]) == {"m": 1, "other": 1}
    assert pin_shortfall({}, [up]) == {}
