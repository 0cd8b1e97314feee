"""A request for a registered model that is not servable yet (its lifecycle, shared.model_state):
the rule (`readiness.judge`) on its own, then the placer on real NATS and Redis with a stand-in
node. A model still converting or profiling keeps its requests queued until their TTFT deadline
and serves them once its profile is stored; past the deadline they fail with `model_not_ready`
and the state; a failed lifecycle fails them at once with the reason; never "no_profile"."""

from __future__ import annotations

import dataclasses
import time

import pytest

from services.placer.readiness import ReadinessGate, Verdict, judge, judge_adapter
from shared.cluster import save_profile
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware
from shared.model_state import (FAILED, NOT_READY, KindStatus, ModelState, ModelStatus,
                                overall, parse_lifecycle_error, request_profiles,
                                set_hardware_state)
from shared.registry import ModelRegistry
from shared.schemas import FinishReason
from tests.placer.conftest import (MODEL, FakeNode, Finals, empty_gpu, gpu_profile, publish,
                                   request, running_placer, until)

pytestmark = pytest.mark.integration
NEW = "fresh"  # registered, lifecycle started, no profile yet


def _status(**kinds: tuple[ModelState, str, float]) -> ModelStatus:
    steps = {k: KindStatus(s, reason, progress, 1.0) for k, (s, reason, progress) in kinds.items()}
    states = {k: s.state.value for k, s in steps.items()}
    return ModelStatus(overall(states), "", 0.0, states, 1.0, steps)


# --- the rule ------------------------------------------------------------------------------------

def test_a_profile_for_a_present_kind_serves():
    assert judge("m", None, {"gpu"}, {"gpu", "cpu"}).verdict is Verdict.SERVE
    assert judge("m", None, {"gpu"}, set()).verdict is Verdict.SERVE  # no node yet: the core waits


def test_converting_or_profiling_waits_and_says_how_far():
    r = judge("m", _status(cpu=(ModelState.PROFILING, "profiling on torch", 0.4)), set(), {"cpu"})
    assert r.verdict is Verdict.WAIT and not r.refresh
    code, message = parse_lifecycle_error(r.message)
    assert code == NOT_READY and "profiling on cpu (profiling on torch, 40%)" in message


def test_a_profile_being_replaced_does_not_serve_yet():
    for step in ((ModelState.PROFILING, "profiling on torch", 0.9),
                 (ModelState.CONVERTING, "queued", 0.0)):
        r = judge("m", _status(cpu=step), {"cpu"}, {"cpu"})
        assert r.verdict is Verdict.WAIT and not r.refresh


def test_ready_without_the_profile_in_hand_waits_for_a_refresh():
    r = judge("m", _status(cpu=(ModelState.READY, "", 1.0)), set(), {"cpu"})
    assert r.verdict is Verdict.WAIT and r.refresh


def test_failed_on_every_present_kind_fails_with_the_reason():
    status = _status(cpu=(ModelState.FAILED, "OSError: no weights", 0.0),
                     gpu=(ModelState.PROFILING, "", 0.1))
    r = judge("m", status, set(), {"cpu"})  # the GPU run does not help: no GPU node is up
    assert r.verdict is Verdict.FAIL
    assert parse_lifecycle_error(r.message) == (FAILED, "The model 'm' could not be made servable: "
                                                "failed on cpu: OSError: no weights.")
    assert judge("m", status, set(), {"cpu", "gpu"}).verdict is Verdict.WAIT


def test_an_adapter_fails_only_when_its_lifecycle_failed_on_every_present_kind():
    reason = "files missing or unreadable (found by node n0): /a does not exist"
    failed = _status(cpu=(ModelState.FAILED, reason, 0.0), gpu=(ModelState.READY, "", 1.0))
    r = judge_adapter("ad", failed, {"cpu"})
    assert r.verdict is Verdict.FAIL
    assert parse_lifecycle_error(r.message) == (
        FAILED, f"The model 'ad' could not be made servable: failed on cpu: {reason}.")
    assert judge_adapter("ad", failed, {"cpu", "gpu"}).verdict is Verdict.SERVE  # a GPU serves
    assert judge_adapter("ad", failed, set()).verdict is Verdict.SERVE  # not failed everywhere
    assert judge_adapter("ad", None, {"cpu"}).verdict is Verdict.SERVE  # no lifecycle: as before
    ready = _status(cpu=(ModelState.READY, "LoRA adapter: served by its base model m", 1.0))
    assert judge_adapter("ad", ready, {"cpu"}).verdict is Verdict.SERVE


def test_no_lifecycle_and_no_profile_fails_and_says_how_to_fix_it():
    r = judge("m", None, set(), {"cpu"})
    assert r.verdict is Verdict.FAIL and "POST /admin/models" in r.message
    r = judge("m", _status(gpu=(ModelState.READY, "", 1.0)), {"gpu"}, {"cpu"})  # only GPU profiled
    assert r.verdict is Verdict.FAIL and "not profiled for the hardware of the live nodes (cpu)" in r.message


# --- the placer ----------------------------------------------------------------------------------

@pytest.fixture
async def fresh(conns):
    """`NEW` registered with its lifecycle started on GPU (the job waits: no profiler runs)."""
    nc, redis = conns
    await ModelRegistry(redis).register(dataclasses.replace(MODEL, name=NEW))
    await request_profiles(nc.jetstream(), redis, NEW, ["gpu"])
    return nc, redis


