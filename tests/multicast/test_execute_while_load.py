"""λScale's execute-while-load through the real services: two node workers (each with its
multicast endpoint, loader, stage host and the torch engine) and a real placer on a real
nats-server and valkey, the `small` demo model.

A memory node holds the model in its DRAM tier and has room for a stage of its layers but not
for an instance; a second node would read the model from a slow registry. A request arrives:
the placer starts an instance on the second node that receives the model by multicast (paced
to a slow link, sent head-first) and serves through an execution pipeline meanwhile: as soon
as the node holds the head and its first layers, the memory node hosts the other layers from
its DRAM tier's copy. The request's first token comes before the copy is whole. Once it is
whole the instance takes the layers back with their K/V (mode switch) and the memory node lets
its stage go; a second request is served locally. Both produce a local instance's greedy output.
"""

from __future__ import annotations

import asyncio
import dataclasses

import nats
import pytest
from redis.asyncio import Redis

from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared.bus import ensure_streams
from shared.cluster import read_nodes, save_profile
from shared.core.config import CoreConfig
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import TokenMessage

from tests.multicast.conftest import node_settings, submit_timed
from tests.polling import until
from tests.stack import shut_down
from tests.reference import greedy_output

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20
HOLDER, HEAD = "ewl-holder", "ewl-head"
CONTEXT, PROMPT, MAX_TOKENS = 256, 150, 8
RATE = 10 * MiB  # every sending connection is paced to this: the whole copy takes ~18 s
CORE = CoreConfig(keep_alive_s=120.0, enable_pipeline=True)


def _node(node_id: str, memory_bytes: int, nats_url: str, redis_url: str):
    return node_settings(node_id, memory_bytes, nats_url, redis_url, core=CORE,
                         multicast_link_bytes_per_s=RATE, multicast_rate_bytes_per_s=RATE)


def _profile() -> Profile:
    """A stand-in profile (the startup is under test, not iteration timing): the registry
    read takes 20 s here, so the model comes by multicast."""
    return Profile("small", Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]),
                   load_s=20.0, engine_init_s=0.05)




def _prompt() -> list[int]:
    return [5 + i for i in range(PROMPT)]


async def test_a_new_instance_serves_through_a_pipeline_before_its_copy_is_whole(
        own_servers, small_model):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    record = dataclasses.replace(model_record_from_dir("small", small_model), max_context=CONTEXT)
    assert record.layers == 12 and record.head_bytes > 0
    await ModelRegistry(redis).register(record)
    await save_profile(redis, _profile())
    kv_token = record.kv_bytes_per_token
    one_instance = record.weight_bytes + 300 * kv_token
    # Room for a stage of every layer but one (and its K/V), not for an instance.
    holder_memory = record.weight_bytes * 11 // 12 + 300 * kv_token
    assert holder_memory < record.weight_bytes
    workers = {HOLDER: NodeWorker(_node(HOLDER, holder_memory, nats_url, redis_url), nc, redis),
               HEAD: NodeWorker(_node(HEAD, one_instance, nats_url, redis_url), nc, redis)}
    placer = Placer(PlacerSettings(nats_url, redis_url, CORE), nc, redis)
    stop = asyncio.Event()
    runner = None
    reference = await asyncio.to_thread(greedy_output, small_model, _prompt(), MAX_TOKENS)
    try:
        for w in workers.values():
            await w.start()
        await asyncio.to_thread(workers[HOLDER].loader.load, record.path)

        async def holder_published() -> bool:
            views = {n.node_id: n for n in await read_nodes(redis)}
            return len(views) == 2 and views[HOLDER].storage.holds.get("small") == "dram"

        await until(holder_published, what="the holder's DRAM tier in the cluster view")
        finals: dict[str, TokenMessage] = {}
        first_token_at: dict[str, float] = {}
        early = await submit_timed(nc, finals, first_token_at, PROMPT, MAX_TOKENS, "ewl")  # arrives at t = 0 of the scale-out
        await placer.start()
        runner = asyncio.create_task(placer.run(stop))
        await until(lambda: early in finals, timeout_s=240, what="the first request")

        pipelines = workers[HEAD].pipelines
        assert len(pipelines.history) == 1, "the instance did not serve through a pipeline"
        pipe = pipelines.history[0]
        (stage,) = pipe.stages  # one DRAM holder's stage of every layer the head lacks
        assert stage.helper == HOLDER and 1 <= stage.start < stage.end == 12
        assert pipe.local == frozenset(range(stage.start))
        await until(lambda: "released" in pipe.events, timeout_s=120, what="the mode switch")
        events = pipe.events
        # The first token came through the pipeline, before the copy was whole; the switch after.
        assert events["serving"] <= first_token_at[early] < events["whole"] <= events["switched"]
        assert finals[early].error is None and finals[early].node_id == HEAD
        assert finals[early].output_token_ids == reference
        assert placer.decisions.get("new_instance") == 1
        # The placer's report comes when its multicast's last exchange with the holder ends,
        # which may be after the head took its layers back (a loaded run: 80 ms after).
        await until(lambda: placer.multicast_reports, timeout_s=60, what="the multicast's report")
        (report,) = placer.multicast_reports
        assert report.ok and [d.node for d in report.destinations] == [HEAD]
        # The holder hosted the stage and lets it go; the head runs every layer itself.
        await until(lambda: not workers[HOLDER].layers.host.keys(), timeout_s=60,
                    what="the holder's stage released")
        (iid,) = workers[HEAD].engines
        assert workers[HEAD].engines[iid].layout().remote == ()
        view = workers[HEAD].sched.node.instance(iid)
        assert view.pipeline is None  # the core now validates it as a local instance

        # A request after the switch: the same instance, local, the same greedy output.
        late = await submit_timed(nc, finals, first_token_at, PROMPT, MAX_TOKENS, "ewl")
        await until(lambda: late in finals, timeout_s=120, what="the second request")
        assert finals[late].error is None and finals[late].node_id == HEAD
        assert finals[late].output_token_ids == reference
        assert first_token_at[late] > events["switched"]
        assert list(workers[HEAD].engines) == [iid]
        load = workers[HEAD].loads[0]
        assert (load.tier, load.ok) == ("pipeline", True), load
    finally:
        await shut_down(stop, runner, workers.values(), nc, redis)
