"""Receivers hosting layers for each other (λScale Algorithm 2, shared/core/pipeline.py
`receiver_plan`, shared/core/startup.py `plan_receiver_pipeline`): the k-way orders give each
sub-group's receivers a different part of the model first, so the receivers of one execution
pipeline together hold every layer long before any holds the whole model; each heads its own
instance, the others of its pipeline that joined before it host the layers it lacks."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from shared import wire
from shared.core.config import CoreConfig
from shared.core.multicast import arrival_steps, head_first, kway_schedule
from shared.core.pipeline import (StageRange, head_spans, layers_held, model_layout,
                                  receiver_plan, transfer_hops)
from shared.core.cost import helper_bytes, hosted_layer_bytes, stage_bytes
from shared.core.startup import StartupMethod, choose_startup, receivers_in_order, with_startup
from shared.schemas import CommandKind, NodeCommand

from tests.core.factories import GB, SPLIT_PROFILE, SPLIT_SPEC, context, perf_for, tiered_gpu

LINK = 2.5 * GB  # 20 Gb/s: a 0.5 GB block a 0.2 s step, well above the pipeline's setup
CFG = CoreConfig(enable_pipeline=True, enable_receiver_pipelines=True)
SPEC, PROFILE = SPLIT_SPEC, SPLIT_PROFILE
PERF = perf_for(PROFILE)


def gpu(node_id: str, holds: dict[str, str] | None = None, memory_gb: float = 80,
        arriving: dict[str, float] | None = None):
    return tiered_gpu(node_id, LINK, holds, memory_gb, arriving)


def layout(layers: int = 32, blocks: int = 16, head_fraction: float = 0.125):
    tensors, cut = model_layout(8 * GB, layers, int(8 * GB * head_fraction), blocks)
    return tensors, cut, head_first(cut, head_spans(tensors))


def test_hops_count_every_change_of_node_including_the_return_to_the_head():
    assert transfer_hops([StageRange("a", 0, 4), StageRange("b", 4, 8)], "a") == 2
    assert transfer_hops([StageRange("a", 0, 2), StageRange("b", 2, 4), StageRange("a", 4, 8)],
                         "a") == 2
    assert transfer_hops([StageRange("b", 0, 1), StageRange("a", 1, 4), StageRange("c", 4, 8)],
                         "a") == 4
    assert transfer_hops([StageRange("a", 0, 8)], "a") == 0


def test_the_layout_puts_the_head_at_both_ends_and_head_first_sends_those_blocks_first():
    tensors, cut, first = layout()
    assert tensors[0].name == "model.embed_tokens.weight" and tensors[-1].name == "lm_head.weight"
    assert sum(t.end - t.start for t in tensors) == cut[-1].end
    assert first[0] == 0 and first[-1] == len(cut) - 1


def test_the_papers_two_to_eight_example_forms_three_pipelines_serving_about_half_way():
    """λScale Fig. 5: 2 sources, 6 receivers in two sub-groups sending complementary halves
    first: pipelines (2, 3), (4, 5), (6, 7), each serving long before its copy is whole."""
    tensors, cut, first = layout()
    plans = {r: receiver_plan(8, 2, r, tensors, cut, 32, first) for r in range(2, 8)}
    assert {p.members for p in plans.values()} == {(2, 3), (4, 5), (6, 7)}
    for r, plan in plans.items():
        assert plan.serve_step is not None and plan.serve_step <= 0.7 * plan.full_step
        assert plan.stages[0].node == str(r) or plan.stages[0].start == 0
        other = next(m for m in plan.members if m != r)
        assert set(plan.hosted()) == {other} and plan.hops == 2
    # One source: every receiver gets the same order, and a pipeline helps only in the steps the
    # binomial spread leaves receivers holding different blocks.
    single = receiver_plan(3, 1, 2, tensors, cut, 32, first)
    assert single.serve_step is None or single.serve_step < single.full_step


def test_a_receiver_alone_in_its_pipeline_or_among_receivers_without_room_waits_for_its_copy():
    tensors, cut, first = layout()
    assert receiver_plan(3, 2, 2, tensors, cut, 32, first).serve_step is None  # alone
    free = receiver_plan(4, 2, 3, tensors, cut, 32, first)
    hosted = free.hosted()[2]
    tight = receiver_plan(4, 2, 3, tensors, cut, 32, first, room={2: hosted * 10 - 1},
                          layer_bytes=10)
    assert tight.serve_step is None or tight.serve_step > free.serve_step
    enough = receiver_plan(4, 2, 3, tensors, cut, 32, first, room={2: hosted * 10},
                           layer_bytes=10)
    assert enough == free


def test_the_placer_sees_a_burst_receiver_serve_through_the_receiver_before_it():
    """Two sources with no room for a stage: without receiver pipelines the second receiver
    waits for its copy; with them it serves through the first one (the other sub-group: the
    other half first) sooner, validated with its hops, and the first one holds its ranges' K/V."""
    cramped = stage_bytes(SPEC) / GB * 0.5
    sources = [gpu("s0", {"m": "dram"}, memory_gb=cramped), gpu("s1", {"m": "dram"}, memory_gb=cramped)]
    first = gpu("g1")
    nodes = [*sources, first, gpu("g2")]
    c1 = choose_startup(first, SPEC, PROFILE, context(nodes, CFG))
    assert c1.method is StartupMethod.MULTICAST  # nobody can host for it yet
    nodes[2] = with_startup(first, "m", c1)
    c2 = choose_startup(nodes[3], SPEC, PROFILE, context(nodes, CFG))
    assert c2.method is StartupMethod.PIPELINE and c2.pipeline.helpers == ("g1",)
    mode = c2.pipeline
    assert mode.hops >= 2 and mode.until < c1.load_s
    assert {r.helper for r in mode.ranges} == {"g1"}
    hosted = sum(r.end - r.start for r in mode.ranges)
    assert 0 < hosted < SPEC.layers
    assert helper_bytes(SPEC, mode) == {"g1": hosted * hosted_layer_bytes(SPEC)}
    sent = wire.decode(NodeCommand, wire.encode(NodeCommand(CommandKind.ADMIT, pipeline=mode)))
    assert sent.pipeline == mode  # the ranges travel with the ADMIT
    assert mode.until < c2.arrive_s < c1.load_s  # serves before its copy is even in
    off = choose_startup(nodes[3], SPEC, PROFILE,
                         context(nodes, replace(CFG, enable_receiver_pipelines=False)))
    assert off.method is StartupMethod.MULTICAST
    full_g1 = replace(nodes[2], budget_bytes=nodes[2].memory_bytes)  # no room left on g1
    assert choose_startup(nodes[3], SPEC, PROFILE,
                          context([*sources, full_g1, nodes[3]], CFG)).method \
        is StartupMethod.MULTICAST


