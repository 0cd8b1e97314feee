"""λScale in the simulator (sim/scaleout.py): multicast startups timed by the core's plans,
execute-while-load pipelines and their mode switch, load spikes."""

from __future__ import annotations

import pytest

from shared.core.multicast import binomial_steps
from sim.profiles import SHAPES, gpu_profile
from sim.scaleout import (Multicaster, ScaleoutConfig, Shape, Spikes, layout, plan_times,
                          spike_arrivals, start_load)
from sim.config import SimConfig
from sim.storage import NodeStorage, TierSpec
from sim.workload import Arrival, LengthSampler
from tests.sim.helpers import run_requests

THIRTEEN = SHAPES["13b"].weight_bytes
REGISTRY_13B_S = THIRTEEN / 1.25e9  # sim/storage.py's registry link


def multicaster(gbps: float = 400.0, ewl: bool = True) -> Multicaster:
    shape = SHAPES["13b"]
    return Multicaster(ScaleoutConfig(gbps, execute_while_load=ewl), {"m": shape.hidden},
                       {"m": Shape(shape.weight_bytes, shape.layers, shape.hidden)})


def test_one_source_plan_takes_the_binomial_bound():
    for n in (2, 3, 5, 9):
        times = plan_times(n, 1, 16)
        assert max(times.full.values()) >= binomial_steps(n, 16)
        assert max(times.full.values()) <= binomial_steps(n, 16) + 3
    assert plan_times(2, 1, 16).full == {1: 16}


def test_two_sources_give_two_destinations_a_pipeline_after_about_half_the_blocks():
    """2 sources: destinations 2 and 3 in different sub-groups receive different halves first
    (head-first), so together they hold every layer about half-way; each heads its own
    instance with the other hosting the layers it lacks (the core's receiver plan)."""
    shape = Shape(THIRTEEN, SHAPES["13b"].layers, SHAPES["13b"].hidden)
    times = plan_times(4, 2, 16, shape)
    assert times.full == plan_times(4, 2, 16).full  # head-first changes no step count
    for node, other in ((2, "3"), (3, "2")):
        plan = times.plans[node]
        assert plan.members == (2, 3) and plan.hops == 2
        assert plan.serve_step <= 10 < times.full[node]
        assert {s.node for s in plan.stages} == {str(node), other}
        assert [(s.start, s.end) for s in plan.stages][0][0] == 0
        assert plan.stages[-1].end == SHAPES["13b"].layers


def test_the_first_destination_of_a_pipeline_has_no_one_to_host_for_it_yet():
    """A destination planned as it joins (the simulator's order) sees only the destinations of
    its pipeline that joined before it: alone in its pipeline, it waits for its copy."""
    shape = Shape(THIRTEEN, SHAPES["13b"].layers, SHAPES["13b"].hidden)
    assert plan_times(3, 2, 16, shape).plans[2].serve_step is None
    assert plan_times(4, 2, 16, shape).plans[3].serve_step is not None
    tensors, blocks = layout(shape, 16)
    assert sum(t.end - t.start for t in tensors) == blocks[-1].end <= THIRTEEN
    assert len(blocks) == 16


def test_a_multicast_start_is_ready_before_a_registry_load_when_a_node_holds_the_model():
    mc = multicaster(100.0)
    store = NodeStorage(TierSpec(caching=False))
    how, seconds = start_load(mc, store, "m", THIRTEEN, "g1", ["g0"], 0.0, "i1")
    assert how == "multicast"
    step = THIRTEEN / 16 / (100e9 / 8) + 50e-6
    assert seconds == pytest.approx(16 * step)  # 1 -> 2: b steps
    assert seconds < REGISTRY_13B_S / 5
    assert store.io_free_at == 0.0  # the node's disk/registry queue was not used
    # a model nobody holds (and no multicast of it under way): the node's own tier
    mc.hidden["x"] = SHAPES["13b"].hidden
    how, seconds = start_load(mc, store, "x", THIRTEEN, "g2", [], 0.0, "i2")
    assert (how, seconds) == ("registry", pytest.approx(REGISTRY_13B_S))


def test_a_slow_link_loses_to_a_warm_dram_tier():
    mc = multicaster(10.0)  # 1.25 GB/s: slower than the node's own DRAM copy
    store = NodeStorage(TierSpec())
    store.cache("m", THIRTEEN)
    assert start_load(mc, store, "m", THIRTEEN, "g1", ["g0"], 0.0, "i1")[0] == "dram"


