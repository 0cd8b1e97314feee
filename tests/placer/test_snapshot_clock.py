"""One clock convention for node views on the wire (issue 22 #11): a node publishes its view as a
snapshot (times relative to its heartbeat) and a reader rebases it onto its own clock. A node
whose clock is 1000 s ahead of the placer's is placed on exactly as one with no offset. Pure: the
encode/decode that `publish_node`, `read_nodes` and the command replies use, no servers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.cluster import decode_node, decode_reply, encode_node, encode_reply
from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.placement import place
from shared.core.types import Hardware, NodeView
from shared.schemas import NodeReply

from tests.core.factories import flat_profile, model, node, perf_for, request

T = 1_700_000_000.0  # the placer's clock now
SPEC, OTHER = model("m", weight_gb=10), model("o", weight_gb=10)
PERF = perf_for(flat_profile("m", Hardware.GPU, prefill_s=0.3, decode_s=0.02, load_s=1.0),
                flat_profile("o", Hardware.GPU, prefill_s=0.3, decode_s=0.02, load_s=1.0))


def _node_view(offset: float) -> NodeView:
    """A GPU node as its own clock (the placer's + `offset`) saw it at the placer's T: an
    instance of m mid-prefill (busy until T + 0.25), an instance of o still loading (ready about
    T + 0.98), requests that arrived on the node's clock."""
    sched = node("g0", Hardware.GPU, 80, PERF)
    t = T + offset
    res = sched.admit(request("r1", "m", arrival=t - 0.05, ttft=2.0), None, SPEC, t - 0.05)
    for op in res.start_ops:
        sched.memop_done(op, t - 0.05)
    assert sched.step(t - 0.05).iteration is not None  # r1's prefill, until t + 0.25
    loading = sched.admit(request("r2", "o", arrival=t - 0.02, ttft=3.0), None, OTHER, t - 0.02)
    assert loading.admission.ok
    view = sched.view()
    view.heartbeat = t
    return view


def _plan(view: NodeView, arriving: float):
    plan = place(request("c", "m", arrival=arriving, ttft=1.0), SPEC,
                 DecisionContext([view], PERF, T, CoreConfig()))
    return plan.action, plan.node_id, plan.instance_id, plan.admission, \
        [(a.node_id, a.instance_id, a.reason) for a in plan.attempts]


@pytest.mark.parametrize("offset", [1000.0, -1000.0, 3600.0 * 24])
def test_a_node_with_an_offset_clock_is_placed_on_as_one_without(offset):
    same = decode_node(encode_node(_node_view(0.0)), T)
    offset_view = decode_node(encode_node(_node_view(offset)), T)
    expected = _plan(same, T)
    assert expected[0].value == "route"  # c fits after r1's prefill: a real decision to match
    assert _plan(offset_view, T) == expected
    assert offset_view.busy_until == pytest.approx(same.busy_until, abs=1e-6)
    assert offset_view.heartbeat == T


def test_the_same_clock_gets_the_nodes_times_back_exactly_however_old_the_snapshot():
    view = _node_view(0.0)
    for age in (0.0, 0.4, 2.5):
        back = decode_node(encode_node(view), T + age)
        assert back == view  # bit for bit: an old snapshot's iteration has ended by now


def test_a_command_replys_view_follows_the_same_convention():
    reply = NodeReply(True, "admitted", "i", node=_node_view(1000.0))
    back = decode_reply(encode_reply(reply), T)
    assert back.node is not None
    same = decode_node(encode_node(_node_view(0.0)), T)
    assert back.node.busy_until == pytest.approx(same.busy_until)
    assert decode_reply(encode_reply(replace(reply, node=None)), T).node is None