def test_receivers_join_in_the_order_of_their_arrival_estimates():
    a, b, c = gpu("a", arriving={"m": 2.0}), gpu("b", arriving={"m": 1.0}), gpu("c")
    d = gpu("d", arriving={"m": 1.0})
    assert [n.node_id for n in receivers_in_order(SPEC, [a, b, c, d])] == ["b", "d", "a"]
    assert [n.node_id for n in receivers_in_order(SPEC, [a, b, c, d], "b")] == ["d", "a"]


# Most generated joiners get a pipeline (`--hypothesis-show-statistics`); the explicit example's
# three do, so every run checks the stages.
@settings(max_examples=60, deadline=None)
@example(k=1, dests=3, layers=16, blocks=12, head=0.1, rooms=[40] * 7)
@given(k=st.integers(1, 4), dests=st.integers(1, 7), layers=st.integers(2, 40),
       blocks=st.integers(4, 24), head=st.floats(0.02, 0.4),
       rooms=st.lists(st.integers(0, 40), min_size=7, max_size=7))
def test_every_joiners_pipeline_covers_each_layer_once_from_held_layers_within_room(
        k, dests, layers, blocks, head, rooms):
    """Receivers join one at a time (the placer's order), each planned with what the earlier
    plans left of every receiver's room: each plan's stages cover 0..L-1 exactly once in order,
    every range on a member of its pipeline holding those layers at the serve step, the head
    first holding the head; no receiver hosts more than its room."""
    tensors, cut, first = layout(layers, blocks, head)
    left = {k + i: rooms[i] for i in range(dests)}  # in layers' K/V units (layer_bytes = 1)
    pipelines = 0
    for j in range(dests):
        n = k + j + 1
        plan = receiver_plan(n, k, n - 1, tensors, cut, layers, first, room=dict(left),
                             layer_bytes=1)
        assert plan.full_step >= 1 and n - 1 in plan.members
        if plan.serve_step is None:  # it waits for its whole copy
            continue
        pipelines += 1
        assert plan.serve_step < plan.full_step
        assert plan.stages[0].start == 0 and plan.stages[-1].end == layers
        assert all(a.end == b.start for a, b in zip(plan.stages, plan.stages[1:]))
        got = arrival_steps(kway_schedule(n, k, len(cut), first))
        for s in plan.stages:
            m = int(s.node)
            assert m in plan.members
            held = layers_held(tensors, cut, {b for b, t in got[m].items()
                                              if t < plan.serve_step})
            assert set(range(s.start, s.end)) <= held.layers
            if m == n - 1:
                assert held.head
        assert plan.hops == transfer_hops(list(plan.stages), str(n - 1)) >= 2
        for m, r in plan.hosted().items():
            assert m != n - 1 and r <= left[m]
            left[m] -= r
    assert all(v >= 0 for v in left.values())
    event(f"some joiner got a pipeline: {pipelines > 0}")
