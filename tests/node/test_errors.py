"""The node worker's error paths on a real node worker (real NATS, valkey, torch engines); the test
plays the placer. In each case the failing request gets a clear answer (a refusal with its reason,
a final message with an error, or a hand-back to the request stream with its tokens) and nothing
else on the node is harmed: its other requests finish in full and it goes on admitting.

1. KV cache full at admission: a request whose KV the node's memory cannot hold is refused
   (`memory`) and leaves no trace; the requests already there finish.
2. KV cache full in the engine (its pool smaller than the core's accounting, e.g. block rounding):
   the iteration does not happen, the request with the most headroom is handed back to the request
   stream with its tokens so far, the other one goes on.
3. An engine exception in prefill or decode: that request ends with an `engine error` final
   message; the node serves the next requests.
4. A failed load (a model directory that is missing or holds a corrupt checkpoint): the waiting
   request ends with the coded `model_failed` error that says the files are missing or
   unreadable (kept in Redis too), the model's lifecycle says `failed` on the node's kind with
   the path, the instance and its memory are gone, the node serves another model. A load that
   fails with whole files (the engine's fault) ends it with `model failed to load` and leaves
   the lifecycle alone.
5. Preempt and take-back: PREEMPT_ADMIT with no destination hands the victim's request back to the
   request stream with every token it streamed; a redelivered copy of the old admission is not run
   twice, and the handed-back copy, admitted again, streams on with no gap and no duplicate.
6. A prompt the engine rejects when the request is added (a token id outside the vocabulary): on a
   warm instance the admission is refused or the request fails, never both (a refused request may
   be placed elsewhere); during a cold start the requests waiting on the same load are unharmed.
   (Both found a bug in the worker, since fixed.)
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from services.node.engines import create_engine
from shared.cluster import model_spec, request_view, save_profile
from shared.core.cost import kv_demand
from shared.core.memory import watermark_target
from shared.model_state import FAILED, ModelState, forget, get_status, parse_lifecycle_error
from shared.outcomes import read_outcome
from shared.schemas import CommandKind, FinishReason, InferenceRequest, NodeCommand, RequestState

from tests.node.harness import Harness, Requeued, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1024**2



def _kv_after(h: Harness, model: str, reqs) -> int:
    """The KV size an instance has once these requests joined it one by one (§VII-B)."""
    spec, kv = model_spec(h.records[model]), 0
    for k in range(1, len(reqs) + 1):
        need = kv_demand(spec, [request_view(r) for r in reqs[:k]])
        kv = max(kv, watermark_target(kv, need, h.worker.s.core.watermark) or kv)
    return kv


async def _admitted(h: Harness, model: str, prompt: int, out: int, ttft: float = 30.0):
    req, reply = await h.admit(model, prompt, out, ttft=ttft)
    assert reply.accepted, reply.reason
    return req


def _served_in_full(h: Harness, req: InferenceRequest) -> bool:
    final = h.finals[req.request_id]
    return (final.finish_reason is FinishReason.LENGTH and final.error is None
            and len(final.output_token_ids) == req.max_tokens and h.streamed_once(req))


def _is_idle(h: Harness) -> bool:
    return not h.worker.live and all(not i.requests for i in h.worker.sched.node.instances)


async def test_a_request_the_memory_cannot_hold_is_refused_and_the_others_finish(connections, model_dir):
    nc, redis = connections
    probe = Harness(nc, redis, model_dir, 1, "probe")
    two = [probe.request("alpha", 900, 60, ttft=30.0) for _ in range(2)]
    # Room for exactly what two requests grow the instance to: a third needs more KV than that.
    memory = probe.records["alpha"].weight_bytes + _kv_after(probe, "alpha", two) + 64 * 1024
    assert _kv_after(probe, "alpha", [*two, two[0]]) > _kv_after(probe, "alpha", two) + 64 * 1024
    h = Harness(nc, redis, model_dir, memory, "err-mem")
    await h.worker.start()
    try:
        running = [await _admitted(h, "alpha", 900, 60) for _ in range(2)]
        third, reply = await h.admit("alpha", 900, 60, ttft=30.0)
        assert not reply.accepted and reply.reason == "memory"
        assert third.request_id not in h.worker.live
        assert h.worker.status(third.request_id).reason == RequestState.UNKNOWN.value
        inst = h.worker.sched.node.instance(h.instances["alpha"])
        assert sorted(r.request_id for r in inst.requests) == sorted(r.request_id for r in running)
        await h.wait(running)
        assert all(_served_in_full(h, r) for r in running)
        assert third.request_id not in h.finals  # refused: nothing was ever streamed for it
    finally:
        await h.worker.stop()


async def test_an_engine_out_of_kv_blocks_hands_back_the_request_with_most_headroom(connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * MiB, "err-kv")
    requeued = Requeued()
    await requeued.start(nc)
    await h.worker.start()
    try:
        urgent = await _admitted(h, "alpha", 64, 200, ttft=5.0)
        relaxed = await _admitted(h, "alpha", 900, 200, ttft=120.0)  # more headroom: the victim
        await until(lambda: all(len(h.tokens[r.request_id]) >= 2 for r in (urgent, relaxed)),
                     what="both requests to decode")
        engine = h.worker.engines[h.instances["alpha"]]
        async with h.worker.rt.iter_lock:  # between two iterations: the pool shrinks to what is held
            engine.resize_kv(engine.memory().kv_used_bytes)
        await until(lambda: requeued.of(relaxed.request_id), what="the victim's hand-back")
        (back,) = requeued.of(relaxed.request_id)
        streamed = [t for m in h.messages[relaxed.request_id] for t in m.token_ids]
        assert back.resumed_token_ids == streamed and len(streamed) < relaxed.max_tokens
        assert back.prompt_token_ids == relaxed.prompt_token_ids
        assert h.worker.status(relaxed.request_id).reason == RequestState.MOVED.value
        assert relaxed.request_id not in h.finals  # handed back, not ended
        await h.wait([urgent])
        assert _served_in_full(h, urgent)
        await until(lambda: _is_idle(h), what="the node to be idle")
    finally:
        await h.worker.stop()
        await requeued.sub.unsubscribe()


def _failing(method, bad_id: str):
    """The engine's own method, except that it raises for one request (a fault in the engine)."""
    def call(arg):
        ids = [arg] if isinstance(arg, str) else arg
        if bad_id in ids:
            raise RuntimeError("injected engine fault")
        return method(arg)
    return call


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_an_engine_exception_ends_that_request_with_an_error_and_the_node_serves_on(
        connections, model_dir, phase):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * MiB, f"err-engine-{phase}")
    await h.worker.start()
    try:
        warm = await _admitted(h, "alpha", 64, 20)  # loads the instance, and proves it works
        await h.wait([warm])
        engine = h.worker.engines[h.instances["alpha"]]
        bad = h.request("alpha", 64, 50, ttft=30.0)
        setattr(engine, phase, _failing(getattr(engine, phase), bad.request_id))
        await h.watch(bad)
        reply = await h.command(NodeCommand(CommandKind.ADMIT, request=bad,
                                            instance_id=h.instances["alpha"]))
        assert reply.accepted, reply.reason
        await h.wait([bad])
        final = h.finals[bad.request_id]
        assert final.finish_reason is FinishReason.ERROR
        assert final.error == "engine error: injected engine fault"
        # Prefill fails before the first token; decode after it (the first came from the prefill).
        assert len(final.output_token_ids) == (0 if phase == "prefill" else 1)
        after = [await _admitted(h, "alpha", 64, 30) for _ in range(2)]
        await h.wait(after)
        assert all(_served_in_full(h, r) for r in after)
        await until(lambda: _is_idle(h), what="the node to be idle")
    finally:
        await h.worker.stop()


