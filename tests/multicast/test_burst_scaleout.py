"""λScale's burst scale-out through the real services: a real placer (with burst scale-out on or
off), node workers with their multicast endpoints, loaders and torch engines, on a real
nats-server and valkey, the `small` demo model.

One node (a memory node with no room for an instance) holds the model in its DRAM tier; five
nodes would read it from a slow registry, each with room for one instance. The profile lets an
instance take one request within the TPOT SLO (a second makes a decode round break it), so each
request needs an instance of its own. Two requests arrive together; a moment later, while the
first instances still load, two more.

With burst scale-out on, the placement that starts the second instance finds that the model's
arrivals over that instance's startup outgrow what its instances hold (`shared.core.burst`), so
the placer starts the extra instances at once (START_INSTANCE), all in the one multicast of that
turn; the two later requests join those instances instead of starting their own. Off, each
request starts its own instance, and the later ones need a multicast of their own. Either way
every request gets the tokens a local engine generates for its prompt (greedy).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared.cluster import read_nodes
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.schemas import TokenMessage

from tests.multicast.conftest import small_on_stack, source_and_nodes
from tests.node.harness import submit
from tests.polling import until
from tests.reference import greedy_output
from tests.stack import shut_down

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOURCE = "bs-src"
NODES = ["bs-d0", "bs-d1", "bs-d2", "bs-d3", "bs-d4"]
CONTEXT = 256
PROMPT, MAX_TOKENS = 150, 8
PROMPT_IDS = [5 + i for i in range(PROMPT)]  # what tests.node.harness.submit sends


def _profile() -> Profile:
    """A stand-in profile (decisions are under test, not iteration timing): one request decodes
    in 10 ms a round, two in 2 s (over the 0.5 s TPOT SLO: an instance takes one request); the
    registry read takes 20 s (multicast is the quicker startup) and the engine's start 1.5 s
    (a multicast startup of ~1.7 s: two arrivals a second over it need ~3.4 instances)."""
    return Profile("small", Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 2, 256], [1, 8192], [[0.01, 0.01], [2.0, 2.0], [2.0, 2.0]]),
                   load_s=20.0, engine_init_s=1.5)




@dataclasses.dataclass
class Outcome:
    early: list[str]  # the two requests that arrived together
    late: list[str]  # the two that arrived while the first instances loaded
    finals: dict[str, TokenMessage]
    placer: Placer
    loads: dict[str, list]  # node -> its load records


async def _run(own_servers, small_model, burst: bool) -> Outcome:
    nats_url, redis_url = own_servers
    nc, redis, record = await small_on_stack(own_servers, small_model, CONTEXT, _profile())
    # Room for one instance with a few requests' KV, never for two instances: what limits an
    # instance to one request is the TPOT, which is what the burst's measure reads.
    memory = record.weight_bytes + 1024 * record.kv_bytes_per_token
    assert memory < 2 * record.weight_bytes
    workers = source_and_nodes(SOURCE, NODES, memory, record, own_servers, nc, redis)
    core = CoreConfig(keep_alive_s=120.0, burst_scaleout=burst)
    placer = Placer(PlacerSettings(nats_url, redis_url, core), nc, redis)
    stop = asyncio.Event()
    runner = None
    try:
        for w in workers.values():
            await w.start()
        await asyncio.to_thread(workers[SOURCE].loader.load, record.path)  # the DRAM holder

        async def holder_published() -> bool:
            views = {n.node_id: n for n in await read_nodes(redis)}
            return len(views) == 1 + len(NODES) and \
                views[SOURCE].storage.holds.get("small") == "dram" and \
                all(v.storage.multicast_bytes_per_s > 0 for v in views.values())

        await until(holder_published, what="the holder's DRAM tier in the cluster view")
        finals: dict[str, TokenMessage] = {}
        early = [await submit(nc, "small", PROMPT, MAX_TOKENS, finals, prefix="early")
                 for _ in range(2)]
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        # The turn that placed them is over once it started its multicast.
        await until(lambda: placer.decisions.get("new_instance", 0) >= 2 and not placer.queue
                    and (placer.scaleout.running or placer.multicast_reports),
                    what="the first two requests placed")
        started = 2 + sum(len(b.started) for b in placer.bursts.records)

        async def instances_published() -> bool:  # the next turn decides on the cluster view
            views = await read_nodes(redis)
            return sum(1 for v in views if any(i.model.name == "small" for i in v.instances)) \
                == started

        await until(instances_published, what="the new instances in the cluster view")
        late = [await submit(nc, "small", PROMPT, MAX_TOKENS, finals, prefix="late")
                for _ in range(2)]
        await until(lambda: all(r in finals for r in early + late), timeout_s=240,
                    what="the four requests")
        await until(lambda: not placer.scaleout.running, timeout_s=60, what="the multicasts' reports")
        return Outcome(early, late, finals, placer, {n: list(w.loads) for n, w in workers.items()})
    finally:
        await shut_down(stop, runner, workers.values(), nc, redis)


async def _reference(small_model) -> list[int]:
    return await asyncio.to_thread(greedy_output, small_model, PROMPT_IDS, MAX_TOKENS)


def _served_greedy(out: Outcome, reference: list[int]) -> None:
    for rid in out.early + out.late:
        final = out.finals[rid]
        assert final.error is None, final.error
        assert final.output_token_ids == reference, rid


async def test_a_burst_starts_its_instances_at_once_in_one_multicast_and_later_requests_join(
        own_servers, small_model):
    out = await _run(own_servers, small_model, burst=True)
    _served_greedy(out, await _reference(small_model))
    placer = out.placer
    # The second placement started a burst: its extra instances on nodes serving none yet.
    [burst] = list(placer.bursts.records)
    assert burst.request_id in out.early and burst.instances >= 3, burst
    assert len(burst.started) >= 2 and burst.started == burst.planned
    first = {out.finals[r].node_id for r in out.early}
    assert not first & set(burst.started) and SOURCE not in burst.started
    # One multicast from the holder fed all of them: the two placed instances and the burst's.
    [report] = list(placer.multicast_reports)
    assert report.ok and report.sources == (SOURCE,)
    assert sorted(d.node for d in report.destinations) == sorted(first | set(burst.started))
    # The later requests joined the burst's instances: no instance, no multicast of their own.
    # (Plans are counted, refused ones too: a node re-checks on fresher state than the view the
    # placer read, and a refused request is placed again.)
    assert {out.finals[r].node_id for r in out.late} <= set(burst.started)
    assert len({out.finals[r].node_id for r in out.late}) == 2
    assert placer.decisions.get("route", 0) >= 2
    assert placer.decisions.get("burst_instance") == len(burst.started)
    # Each node loaded once (the burst's waiting for its multicast copy, reading it from DRAM).
    assert all(len(out.loads[n]) == 1 for n in first)
    for node in burst.started:
        [load] = out.loads[node]
        assert (load.expected_tier, load.tier, load.ok) == ("multicast", "dram", True), load


async def test_without_burst_scale_out_each_request_starts_its_own_instance(
        own_servers, small_model):
    out = await _run(own_servers, small_model, burst=False)
    _served_greedy(out, await _reference(small_model))
    placer = out.placer
    assert not placer.bursts.records and "burst_instance" not in placer.decisions
    # Four instances, one per request, each loaded once; the fifth node is untouched.
    assert len({out.finals[r].node_id for r in out.early + out.late}) == 4
    assert sorted(len(out.loads[n]) for n in NODES) == [0, 1, 1, 1, 1]
    assert placer.decisions.get("new_instance", 0) >= 4
    # The first two instances shared a multicast; the later requests' came by another one.
    reports = list(placer.multicast_reports)
    assert len(reports) >= 2 and all(r.ok for r in reports)
    early_nodes = {out.finals[r].node_id for r in out.early}
    assert any({d.node for d in r.destinations} == early_nodes for r in reports)
