"""The chaos soak's harness (bench/chaos.py) for about a minute on the fault tests' stack, with
two faults (a node, then the gateway): its accounting adds up and nothing is lost, answered twice,
hung or wrong. The 30-minute soak is a benchmark; this keeps its harness from rotting."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from bench.chaos import MUST_BE_ZERO, OUTCOMES, ChaosPlan, chaos, register_adapter, table
from services.stack import Stack
from tests.faults.conftest import REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

# Seed 4 picks node-1, then the gateway, from these targets.
PLAN = ChaosPlan(minutes=0.75, fault_every_s=25.0, down_s=2.0, warmup_s=10.0, clients=3, seed=4,
                 targets=("node-1", "gateway"), request_timeout_s=REQUEST_TIMEOUT_S)


def test_a_minute_of_chaos_loses_nothing(fault_stack: Stack, tmp_path):
    fault_stack.heal()
    adapter = register_adapter(fault_stack, tmp_path)
    result = asyncio.run(chaos(fault_stack, PLAN, adapter))
    counts, faults = result["counts"], result["faults"]
    detail = f"{counts}\n{result['clear_errors']}\n{faults}\n{result['examples']}"
    assert [f["target"] for f in faults] == ["node-1", "gateway"], detail
    assert all(f["served_s"] is not None and f["problem"] is None for f in faults), detail
    assert result["healed_at_end"], detail
    assert counts["sent"] == sum(counts[o] for o in OUTCOMES), detail
    assert {o: counts[o] for o in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), detail
    assert counts["completed"] > 0 and counts["rejected"] > 0, detail
    # The gateway's kill was seen by the clients, and told apart from a loss.
    assert counts["cut_by_gateway_kill"] + counts["refused_gateway_down"] > 0, detail
    # Every process's memory, before and after (the restarted ones in their new process).
    assert set(result["rss"]) == set(fault_stack.names), result["rss"]
    assert result["rss"]["gateway"]["killed"] == 1 and result["rss"]["node-1"]["killed"] == 1
    # The report renders from the result.
    result |= {"command": "test", "machine": "test", "date": "today", "nodes": 2,
               "load_average": {"before": [0.0], "after": [0.0]}, "plan": asdict(PLAN)}
    assert "| lost | 0 |" in table(result)