def _corrupt_copy(model_dir: str, dest) -> str:
    """The model's directory with every checkpoint file overwritten by garbage."""
    shutil.copytree(model_dir, dest)
    weights = [p for p in dest.iterdir() if p.suffix in (".safetensors", ".bin")]
    assert weights
    for p in weights:
        p.write_bytes(b"not a checkpoint" * 64)
    return str(dest)


async def _outcome_is(redis, req, final) -> bool:
    return await read_outcome(redis, req.request_id, req.attempt) == final


@pytest.mark.parametrize("fault", ["missing", "corrupt"])
async def test_a_failed_load_ends_the_waiting_request_and_frees_the_instance(
        connections, model_dir, profile, tmp_path, fault):
    nc, redis = connections
    model = f"broken-{fault}"
    await save_profile(redis, replace(profile, model=model))
    await forget(redis, model)
    h = Harness(nc, redis, model_dir, 512 * MiB, f"err-load-{fault}")
    path = str(tmp_path / "gone") if fault == "missing" else _corrupt_copy(model_dir, tmp_path / "bad")
    h.records[model] = replace(h.records["alpha"], name=model, path=path)
    await h.worker.start()
    try:
        req, reply = await h.admit(model, 64, 20, ttft=30.0)
        if reply.accepted:  # a cold start: the load itself finds the fault
            await h.wait([req])
            final = h.finals[req.request_id]
            assert final.finish_reason is FinishReason.ERROR and final.output_token_ids == []
            code, message = parse_lifecycle_error(final.error)
            assert code == FAILED and f"The model {model!r} could not be made servable: " \
                "failed on cpu: files missing or unreadable (found by node " in message
            assert path not in message and "<model directory>" in message
            # The node marks the model failed and keeps the answer just after it sends it.
            await until(lambda: _outcome_is(redis, req, final), what="the kept outcome")
            step = (await get_status(redis, model)).kind("cpu")
            assert step.state is ModelState.FAILED and path in step.reason
            iid = reply.instance_id
            await until(lambda: h.worker.sched.node.instance(iid) is None, what="the unload")
            assert iid not in h.worker.engines and iid not in h.worker.records
        else:  # refused up front: as good, if it says why
            assert reply.reason and req.request_id not in h.worker.live
        assert h.worker.sched.ledger.pessimistic == 0  # no memory held for the broken model
        good = await _admitted(h, "alpha", 64, 20)
        await h.wait([good])
        assert _served_in_full(h, good)
    finally:
        await h.worker.stop()