def test_execute_while_load_serves_in_a_pipeline_then_pays_the_mode_switch_once():
    mc = multicaster(100.0)
    first = mc.start("m", THIRTEEN, "g2", ["g0", "g1"], 0.0, "i2")  # k = 2 sources
    second = mc.start("m", THIRTEEN, "g3", ["g0", "g1"], 0.0, "i3")  # joins: a 2-node pipeline
    assert first.hops == 0 and first.ready_s == first.full_s
    assert second.hops == 2 and second.ready_s < 0.7 * second.full_s
    assert 0.3 < second.remote < 0.7  # the other destination runs about half of its layers
    profile = gpu_profile(SHAPES["13b"])
    kv = SHAPES["13b"].kv_bytes_per_token
    hop = mc.iteration_extra("i3", "m", 8, 0, kv, profile, second.ready_s)
    assert hop == pytest.approx(2 * (50e-6 + 8 * SHAPES["13b"].hidden * 2 / 12.5e9))
    switch = mc.iteration_extra("i3", "m", 8, 4000, kv, profile, second.full_s)
    assert 0 < switch <= profile.migration_s(4000)
    assert mc.iteration_extra("i3", "m", 8, 4000, kv, profile, second.full_s + 1) == 0.0
    assert mc.iteration_extra("i2", "m", 8, 4000, kv, profile, 0.0) == 0.0  # never in a pipeline


def test_without_execute_while_load_a_destination_serves_only_with_the_whole_model():
    mc = multicaster(100.0, ewl=False)
    mc.start("m", THIRTEEN, "g2", ["g0", "g1"], 0.0, "i2")
    second = mc.start("m", THIRTEEN, "g3", ["g0", "g1"], 0.0, "i3")
    assert second.hops == 0 and second.ready_s == second.full_s


def test_a_late_joiner_needs_every_block_after_it_joined_and_a_loading_node_is_no_source():
    mc = multicaster(100.0)
    stores = {n: NodeStorage(TierSpec()) for n in ("g1", "g2")}
    _, first = start_load(mc, stores["g1"], "m", THIRTEEN, "g1", ["g0"], 0.0, "i1")
    step = THIRTEEN / 16 / 12.5e9 + 50e-6
    late = mc.start("m", THIRTEEN, "g2", ["g0"], 8 * step, "i2")  # joins g0's session
    assert late.full_s >= 16 * step - 1e-9  # one block in per step from when it joined
    # g1's DRAM tier has the model in its books at once, but it cannot send it before it is in
    assert not mc.is_holder("g1", "m", [], "m" in stores["g1"].dram, first / 2)
    assert mc.is_holder("g1", "m", [], True, first)
    assert mc.is_holder("g1", "m", ["i1"], False, 0.0)  # a loaded instance on the node


def test_links_carry_one_multicast_at_a_time():
    mc = multicaster(100.0)
    mc.start("m", THIRTEEN, "g1", ["g0"], 0.0, "i1")
    mc.hidden["x"] = SHAPES["13b"].hidden
    other = mc.estimate("x", THIRTEEN, "g2", ["g0"], 0.0)  # g0 still injects m's blocks
    assert other.full_s >= 2 * 16 * (THIRTEEN / 16 / 12.5e9)


@pytest.mark.parametrize("system", ["sllm", "slinfer"])
def test_a_burst_scales_out_by_multicast_from_the_running_instance(system):
    """One 13B request loads from the registry; a burst once it runs needs more instances, which
    receive the model from it (400 Gb/s) instead of the registry: their cold-start grace is the
    multicast's, far below the registry's 20.8 s."""
    burst = [(0.0, 0, 256, 400)] + [(25.0 + 0.01 * i, 0, 1024, 200) for i in range(60)]
    extra = {"scaleout": {"link_gbps": 400.0}}
    _, reqs, m, _ = run_requests(system, "13b", 0, 4, 1, burst, storage="registry", extra=extra)
    _, base, bm, _ = run_requests(system, "13b", 0, 4, 1, burst, storage="registry")
    received = m.counters["loads:multicast"] + m.counters["loads:pipeline"]
    assert received >= 2 and "loads:multicast" not in bm.counters
    # (SLINFER may start a second instance on the first node: no other node holds the model
    # to send it, so that one reads the registry with or without a link)
    assert m.counters["loads:registry"] + received == m.counters["cold_starts"]
    assert m.counters["loads:registry"] < bm.counters["loads:registry"]
    assert reqs[0].grace_s == pytest.approx(REGISTRY_13B_S, rel=0.01)
    assert min(r.grace_s for r in reqs[1:] if r.grace_s > 0) < 2.0  # a multicast's, not 20.8 s

    def p90(rs):
        ttfts = sorted(r.ttft if r.ttft is not None else 1e9 for r in rs[1:])
        return ttfts[int(0.9 * len(ttfts))]
    assert p90(reqs) < p90(base)


