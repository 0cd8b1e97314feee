"""Execute-while-load plans (shared/core/pipeline.py)."""

from __future__ import annotations

from shared.core.multicast import Block
from shared.core.pipeline import (Holding, StageRange, TensorSpan, layers_held, pipeline_stages,
                                  remote_ranges, switch_ready)

# A 3-layer model in one partition: head tensors at both ends, 100 bytes a tensor.
NAMES = ["model.embed_tokens.weight", *[f"model.layers.{i}.{w}" for i in range(3)
                                         for w in ("a", "b")], "model.norm.weight"]
SPANS = [TensorSpan(n, "p0", 100 * i, 100 * i + 100) for i, n in enumerate(NAMES)]
BLOCKS = [Block(i, "p0", 200 * i, 200 * i + 200) for i in range(4)]  # 4 blocks of 200 bytes


def test_a_layer_is_held_once_all_its_bytes_are():
    h = layers_held(SPANS, BLOCKS, {0, 1}, "n")
    # Block 0: embed + layer 0's a; block 1: layer 0's b + layer 1's a.
    assert h.layers == {0} and not h.head
    assert layers_held(SPANS, BLOCKS, {0, 1, 2, 3}).layers == {0, 1, 2}
    assert layers_held(SPANS, BLOCKS, {0, 1, 2, 3}).head
    assert layers_held(SPANS, BLOCKS, set()).layers == frozenset()


def test_a_tensor_across_two_blocks_needs_both():
    spans = [TensorSpan("model.layers.0.w", "p0", 150, 250)]
    assert layers_held(spans, BLOCKS, {0}).layers == frozenset()
    assert layers_held(spans, BLOCKS, {0, 1}).layers == {0}
    assert layers_held([TensorSpan("model.layers.0.w", "p1", 0, 10)], BLOCKS, {0}).layers == \
        frozenset()  # another partition


def test_stages_cover_every_layer_in_order_with_the_head_first_choice():
    a = Holding("a", frozenset({0, 1}), True)
    b = Holding("b", frozenset({1, 2, 3}), False)
    c = Holding("c", frozenset({3, 4, 5}), False)
    plan = pipeline_stages([a, b, c], 6)
    assert plan == [StageRange("a", 0, 2), StageRange("b", 2, 4), StageRange("c", 4, 6)]
    assert remote_ranges(plan, "a") == plan[1:]
    # A gap nobody holds: the pipeline waits.
    assert pipeline_stages([a, Holding("b", frozenset({3}), False)], 4) is None
    # No node with the head: waits; a head without layers cannot run embeddings alone here.
    assert pipeline_stages([b, c], 6) is None
    assert pipeline_stages([Holding("h", frozenset(), True), b], 4) is None


def test_the_head_with_most_layers_leads_and_keeps_its_own_runs():
    small = Holding("s", frozenset({0}), True)
    big = Holding("g", frozenset({0, 1, 3}), True)
    rest = Holding("r", frozenset({2}), False)
    plan = pipeline_stages([small, big, rest], 4)
    assert plan == [StageRange("g", 0, 2), StageRange("r", 2, 3), StageRange("g", 3, 4)]


def test_switch_once_everything_is_held():
    assert switch_ready(Holding("a", frozenset(range(4)), True), 4)
    assert not switch_ready(Holding("a", frozenset(range(4)), False), 4)
    assert not switch_ready(Holding("a", frozenset(range(3)), True), 4)
