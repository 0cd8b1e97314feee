"""λScale's Algorithm 2 through the real services: receivers of one multicast host layers for
each other's instances (services/node/pipeline_mode.py), two sources and two receivers, each a
node worker with its multicast endpoint, loader, stage host and the torch engine, a real placer
(receiver pipelines on), a real nats-server and valkey, the `small` demo model.

The two sources hold the model in their DRAM tier and have no room for a stage (so no DRAM
holder can host layers for anyone); each receiver has room for one instance. Two requests
arrive together, each needing an instance of its own (the profile's TPOT SLO): the placer
starts one on each receiver, both fed by one k-way multicast (k = 2, head first, paced to a
slow link), whose sub-groups send different halves of the model first. The first receiver
waits for its copy; the second serves through an execution pipeline whose other stages run on
the first receiver, hosted from the blocks of its own arriving copy (no copy of them, its ledger
holding their K/V only). Its first token comes before its copy is whole; then it takes the
layers back (mode switch) and the first receiver lets its stage go. Every request, the ones
served through the pipeline, from each copy, and one after the switch, gets a local engine's
greedy output.
"""

from __future__ import annotations

import asyncio

import pytest

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from services.node.worker import NodeWorker
from shared.cluster import read_nodes
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.modules import stage_key
from shared.core.types import Hardware

from tests.multicast.conftest import node_settings, small_on_stack, submit_timed
from tests.polling import until
from tests.reference import greedy_output
from tests.stack import shut_down

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20
SOURCES = ["rp-src0", "rp-src1"]
RECEIVERS = ["rp-a", "rp-b"]
CONTEXT, PROMPT, MAX_TOKENS = 256, 150, 8
RATE = 10 * MiB  # every sending connection is paced to this: a receiver's copy takes ~18 s
CORE = CoreConfig(keep_alive_s=120.0, enable_pipeline=True, enable_receiver_pipelines=True)


def _profile() -> Profile:
    """A stand-in profile (the startup is under test, not iteration timing): one request decodes
    in 10 ms a round, two in 2 s (over the 0.5 s TPOT SLO: an instance takes one request); the
    registry read takes 20 s, so the model comes by multicast."""
    return Profile("small", Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 2, 256], [1, 8192], [[0.01, 0.01], [2.0, 2.0], [2.0, 2.0]]),
                   load_s=20.0, engine_init_s=0.05)


def _workers(record, own_servers, nc, redis) -> dict[str, NodeWorker]:
    """Sources with room for half the model (no stage of its layers fits), receivers with room
    for one instance and the K/V of the layers they may host, never for two instances."""
    receiver = record.weight_bytes + 1024 * record.kv_bytes_per_token
    assert receiver < 2 * record.weight_bytes

    def settings(node: str, memory: int):
        return node_settings(node, memory, *own_servers, core=CORE,
                             multicast_link_bytes_per_s=RATE, multicast_rate_bytes_per_s=RATE)

    return {**{s: NodeWorker(settings(s, record.weight_bytes // 2), nc, redis) for s in SOURCES},
            **{r: NodeWorker(settings(r, receiver), nc, redis) for r in RECEIVERS}}


async def _watch_stages(worker: NodeWorker, seen: dict, stop: asyncio.Event) -> None:
    """What `worker` hosts while the test runs: stage key -> (where its weights came from,
    whether they are its own copy's, the most bytes its ledger held for it). The most, not the
    last seen: a sample between a stage's release and its removal reads 0 (a busy box's timing)."""
    while not stop.is_set():
        for key, hosted in list(worker.layers.host.hosted.items()):
            held = max(seen.get(key, (None, None, 0))[2], worker.sched.ledger.target(key))
            seen[key] = (hosted.source, hosted.order.own_copy, held)
        await asyncio.sleep(0.01)


async def test_a_receiver_serves_through_stages_another_receiver_hosts_from_its_arriving_copy(
        own_servers, small_model):
    nc, redis, record = await small_on_stack(own_servers, small_model, CONTEXT, _profile())
    assert record.layers == 12 and record.head_bytes > 0
    workers = _workers(record, own_servers, nc, redis)
    placer = Placer(PlacerSettings(*own_servers, CORE), nc, redis)
    stop, watching = asyncio.Event(), asyncio.Event()
    runner = watcher = None
    prompt = [5 + i for i in range(PROMPT)]
    reference = await asyncio.to_thread(greedy_output, small_model, prompt, MAX_TOKENS)
    try:
        for w in workers.values():
            await w.start()
        for s in SOURCES:
            await asyncio.to_thread(workers[s].loader.load, record.path)

        async def sources_published() -> bool:
            views = {n.node_id: n for n in await read_nodes(redis)}
            return len(views) == 4 and all(views[s].storage.holds.get("small") == "dram"
                                           for s in SOURCES)

        await until(sources_published, what="the sources' DRAM tiers in the cluster view")
        hosted: dict[str, tuple] = {}
        watcher = asyncio.create_task(_watch_stages(workers[RECEIVERS[0]], hosted, watching))
        finals, first_token_at = {}, {}
        early = [await submit_timed(nc, finals, first_token_at, PROMPT, MAX_TOKENS, "rp")
                 for _ in range(2)]
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        await until(lambda: all(r in finals for r in early), timeout_s=240,
                    what="the first two requests")
        for rid in early:
            assert finals[rid].error is None, finals[rid].error
            assert finals[rid].output_token_ids == reference, rid
        assert {finals[r].node_id for r in early} == set(RECEIVERS)
        await until(lambda: not placer.scaleout.running, timeout_s=60, what="the multicast's report")
        (report,) = placer.multicast_reports  # one k-way multicast fed both receivers
        assert report.ok and sorted(report.sources) == SOURCES
        first, second = [d.node for d in report.destinations]

        # The second receiver served through a pipeline whose other stages ran on the first.
        (pipe,) = workers[second].pipelines.history
        assert not workers[first].pipelines.history  # the first one waited for its copy
        assert pipe.stages and {s.helper for s in pipe.stages} == {first}, pipe.stages
        assert 0 < len(pipe.local) < 12
        served = next(r for r in early if finals[r].node_id == second)
        await until(lambda: "released" in pipe.events, timeout_s=120, what="the mode switch")
        events = pipe.events
        assert events["serving"] <= first_token_at[served] < events["whole"] <= events["switched"]
        # ... hosted from its own arriving copy: no bytes read, its ledger holding K/V only.
        per_layer = (record.weight_bytes - record.head_bytes) // 12
        for stage in pipe.stages:
            source, own_copy, held = hosted[stage_key(pipe.instance_id, stage.start, stage.end)]
            assert (source, own_copy) == ("tensors", True), hosted
            assert 0 < held < (stage.end - stage.start) * per_layer, held  # not the weights
        await until(lambda: not workers[first].layers.host.keys(), timeout_s=60,
                    what="the first receiver's stage released")
        (iid,) = workers[second].engines
        assert workers[second].engines[iid].layout().remote == ()
        assert workers[second].sched.node.instance(iid).pipeline is None

        # After the switch: a request served locally, the same greedy output.
        late = await submit_timed(nc, finals, first_token_at, PROMPT, MAX_TOKENS, "rp-late")
        await until(lambda: late in finals, timeout_s=120, what="the request after the switch")
        assert finals[late].error is None and finals[late].output_token_ids == reference
        assert first_token_at[late] > events["switched"]
    finally:
        watching.set()
        if watcher is not None:
            await watcher
        await shut_down(stop, runner, workers.values(), nc, redis)