async def _held_twice_more(placer, since: int) -> int:
    """Wait until the placer has held a request for readiness on two more turns than `since`
    (the later one decided on whatever it read before the first); returns the count."""
    await until(lambda: placer.decisions.get("held_not_ready", 0) >= since + 2, 15,
                "the placer to hold the request twice more")
    return placer.decisions["held_not_ready"]


async def test_a_request_waits_while_profiling_and_is_served_once_ready(servers, fresh):
    nc, redis = fresh
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    finals = Finals(nc)
    req = request("waits", model=NEW, ttft=30.0)
    await finals.watch(req.request_id)
    async with running_placer(servers) as placer:
        await publish(nc, req)
        await set_hardware_state(redis, NEW, "gpu", ModelState.PROFILING, "profiling", 0.5)
        await _held_twice_more(placer, 0)  # held, not answered, while the model profiles
        assert node.commanded(req.request_id) == [] and req.request_id not in finals.got
        # A profile in Redis while the kind still profiles (as while a replaced checkpoint is
        # profiled again) is not served; the profiler's `ready` after storing it is.
        await save_profile(redis, gpu_profile(NEW))
        await set_hardware_state(redis, NEW, "gpu", ModelState.PROFILING, "profiling on torch", 0.9)
        await until(lambda: placer.port.perf.get(NEW, Hardware.GPU) is not None, 15,
                    "the placer to read the new profile")
        # Decided again with the profile read: still held.
        await _held_twice_more(placer, placer.decisions.get("held_not_ready", 0))
        assert node.commanded(req.request_id) == [] and req.request_id not in finals.got
        await set_hardware_state(redis, NEW, "gpu", ModelState.READY, "", 1.0)
        await until(lambda: node.commanded(req.request_id), 15, "the request placed once ready")
    assert req.request_id not in finals.got  # placed, not failed
    assert placer.decisions.get("not_ready", 0) == 0
    await node.stop()


async def test_past_its_ttft_while_not_ready_the_request_gets_a_clear_error(servers, fresh):
    nc, redis = fresh
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    finals = Finals(nc)
    req = request("late", model=NEW, ttft=1.5)
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id, 30)
    waited = time.time() - req.arrival
    assert final.finish_reason is FinishReason.ERROR and "no_profile" not in final.error
    code, message = parse_lifecycle_error(final.error)
    assert code == NOT_READY and "'fresh' is not ready yet: converting on gpu (queued)" in message
    assert waited >= 1.5  # it waited out its TTFT SLO for the profile
    assert node.commands == []
    await node.stop()


async def test_a_failed_model_errors_at_once_with_the_reason(servers, fresh):
    nc, redis = fresh
    await set_hardware_state(redis, NEW, "gpu", ModelState.FAILED, "OSError: no weights in /x")
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    finals = Finals(nc)
    req = request("broken", model=NEW, ttft=30.0)
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id, 20)
    assert time.time() - req.arrival < 15  # at once: not after its 30 s TTFT
    code, message = parse_lifecycle_error(final.error)
    assert code == FAILED and "failed on gpu: OSError: no weights in /x" in message
    assert node.commands == []
    await node.stop()


async def test_a_profiled_model_without_a_lifecycle_is_served_as_before(servers, conns):
    """`m` (the conftest's) has a profile and no state entry: placed with no Redis detour."""
    nc, redis = conns
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    req = request("plain")
    async with running_placer(servers):
        await publish(nc, req)
        await until(lambda: node.commanded(req.request_id), 15, "placed")
    await node.stop()


async def test_a_request_for_an_adapter_whose_lifecycle_failed_errors_at_once(servers, conns):
    """A node found the adapter's files broken: the placer fails its next requests without
    sending them to a node, with the reason and without the adapter's path."""
    nc, redis = conns
    adapter = dataclasses.replace(MODEL, name="ad", path="/adapters/ad", base_model=MODEL.name,
                                  weight_bytes=1024)
    await ModelRegistry(redis).register(adapter)
    await set_hardware_state(redis, "ad", "gpu", ModelState.FAILED,
                             "files missing or unreadable (found by node g0): /adapters/ad does "
                             "not exist")
    node = await FakeNode(nc, redis, empty_gpu("g0")).start()
    finals = Finals(nc)
    req = request("via-adapter", ttft=30.0, adapter="ad")
    await finals.watch(req.request_id)
    async with running_placer(servers):
        await publish(nc, req)
        final = await finals.wait(req.request_id, 20)
    code, message = parse_lifecycle_error(final.error)
    assert code == FAILED and "'ad' could not be made servable: failed on gpu: files missing" \
        in message
    assert "/adapters/ad" not in message and "<model directory> does not exist" in message
    assert node.commands == []
    await node.stop()


async def test_a_model_registered_again_after_failing_is_not_failed_from_a_cached_state(
        servers, conns):
    """Readiness caches lifecycle states briefly; a failure is final for its request, so it is
    never judged on the cache: a model fixed and registered a moment ago serves."""
    nc, redis = conns
    gate = ReadinessGate(redis)
    nodes, perf = [empty_gpu("g0")], PerfModel()
    perf.add(gpu_profile(MODEL.name))
    await set_hardware_state(redis, MODEL.name, "gpu", ModelState.FAILED, "files missing")
    assert (await gate.check(MODEL, nodes, perf)).verdict is Verdict.FAIL  # now in the cache
    await set_hardware_state(redis, MODEL.name, "gpu", ModelState.READY, "registered again", 1.0)
    assert (await gate.check(MODEL, nodes, perf)).verdict is Verdict.SERVE
