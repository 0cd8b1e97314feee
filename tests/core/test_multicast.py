"""λScale's multicast plans: the binomial pipeline's step count, one block in and out per node
per step, only holders forward, k-way orders and execution pipelines (Algorithms 1 and 2)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.multicast import (binomial_schedule, binomial_steps, execution_pipelines,
                                   kway_orders, multicast_seconds, steps_of, subgroups)


def _replay(n: int, order: list[int], schedule) -> list[set[int]]:
    """Check the schedule's rules while replaying it; returns what each node holds at the end."""
    have = [set(order)] + [set() for _ in range(n - 1)]
    by_step = defaultdict(list)
    for t in schedule:
        by_step[t.step].append(t)
    for step in sorted(by_step):
        sends = by_step[step]
        assert len({t.src for t in sends}) == len(sends)  # one block out per node per step
        assert len({t.dst for t in sends}) == len(sends)  # one block in per node per step
        for t in sends:
            assert t.block in have[t.src] and t.block not in have[t.dst]  # only holders forward
        for t in sends:
            have[t.dst].add(t.block)
    return have


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("blocks", [1, 2, 3, 8, 17, 32])
def test_powers_of_two_finish_in_b_plus_log_n_minus_one_steps(n, blocks):
    order = list(range(blocks))
    schedule = binomial_schedule(n, order)
    assert all(h == set(order) for h in _replay(n, order, schedule))
    assert steps_of(schedule) == binomial_steps(n, blocks)


@given(n=st.integers(2, 40), blocks=st.integers(1, 24))
@settings(max_examples=150, deadline=None)
def test_any_group_gets_every_block_within_a_few_steps_of_the_bound(n, blocks):
    order = list(range(blocks))[::-1]  # any transfer order
    schedule = binomial_schedule(n, order)
    assert all(h == set(order) for h in _replay(n, order, schedule))
    assert binomial_steps(n, blocks) <= steps_of(schedule) <= binomial_steps(n, blocks) + 4
    assert steps_of(schedule) <= blocks * (n - 1)  # never more than sending n - 1 copies in turn


def test_kway_orders_shift_the_chunks_so_subgroups_start_on_different_parts():
    assert kway_orders(4, 2) == [[0, 1, 2, 3], [2, 3, 0, 1]]  # λScale Fig. 5
    orders = kway_orders(10, 3)
    assert all(sorted(o) == list(range(10)) for o in orders)
    assert [o[0] for o in orders] == [0, 4, 8]


def test_execution_pipelines_take_one_node_from_each_subgroup():
    groups = subgroups(8, 2)  # λScale Fig. 5: sources 0 and 1, destinations split 3 + 3
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert execution_pipelines(groups) == [[2, 3], [4, 5], [6, 7]]
    assert execution_pipelines(subgroups(6, 2)) == [[2, 3], [4, 5]]
    assert execution_pipelines(subgroups(7, 3)) == [[3, 4, 5], [6]]


def test_multicast_time_grows_with_log_n_not_n():
    gb = 26 * 10**9  # a 13B model in 16-bit
    one = multicast_seconds(gb, 16, 2, 50e9)
    eight = multicast_seconds(gb, 16, 8, 50e9)
    assert eight / one == pytest.approx((16 + 3 - 1) / 16)
    assert eight < 1.0  # 13B to 8 nodes over 400 Gb/s links in under a second (λScale)