class _LoadFails:
    """An engine factory whose engines fail to load with whole files (out of memory, say)."""

    def __init__(self, real) -> None:
        self.real = real

    def __call__(self, *args, **kwargs):
        engine = self.real(*args, **kwargs)

        def load() -> None:
            raise RuntimeError("injected: out of memory while loading")

        engine.load = load
        return engine


async def test_a_load_that_fails_with_whole_files_leaves_the_lifecycle_alone(
        connections, model_dir, profile):
    nc, redis = connections
    await save_profile(redis, replace(profile, model="unlucky"))
    await forget(redis, "unlucky")
    h = Harness(nc, redis, model_dir, 512 * MiB, "err-load-engine")
    h.records["unlucky"] = replace(h.records["alpha"], name="unlucky")
    h.worker.memops.engine_factory = _LoadFails(create_engine)
    await h.worker.start()
    try:
        req, reply = await h.admit("unlucky", 64, 20, ttft=30.0)
        assert reply.accepted, reply.reason
        await h.wait([req])
        final = h.finals[req.request_id]
        assert final.finish_reason is FinishReason.ERROR
        assert final.error == "model failed to load: injected: out of memory while loading"
        assert await get_status(redis, "unlucky") is None  # nothing says it cannot be served
        assert await read_outcome(redis, req.request_id, req.attempt) is None
    finally:
        await h.worker.stop()


