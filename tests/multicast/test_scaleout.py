"""λScale's model multicast on real processes: one source and four destinations, each its own
`python -m services.node.multicast` process, a real nats-server for the control, TCP on loopback
for the blocks, the `small` demo model.

- A scale-out to four nodes follows the binomial plan block for block and leaves, on every
  destination, the model in the loader's DRAM tier with every tensor byte-identical to the
  model's safetensors.
- Two sources (λScale's k-way transfer): each leads a sub-group with its own binomial pipeline,
  the second starting from the second half of the blocks; the same identical result.
- A destination killed mid-transfer fails with a clear reason; the others complete (a repair
  plan among the survivors), byte-identical, and nothing hangs.
- The source killed while the destinations together hold only part of the model: every
  destination fails with the blocks it lost, none keeps a partial copy in its DRAM tier.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from services.placer.multicast import multicast
from shared.core.multicast import binomial_schedule, binomial_steps, kway_schedule
from shared.subjects import multicast_events_subject

from tests.multicast.conftest import ask

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOURCE = "src"
SECOND = "s1"  # the second source of the k-way test
DESTS = ["d1", "d2", "d3", "d4"]
# Paces every sending connection in the failure tests (about 0.4 s per 11.5 MB block), so a kill
# after a few blocks lands well before the end; the kill itself waits for the victim's blocks.
PACED = 30e6


async def _fresh(endpoints, nc, model) -> None:
    """Every endpoint up (a node killed by an earlier test restarted) and no destination
    holding the model from an earlier test."""
    await endpoints.ready(nc, [SOURCE, SECOND, *DESTS])
    for node in DESTS:
        assert (await ask(nc, node, {"op": "drop", "model_path": str(model)}))["ok"]


async def _expect_identical(nc, model, nodes, digests) -> None:
    for node in nodes:
        got = await ask(nc, node, {"op": "digest", "model_path": str(model)}, timeout=120)
        assert got["ok"], got
        assert got["tier"] == "dram", f"{node} loaded from {got['tier']}, not the DRAM tier"
        assert got["tensors"] == digests, f"{node} holds different tensors"


async def test_a_four_node_scale_out_follows_the_binomial_plan_and_leaves_identical_tensors(
        endpoints, nc, small_model, small_digests):
    await _fresh(endpoints, nc, small_model)
    report = await multicast(nc, str(small_model), SOURCE, DESTS, timeout_s=300)
    assert report.ok, report.failed
    assert report.blocks == 16 and report.epochs == 1
    assert report.planned_steps == binomial_steps(5, 16)
    # Every block came from the node the binomial plan names (node 0 the source, then DESTS).
    nodes = [SOURCE, *DESTS]
    planned = {(nodes[t.dst], t.block): nodes[t.src] for t in binomial_schedule(5, list(range(16)))}
    got = {(d.node, b): src for d in report.destinations for b, src in d.block_sources.items()}
    assert got == planned
    sent = Counter(got.values())
    assert sent[SOURCE] < len(DESTS) * 16  # destinations forwarded what they had
    assert all(sent[d] > 0 for d in DESTS)
    for d in report.destinations:
        assert d.registered and d.seconds is not None and d.error is None
        assert sorted(d.block_seconds) == list(range(16))
    await _expect_identical(nc, small_model, DESTS, small_digests)


async def test_two_sources_send_to_their_subgroups_in_the_shifted_order(
        endpoints, nc, small_model, small_digests):
    sources = [SOURCE, SECOND]
    await _fresh(endpoints, nc, small_model)
    report = await multicast(nc, str(small_model), sources, DESTS, timeout_s=300)
    assert report.ok, report.failed
    assert report.sources == tuple(sources) and report.epochs == 1
    nodes = [*sources, *DESTS]
    planned = {(nodes[t.dst], t.block): nodes[t.src] for t in kway_schedule(6, 2, 16)}
    got = {(d.node, b): src for d in report.destinations for b, src in d.block_sources.items()}
    assert got == planned
    # Sub-group of s1 (d2, d4) started on the second chunk: its first blocks are 8.., not 0..
    for d in report.destinations:
        first = min(d.block_seconds, key=d.block_seconds.get)
        assert (first >= 8) == (d.node in ("d2", "d4")), (d.node, first)
    await _expect_identical(nc, small_model, DESTS, small_digests)


async def _multicast_killing(nc, endpoints, small_model, victim: str, watched: str,
                             after_blocks: int):
    """Run a paced multicast and SIGKILL `victim` once `watched` has verified `after_blocks`
    blocks; returns (report, blocks `watched` held at the kill)."""
    held: dict[str, int] = Counter()
    killed: dict[str, int] = {}

    async def on_event(msg) -> None:
        event = json.loads(msg.data)
        if event.get("kind") == "block":
            held[event["node"]] += 1
            if event["node"] == watched and held[watched] >= after_blocks and not killed:
                endpoints.kill(victim)
                killed[victim] = held[watched]

    sub = await nc.subscribe(multicast_events_subject("*"), cb=on_event)
    try:
        report = await asyncio.wait_for(
            multicast(nc, str(small_model), SOURCE, DESTS, timeout_s=240,
                      rate_bytes_per_s=PACED), 300)
    finally:
        await sub.unsubscribe()
    summary = report.to_dict()
    print({k: v for k, v in summary.items() if k != "destinations"},
          [(d["node"], d["seconds"], d["error"]) for d in summary["destinations"]])
    assert victim in killed, "the transfer ended before the kill"
    return report, killed[victim]


async def test_a_destination_killed_mid_transfer_fails_and_the_others_still_complete(
        endpoints, nc, small_model, small_digests):
    await _fresh(endpoints, nc, small_model)
    # The victim: the destination that forwards most in the plan.
    sends = Counter(t.src for t in binomial_schedule(5, list(range(16))) if t.src != 0)
    victim = DESTS[sends.most_common(1)[0][0] - 1]
    report, at_kill = await _multicast_killing(nc, endpoints, small_model, victim, victim, 3)
    assert 3 <= at_kill < 16
    assert set(report.failed) == {victim}
    assert "lost during the transfer" in report.failed[victim]
    assert report.epochs >= 2  # the survivors finished on a repair plan
    survivors = [d for d in DESTS if d != victim]
    for d in report.destinations:
        if d.node in survivors:
            assert d.ok and d.registered and sorted(d.block_seconds) == list(range(16))
    await _expect_identical(nc, small_model, survivors, small_digests)


async def test_the_source_killed_early_fails_every_destination_with_the_blocks_it_lost(
        endpoints, nc, small_model):
    await _fresh(endpoints, nc, small_model)
    report, at_kill = await _multicast_killing(nc, endpoints, small_model, SOURCE, DESTS[0], 2)
    assert at_kill < 16
    assert set(report.failed) == set(DESTS)
    for d in report.destinations:
        assert not d.ok and not d.registered
        assert "held only by lost nodes (src)" in d.error, d.error
    # The endpoints forgot the transfer and kept no partial copy: a load reads from storage.
    for node in DESTS:
        got = await ask(nc, node, {"op": "load", "model_path": str(small_model)})
        assert got["ok"] and got["tier"] == "registry", got
