"""What the core charges for a multicast is what the node workers' schedule takes: a receiver's
arrival is its step in `kway_schedule` (not λScale's b + ceil(log2 n) - 1 bound, which some group
sizes miss by one or two steps), and a pipeline served by a DRAM holder pays the activation hops
of the layers its sub-group's order really brings first (two when the receiver holds the first
layers, four when it holds a middle run)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.core.config import CoreConfig
from shared.core.multicast import arrival_steps, binomial_steps, head_first, kway_schedule
from shared.core.pipeline import (Holding, head_spans, layers_held, model_layout, pipeline_stages,
                                  transfer_hops)
from shared.core.startup import StartupMethod, choose_startup, multicast_arrive_s

from tests.core.factories import GB, SPLIT_PROFILE, SPLIT_SPEC, context, tiered_gpu

BLOCKS = 16
# A link that moves one block per second and no setup: the price in seconds is the steps.
STEP_LINK = SPLIT_SPEC.weight_bytes / BLOCKS
FLAT = CoreConfig(multicast_setup_s=0.0, multicast_blocks=BLOCKS)


def schedule_steps(n: int, k: int, node: int, first: tuple[int, ...] = ()) -> int:
    """Steps after which `node` holds every block in the schedule the node workers run."""
    got = arrival_steps(kway_schedule(n, k, BLOCKS, first))[node]
    return max(got.values()) + 1


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_receivers_arrival_is_priced_at_its_step_in_the_real_schedule(k):
    sources = [tiered_gpu(f"s{i}", STEP_LINK, {"m": "dram"}) for i in range(k)]
    fresh = tiered_gpu("r", STEP_LINK)
    for n in range(max(2, k + 1), 17):
        receivers = n - k  # the priced node joins last: node n - 1 of the plan
        priced = multicast_arrive_s(SPLIT_SPEC.weight_bytes, sources, fresh, receivers, FLAT)
        assert priced == pytest.approx(schedule_steps(n, k, n - 1)), (n, k)


def test_the_power_of_two_bound_is_short_where_the_schedule_is_not_a_hypercube():
    """The case the issue names: 1 -> 5 receivers takes 20 steps; the bound says 18."""
    assert binomial_steps(6, BLOCKS) == 18 and schedule_steps(6, 1, 5) == 20
    holder, fresh = tiered_gpu("s0", STEP_LINK, {"m": "dram"}), tiered_gpu("r", STEP_LINK)
    assert multicast_arrive_s(SPLIT_SPEC.weight_bytes, [holder], fresh, 5, FLAT) \
        == pytest.approx(20)


def holder_pipeline(n: int, k: int) -> tuple[int, int]:
    """(serve step, hops) of receiver n - 1 heading a pipeline whose other layers a DRAM holder
    runs, from the real layout: the blocks travel head-first in its sub-group's order; it serves
    once it holds the head and a layer, running what it holds, the holder the gaps."""
    spec = SPLIT_SPEC
    tensors, cut = model_layout(spec.weight_bytes, spec.layers, spec.head_bytes, BLOCKS)
    got = arrival_steps(kway_schedule(n, k, len(cut), head_first(cut, head_spans(tensors))))[n - 1]
    everything = Holding("holder", frozenset(range(spec.layers)), True)
    for step in sorted(set(got.values())):
        mine = layers_held(tensors, cut, {b for b, s in got.items() if s <= step}, "me")
        if mine.head and mine.layers:
            stages = pipeline_stages([mine, everything], spec.layers, head_node="me")
            return step + 1, transfer_hops(stages, "me")
    raise AssertionError("never serves")


@pytest.mark.parametrize("k,receivers", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 3), (4, 4)])
def test_a_dram_holder_pipeline_pays_the_hops_and_waits_the_steps_of_its_subgroup(k, receivers):
    link = 12.5 * GB
    cfg = CoreConfig(enable_pipeline=True)
    holders = [tiered_gpu(f"s{i}", link, {"m": "dram"}) for i in range(k)]
    on_way = [tiered_gpu(f"w{i}", link, arriving={"m": 1.0}) for i in range(receivers - 1)]
    fresh = tiered_gpu("r", link)
    choice = choose_startup(fresh, SPLIT_SPEC, SPLIT_PROFILE,
                            context([*holders, *on_way, fresh], cfg))
    assert choice.method is StartupMethod.PIPELINE, choice
    serve, hops = holder_pipeline(k + receivers, k)
    assert choice.pipeline.hops == hops
    step = SPLIT_SPEC.weight_bytes / BLOCKS / link
    assert choice.pipeline.until == pytest.approx(
        cfg.multicast_setup_s + serve * step + cfg.pipeline_setup_s + SPLIT_PROFILE.engine_init_s)


def test_a_receiver_that_holds_middle_layers_first_pays_four_hops():
    """The first receiver of one source holds layers 0.. first (itself, then the holder: two
    hops); the second receiver of two sources starts its sub-group's order at the middle chunk,
    and the second of one source is forwarded blocks out of order by its neighbour: the holder,
    itself, the holder again (four)."""
    assert holder_pipeline(2, 1)[1] == 2
    assert holder_pipeline(3, 1)[1] == 4
    assert holder_pipeline(4, 2)[1] == 4
    link = 12.5 * GB
    holders = [tiered_gpu(f"s{i}", link, {"m": "dram"}) for i in range(2)]
    nodes = [*holders, tiered_gpu("w", link, arriving={"m": 1.0}), tiered_gpu("r", link)]
    choice = choose_startup(nodes[-1], SPLIT_SPEC, SPLIT_PROFILE,
                            context(nodes, replace(CoreConfig(), enable_pipeline=True)))
    assert choice.method is StartupMethod.PIPELINE and choice.pipeline.hops == 4