async def test_preempt_hands_the_victims_request_back_and_it_streams_on_once(connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 1024 * MiB, "err-preempt")
    requeued = Requeued()
    await requeued.start(nc)
    await h.worker.start()
    try:
        for _ in range(2):  # alpha's instance grows past beta's: beta is the smaller neighbour
            await _admitted(h, "alpha", 900, 250)
        victim = await _admitted(h, "beta", 64, 400)
        beta_iid = h.instances["beta"]
        await until(lambda: len(h.tokens[victim.request_id]) >= 5, what="the victim to stream")
        newcomer = h.request("alpha", 900, 20, ttft=30.0)
        await h.watch(newcomer)
        reply = await h.command(NodeCommand(CommandKind.PREEMPT_ADMIT, request=newcomer,
                                            instance_id=h.instances["alpha"],
                                            preempt_instance_ids=[beta_iid]))
        assert reply.accepted, reply.reason
        (moved,) = reply.evicted
        streamed = [t for m in h.messages[victim.request_id] for t in m.token_ids]
        assert moved.request_id == victim.request_id and moved.resumed_token_ids == streamed
        assert moved.target_node is None  # no destination in the plan: any placer may place it
        await until(lambda: requeued.of(victim.request_id), what="the hand-back on the stream")
        assert requeued.of(victim.request_id)[0].resumed_token_ids == streamed
        assert h.worker.status(victim.request_id).reason == RequestState.MOVED.value
        await until(lambda: h.worker.sched.node.instance(beta_iid) is None, what="beta's unload")

        # The stream redelivers the old admission (its ack was lost): not run a second time.
        again = await h.command(NodeCommand(CommandKind.ADMIT, request=victim, instance_id=None,
                                            model=h.records["beta"]))
        assert again.accepted and again.reason == "already_moved"
        assert victim.request_id not in h.worker.live

        # The handed-back copy, placed again (here: on this node, a cold start), streams on.
        h.instances.pop("beta")
        back = await h.command(NodeCommand(CommandKind.ADMIT, request=moved, instance_id=None,
                                           model=h.records["beta"]))
        assert back.accepted, back.reason
        await h.wait([victim, newcomer], timeout=120)
        final = h.finals[victim.request_id]
        assert final.finish_reason is FinishReason.LENGTH and len(final.output_token_ids) == 400
        assert final.output_token_ids[:len(streamed)] == streamed
        assert h.streamed_once(victim)
        assert h.finals[newcomer.request_id].error is None
    finally:
        await h.worker.stop()
        await requeued.sub.unsubscribe()


def _out_of_vocabulary(h: Harness, model: str) -> InferenceRequest:
    """A request whose prompt holds a token id the model does not have: the engine rejects it
    when it is added (a tokenizer and model out of step, or a client sending raw ids)."""
    req = h.request(model, 16, 10, ttft=30.0)
    return replace(req, prompt_token_ids=[*req.prompt_token_ids[:-1], 10**7])


async def test_a_prompt_the_engine_rejects_on_a_warm_instance_is_refused_or_failed_not_both(
        connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * MiB, "err-vocab-warm")
    await h.worker.start()
    try:
        warm = await _admitted(h, "alpha", 64, 5)
        await h.wait([warm])
        bad = _out_of_vocabulary(h, "alpha")
        await h.watch(bad)
        reply = await h.command(NodeCommand(CommandKind.ADMIT, request=bad,
                                            instance_id=h.instances["alpha"]))
        if reply.accepted:  # then it must end with a clear error
            await h.wait([bad])
            assert h.finals[bad.request_id].finish_reason is FinishReason.ERROR
        good = await _admitted(h, "alpha", 64, 20)
        await h.wait([good])
        assert _served_in_full(h, good)
        if not reply.accepted:
            # A refusal: the placer may place it elsewhere, so this node must not answer it. The
            # node answered `good` after whatever it did with `bad` (one publisher, in order).
            assert bad.request_id not in h.finals
    finally:
        await h.worker.stop()


async def test_a_prompt_the_engine_rejects_during_a_cold_start_harms_no_other_request(
        connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * MiB, "err-vocab-cold")
    # A slow disk: the load waits until both requests are admitted (they wait for the instance).
    loading, run_op = __import__("threading").Event(), h.worker.memops.run
    h.worker.memops.run = lambda op: (loading.wait(30), run_op(op))[1]
    await h.worker.start()
    try:
        bad = _out_of_vocabulary(h, "alpha")
        await h.watch(bad)
        first = await h.command(NodeCommand(CommandKind.ADMIT, request=bad, model=h.records["alpha"]))
        assert first.accepted, first.reason
        h.instances["alpha"] = first.instance_id
        good = await _admitted(h, "alpha", 64, 20)
        loading.set()
        await h.wait([bad, good])
        assert h.finals[bad.request_id].finish_reason is FinishReason.ERROR
        assert _served_in_full(h, good), h.finals[good.request_id]
    finally:
        loading.set()
        await h.worker.stop()
