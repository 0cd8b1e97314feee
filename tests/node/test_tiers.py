"""The node's checkpoint tiers reach the core's decisions (ServerlessLLM §4.2, §6).

First the conversion of the loader's report into the cluster view's `StorageView` and its wire
format, as plain data. Then the real path: a node worker (torch engine, the tiny model in the
loading-optimized format) under a real placer on real NATS and valkey. The node owns one
checkpoint loader; a served model whose instance the keep-alive unloaded stays in the loader's
DRAM tier, the node's published view (what placers read) says so with the tier's measured
bandwidth, and the next cold start is a DRAM-tier load whose startup estimate the core took
from that bandwidth. A node started later on the same local disk finds the checkpoint there and
reports it in its disk tier under the registered name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import time
from pathlib import Path

import msgpack
import nats
import pytest
from redis.asyncio import Redis

from services.node.loader import LoaderSettings, TierModel, TiersReport, TierState
from services.node.loader.convert import convert_checkpoint
from services.node.settings import NodeSettings
from services.node.tiers import ModelNames, model_key, storage_view
from services.node.worker import NodeWorker
from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared import wire
from shared.bus import ensure_streams
from shared.cluster import model_spec, read_nodes, save_profile
from shared.core.config import CoreConfig
from shared.core.readiness import load_seconds
from shared.core.perf_model import DecodeTable, PrefillTable, Profile
from shared.core.types import Hardware, NodeView, StorageView
from shared.registry import ModelRegistry, model_record_from_dir
from shared.schemas import ModelRecord, TokenMessage

from tests.node.harness import submit, until

MiB = 1 << 20


# --- the report as the cluster view carries it ---------------------------------------------------

def _tier(name: str, rate: float, measured: int, *models: TierModel) -> TierState:
    return TierState(name, rate, measured, None, sum(m.bytes for m in models), models)


def _report(*tiers: TierState, pending_s: float = 0.0) -> TiersReport:
    return TiersReport(tiers, 0, 0, pending_s)


def _names(table: dict[str, set[str]]):
    return lambda path, key: table.get(path, set()) | table.get(key, set())


def test_each_model_is_held_in_its_fastest_tier_under_its_registered_names():
    a, b = TierModel("a-1", "/m/a", 10), TierModel("b-1", "/m/b", 20)
    stray = TierModel("c-1", "/m/c", 30)  # no registered model points there: left out
    report = _report(_tier("dram", 2e10, 1, a), _tier("disk", 1e9, 0, a, b, stray),
                     _tier("registry", 5e8, 2, a, b), pending_s=0.75)
    view = storage_view(report, _names({"/m/a": {"a", "a-copy"}, "/m/b": {"b"}}))
    assert view == StorageView({"dram": 2e10, "disk": 1e9, "registry": 5e8},
                               {"a": "dram", "a-copy": "dram", "b": "disk"}, 0.75)


def test_the_registry_bandwidth_is_reported_only_once_a_load_measured_it():
    report = _report(_tier("dram", 2e10, 0), _tier("disk", 1e9, 0), _tier("registry", 1e9, 0))
    view = storage_view(report, _names({}))
    # Unmeasured, the configured guess would decide cold starts: the profile's load_s does.
    assert view.bytes_per_s == {"dram": 2e10, "disk": 1e9} and view.holds == {}
    profile = Profile("m", Hardware.CPU, PrefillTable([1, 2], [0.1, 0.1]),
                      DecodeTable([1, 2], [1, 2], [[0.01, 0.01], [0.01, 0.01]]), load_s=3.0)
    node = NodeView("n", Hardware.CPU, 1 << 30, storage=view)
    spec = model_spec(ModelRecord("m", "/m", weight_bytes=4 * MiB, kv_bytes_per_token=1))
    assert load_seconds(node, spec, profile) == 3.0
    node.storage = dataclasses.replace(view, holds={"m": "dram"})
    assert load_seconds(node, spec, profile) == pytest.approx(4 * MiB / 2e10)


def test_model_names_by_path_and_by_the_key_of_a_checkpoint_found_on_disk():
    names = ModelNames()
    names.learn(ModelRecord("served", "/m/x/"))  # a record the node was asked to serve
    records = [ModelRecord("a", "/m/a"), ModelRecord("a2", "/m/a"), ModelRecord("gone", "/m/gone")]

    def key_of(path: str) -> str:
        if path == "/m/gone":
            raise FileNotFoundError(path)
        return f"key{path}"

    names.set_registry(records, key_of)
    assert names.names("/m/x", "?") == {"served"}
    assert names.names("/m/a", "?") == {"a", "a2"}
    assert names.names("/disk/key-a", "key/m/a") == {"a", "a2"}  # the disk copy, by its key
    assert names.names("/m/gone", "?") == {"gone"}  # matched by path although it has no key
    names.set_registry([], key_of)  # deleted from the registry
    assert names.names("/m/a", "key/m/a") == set() and names.names("/m/x", "?") == {"served"}


def test_a_node_view_with_tiers_round_trips_and_one_without_them_reads_as_none():
    storage = StorageView({"dram": 1.5e10, "registry": 8e8}, {"m": "dram"}, 0.25)
    view = NodeView("n", Hardware.GPU, 1 << 30, storage=storage)
    assert wire.decode(NodeView, wire.encode(view)).storage == storage
    old = msgpack.unpackb(wire.encode(view), raw=False)
    del old["storage"]  # a node of a version before the tiers were reported
    assert wire.decode(NodeView, msgpack.packb(old, use_bin_type=True)).storage is None
    with pytest.raises(wire.WireError):  # a malformed report is an error, not a half view
        wire.decode(NodeView, wire.encode({**wire.to_plain(view), "storage": {"holds": {}}}))


# --- the real path ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory, model_dir) -> Path:
    """The tiny model in the loading-optimized format (the registry's copy, as the profiler
    converts it at registration)."""
    target = tmp_path_factory.mktemp("tiered") / "tiny-tiered"
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("slinfer-checkpoint"))
    convert_checkpoint(target)
    return target


def _profile(model: str) -> Profile:
    """A stand-in profile (the node's loads and tiers are under test, not its timing): a load
    time of 2 s that only a node reporting no usable tier would take."""
    return Profile(model, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]),
                   DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]]),
                   load_s=2.0, engine_init_s=0.05)


def _node_settings(node_id: str, nats_url: str, redis_url: str, disk: Path) -> NodeSettings:
    return NodeSettings(node_id=node_id, hardware="cpu", device="cpu", memory_bytes=2 << 30,
                        matrix_accel=True, nats_url=nats_url, redis_url=redis_url,
                        core=CoreConfig(keep_alive_s=0.3), heartbeat_s=0.05, calibrate=False,
                        loader=LoaderSettings(dram_cache_bytes=256 * MiB, disk_cache_dir=disk,
                                              disk_cache_bytes=256 * MiB))


async def _serve(nc, model: str, finals: dict[str, TokenMessage]) -> str:
    return await submit(nc, model, 32, 8, finals, prefix="tiers")


async def _published(redis, node_id: str) -> NodeView | None:
    return next((n for n in await read_nodes(redis) if n.node_id == node_id), None)


async def _until_view(redis, node_id: str, condition, what: str) -> NodeView:
    deadline = time.monotonic() + 60
    while True:
        view = await _published(redis, node_id)
        if view is not None and condition(view):
            return view
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {view}"
        await asyncio.sleep(0.02)


def _metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """One sample of the Prometheus exposition, by its exact label set."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


@pytest.mark.integration
@pytest.mark.slow
async def test_an_unloaded_model_comes_back_from_the_dram_tier(own_servers, converted, tmp_path):
    nats_url, redis_url = own_servers
    nc, redis = await nats.connect(nats_url), Redis.from_url(redis_url)
    await ensure_streams(nc.jetstream())
    record = model_record_from_dir("tiered", converted)
    await ModelRegistry(redis).register(record)
    profile = _profile(record.name)
    await save_profile(redis, profile)
    disk = tmp_path / "node-disk"
    worker = NodeWorker(_node_settings("tier-a", nats_url, redis_url, disk), nc, redis)
    placer = Placer(PlacerSettings(nats_url, redis_url, CoreConfig()), nc, redis)
    later: NodeWorker | None = None
    stop = asyncio.Event()
    await worker.start()
    await placer.start()
    runner = asyncio.create_task(placer.run(stop))
    finals: dict[str, TokenMessage] = {}
    try:
        first = await _serve(nc, record.name, finals)
        await until(lambda: first in finals, what="the first request")
        assert finals[first].error is None and finals[first].node_id == "tier-a"
        # The keep-alive unloads the idle instance; its checkpoint stays in the DRAM tier.
        await until(lambda: not worker.sched.node.instances and not worker.engines,
                    what="the instance unloaded")
        # The local disk copy made after the registry read.
        await asyncio.to_thread(worker.loader.wait_for_copies)
        seen = await _until_view(redis, "tier-a",
                                 lambda v: v.storage is not None and not v.instances
                                 and v.storage.holds.get(record.name) == "dram",
                                 "the placers' view of the node to hold the model in DRAM")
        storage = seen.storage
        assert set(storage.bytes_per_s) == {"dram", "disk", "registry"}  # the registry measured
        assert storage.pending_s == 0.0
        tiers = {t.name: [m.model_path for m in t.models] for t in worker.loader.tiers_report().tiers}
        assert tiers["dram"] == tiers["disk"] == tiers["registry"] == [model_key(record.path)]

        one = worker.loads[0]
        assert (one.model, one.expected_tier, one.tier, one.ok) == (record.name, "registry",
                                                                    "registry", True)
        assert one.expected_s == profile.load_s  # no registry bandwidth measured yet: the profile

        # Placed again: a cold start whose estimate is the DRAM tier's q + n/b, and a DRAM hit.
        expected = load_seconds(seen, model_spec(record), profile)
        assert expected == pytest.approx(record.weight_bytes / storage.bytes_per_s["dram"]
                                         + profile.engine_init_s)
        second = await _serve(nc, record.name, finals)
        await until(lambda: second in finals, what="the second request")
        assert finals[second].error is None and finals[second].node_id == "tier-a"
        assert finals[second].output_token_ids == finals[first].output_token_ids  # same weights
        two = worker.loads[1]
        assert (two.expected_tier, two.tier, two.ok) == ("dram", "dram", True)
        assert two.expected_s == pytest.approx(expected)
        assert two.bytes == one.bytes > 0 and len(worker.loads) == 2
        # Both loads are exported by tier (what /metrics and OTLP show), with the seconds above.
        text = worker.obs.tel.metrics_text().decode()
        for load in (one, two):
            labels = {"gen_ai_request_model": record.name, "slinfer_load_ok": "True",
                      "slinfer_load_tier": load.tier, "slinfer_node_id": "tier-a"}
            assert _metric(text, "slinfer_node_load_duration_seconds_count", labels) == 1
            assert _metric(text, "slinfer_node_load_duration_seconds_sum", labels) == \
                pytest.approx(load.seconds)
            del labels["slinfer_load_ok"]
            assert _metric(text, "slinfer_node_loader_duration_seconds_sum", labels) == \
                pytest.approx(load.loader_seconds)
            assert _metric(text, "slinfer_node_loader_bytes_total",
                           {"slinfer_load_tier": load.tier, "slinfer_node_id": "tier-a"}) == load.bytes

        # A node started later on the same local disk: its disk tier holds the checkpoint (found
        # by its key, its path being the disk copy) and reports it under the registered name.
        await worker.stop()
        settings = dataclasses.replace(_node_settings("tier-b", nats_url, redis_url, disk),
                                       loader=dataclasses.replace(
                                           worker.s.loader, dram_cache_bytes=64 * MiB))
        later = NodeWorker(settings, nc, redis)
        await later.start()
        disk_models = next(t for t in later.loader.tiers_report().tiers if t.name == "disk").models
        assert [Path(m.model_path).parent for m in disk_models] == [disk]
        view = await _until_view(redis, "tier-b", lambda v: v.storage is not None
                                 and v.storage.holds.get(record.name) == "disk",
                                 "the later node to report the model on its disk")
        assert load_seconds(view, model_spec(record), profile) == pytest.approx(
            record.weight_bytes / view.storage.bytes_per_s["disk"] + profile.engine_init_s)
    finally:
        stop.set()
        await runner
        if later is not None:
            await later.stop()
        if not worker.stopped:
            await worker.stop()
        await nc.close()
        await redis.aclose()