@pytest.mark.parametrize("system", ["sllm", "slinfer"])
def test_with_no_holder_the_link_changes_nothing(system):
    """Every model called once: nobody ever holds a model another node needs."""
    reqs = [(float(i), i, 512, 8) for i in range(4)]
    _, a, ma, _ = run_requests(system, "7b", 0, 4, 4, reqs, storage="registry")
    _, b, mb, _ = run_requests(system, "7b", 0, 4, 4, reqs, storage="registry",
                               extra={"scaleout": {"link_gbps": 400.0}})
    assert [(r.first_token_at, r.finished_at, r.grace_s) for r in a] == \
        [(r.first_token_at, r.finished_at, r.grace_s) for r in b]
    assert ma.counters == mb.counters


def test_spikes_add_bursts_of_one_model_and_prime_a_dram_copy():
    spikes = Spikes(count=3, requests=50, window_s=5.0)
    lengths = LengthSampler([(100, 20), (300, 50)])
    base = [Arrival(1.0, "a", 10, 5), Arrival(200.0, "b", 10, 5)]
    out = spike_arrivals(spikes, base, ["a", "b", "c"], 600.0, 7, lengths, {m: 4096 for m in "abc"})
    assert len(out) == 2 + 150 and out == sorted(out, key=lambda a: (a.time, a.model))
    for model, t0 in zip(spikes.models(["a", "b", "c"], 7), spikes.times(600.0)):
        inside = [a for a in out if t0 <= a.time < t0 + 5.0 and a.model == model]
        assert len(inside) >= 50
    assert spikes.times(600.0) == [100.0, 300.0, 500.0]


def test_bad_settings_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="storage tiered or registry"):
        SimConfig(extra={"scaleout": {"link_gbps": 100.0}})
    with pytest.raises(ValueError, match="link_gbps"):
        SimConfig(storage="tiered", extra={"scaleout": {"link_gbps": 0.0}})
    with pytest.raises(ValueError, match="slinfer"):
        SimConfig(system="sllm", extra={"cocoserve": {}})
    with pytest.raises(ValueError, match="spikes"):
        SimConfig(extra={"spikes": {"count": 2, "requests": 0}})


def test_cli_flags_reach_the_config_and_a_default_run_has_none():
    from sim.cli import config_from, parser

    assert config_from(parser().parse_args([])).extra == {}
    cfg = config_from(parser().parse_args(["--storage", "tiered", "--link-gbps", "400",
                                           "--spikes", "4", "--no-execute-while-load"]))
    assert cfg.extra["scaleout"] == {"link_gbps": 400.0, "blocks": 16, "execute_while_load": False}
    assert cfg.extra["spikes"] == {"count": 4, "requests": 200, "window_s": 10.0}


def test_a_burst_starts_its_instances_together_and_they_serve_in_a_pipeline_while_loading(
        monkeypatch):
    """200 requests of one 7B model in 2 s (the model in one node's DRAM, 100 Gb/s links). With
    burst scale-out (shared/core/burst.py) the instances the arrivals need start at one instant
    on nodes that serve no instance of it yet, as destinations of one multicast, and serve in
    execute-while-load pipelines before they hold the whole model; without it they start one
    per placement."""
    import sim.slinfer_system as system_module

    reqs = [(i / 100, 0, 1024, 200) for i in range(200)]
    extra = {"spikes": {"count": 1, "requests": 1, "window_s": 1.0},
             "scaleout": {"link_gbps": 100.0}}
    starts: dict[float, list[tuple[str, str]]] = {}  # load start time -> (node, how)
    real = system_module.start_load

    def spy(mc, storage, model, nbytes, node, holders, now, iid):
        how, seconds = real(mc, storage, model, nbytes, node, holders, now, iid)
        starts.setdefault(now, []).append((node, how))
        return how, seconds

    monkeypatch.setattr(system_module, "start_load", spy)
    _, one, m1, _ = run_requests("slinfer", "7b", 0, 8, 1, reqs, storage="tiered", extra=extra)
    one_widest = max(len(v) for v in starts.values())
    starts.clear()
    _, burst, mb, _ = run_requests("slinfer", "7b", 0, 8, 1, reqs, storage="tiered",
                                   extra={**extra, "burst": {}})
    assert "burst_instances" not in m1.counters and mb.counters["burst_instances"] >= 3
    widest = max(starts.values(), key=len)
    assert len(widest) >= 3 and len({n for n, _ in widest}) == len(widest) > one_widest
    assert sum(how == "pipeline" for _, how in widest) >= 2
    assert sum(r.slo_met for r in burst) >= sum(r.slo_met for r in one) - 2


def test_burst_settings_are_checked():
    with pytest.raises(ValueError, match="slinfer"):
        SimConfig(system="sllm", extra={"burst": {}})
    with pytest.raises(ValueError, match="unknown"):
        SimConfig(extra={"burst": {"window": 1.0}})
    with pytest.raises(ValueError, match="burst_max"):
        SimConfig(extra={"burst": {"max": 0}})
    assert SimConfig(extra={"burst": {"max": 3}}).core_config().burst_max == 3
    assert not SimConfig().core_config().burst_scaleout
