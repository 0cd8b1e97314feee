"""The placer's side of burst scale-out (services/placer/burst.py, settings): the setting read at
the edge, and the arrivals record the core's rate comes from. (Carried out on a real stack:
tests/multicast/test_burst_scaleout.py.)"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from services.placer.burst import BurstStarter
from services.placer.settings import burst_from_env
from shared.cluster import model_spec, save_profile
from shared.core.burst import recent_rate
from shared.core.config import CoreConfig
from shared.core.node_scheduler import new_node
from shared.core.perf_model import PerfModel
from shared.core.types import SLO, Hardware, RequestView, StorageView
from shared.registry import ModelRegistry
from shared.schemas import CommandKind, InferenceRequest, ModelRecord
from tests.placer.conftest import GB, FakeNode, flat_profile, publish, running_placer, until


def _req(rid: str, model: str = "m", resumed: list[int] | None = None) -> InferenceRequest:
    return InferenceRequest(rid, "t", model, [1, 2, 3], 4, time.time(), 30.0, 0.5,
                            resumed_token_ids=resumed or [])


def test_burst_scale_out_is_off_unless_asked_for_and_its_knobs_are_checked():
    core = CoreConfig()
    assert not burst_from_env(core, env={}).burst_scaleout
    on = burst_from_env(core, env={"SLINFER_BURST_SCALEOUT": "true", "SLINFER_BURST_MAX": "3",
                                   "SLINFER_BURST_WINDOW_S": "2.5"})
    assert (on.burst_scaleout, on.burst_max, on.burst_window_s) == (True, 3, 2.5)
    assert on.burst_max_startup_s == core.burst_max_startup_s
    with pytest.raises(ValueError, match="SLINFER_BURST_MAX must be >= 1"):
        burst_from_env(core, env={"SLINFER_BURST_MAX": "0"})


def test_the_arrivals_record_keeps_the_window_of_new_requests_per_model():
    starter = BurstStarter(None, CoreConfig(burst_scaleout=True, burst_window_s=1.0), None, None)
    for i, at in enumerate([0.0, 0.5, 1.2, 1.4]):
        starter.note(_req(f"a{i}"), at)
    starter.note(_req("b0", model="other"), 1.4)
    starter.note(_req("a-resumed", resumed=[7]), 1.4)  # a copy coming back is no new arrival
    seen = starter._arrivals["m"]
    assert list(seen) == [0.5, 1.2, 1.4]  # 0.0 fell out of the window at 1.2
    assert recent_rate(seen, 1.4, 1.0) == 3.0  # per second, over (0.4, 1.4]
    assert list(starter._arrivals["other"]) == [1.4]
    off = BurstStarter(None, CoreConfig(), None, None)
    off.note(_req("c0"), 0.0)
    assert not off._arrivals  # nothing kept while burst scale-out is off


async def test_the_placed_instance_is_admitted_with_its_arrival_in_the_bursts_multicast(
        servers, conns):
    """n0's instance of a 10 GB model is full; n1..n4 can receive it by multicast from n5 (100
    Gb/s: a step is 0.05 s), n1 being where `place` starts the next instance, as a lone
    receiver: 16 steps. The burst that comes with it makes n1 the first of four receivers of one
    multicast, whose schedule brings n1 the model at step 17: the ADMIT to n1 carries that
    arrival (its grace follows from it on the node), and the extra instances are started after
    it, joining the same multicast."""
    from shared.core.multicast import step_seconds, whole_steps

    nc, redis = conns
    record = ModelRecord("big", "/models/big", weight_bytes=10 * GB, kv_bytes_per_token=1024,
                         max_context=1024)
    profile = replace(flat_profile(record.name, Hardware.GPU, prefill_s=0.3, decode_s=0.01,
                                   load_s=30.0), engine_init_s=0.2)
    await ModelRegistry(redis).register(record)
    await save_profile(redis, profile)
    perf = PerfModel({(record.name, Hardware.GPU): profile})
    core = CoreConfig(burst_scaleout=True)
    scheds = [new_node(f"n{i}", Hardware.GPU, 80 * GB, perf, core) for i in range(6)]
    for sched in scheds:
        sched.node.storage = StorageView({"dram": 20 * GB, "registry": 0.5 * GB},
                                         multicast_bytes_per_s=12.5 * GB)
    scheds[5].node.storage.holds[record.name] = "dram"  # the holder, with no room to serve
    scheds[5].node.memory_bytes = scheds[5].node.budget_bytes
    now, iid = time.time(), None
    for k in range(3):  # n0's instance of it holds 3 requests: a fourth misses its TTFT there
        res = scheds[0].admit(RequestView(f"q{k}", record.name, 16, now, SLO(1.0, 0.25),
                                          max_tokens=8), iid, model_spec(record), now)
        assert res.admission.ok
        iid = res.instance_id
    nodes = [await FakeNode(nc, redis, s.view()).start() for s in scheds]
    reqs = [InferenceRequest(f"r{k}", "t", record.name, [5] * 16, 8, time.time(), 3.0, 0.25)
            for k in range(12)]
    # All in the stream before the placer starts, so that its first turn sees the whole burst
    # (published one by one to a running placer, the first few came before the rest: a run
    # planned one extra instance for a demand of 4 instead of three).
    for req in reqs:
        await publish(nc, req)
    async with running_placer(servers, core=core):
        await until(lambda: any(c.kind is CommandKind.START_INSTANCE
                                for n in nodes for _, c in n.commands), what="a burst")
    starts = [(t, n.node_id, c) for n in nodes for t, c in n.commands
              if c.kind is CommandKind.START_INSTANCE]
    burst_of = starts[0][2].request.request_id
    [(at, placed_on, admit)] = [(t, n.node_id, c) for n in nodes for t, c in n.commands
                                if c.kind is CommandKind.ADMIT
                                and c.request.request_id == burst_of]
    assert placed_on == "n1" and admit.instance_id is None
    step = step_seconds(record.weight_bytes, core.multicast_blocks, 12.5 * GB)
    alone, group = whole_steps(2, 1, core.multicast_blocks), whole_steps(5, 1, core.multicast_blocks)
    assert admit.multicast_s == pytest.approx(core.multicast_setup_s + group[1] * step)
    assert admit.multicast_s > core.multicast_setup_s + alone[1] * step
    started = [(t, node_id) for t, node_id, c in starts if c.request.request_id == burst_of]
    assert sorted(n for _, n in started) == ["n2", "n3", "n4"] and all(t > at for t, _ in started)
    for node in nodes:
        await node.stop()
