"""Two models on one real node worker (real NATS, valkey, torch engines); the test plays the placer.

1. Iterations interleave by headroom: the test reads the node's executed order and checks that every
   iteration went to the runnable instance with the least headroom, and that both models' requests
   meet every per-token deadline. The SLOs are a quiet box's, stretched by how much slower than
   its profile the node has measured this box to be (its calibration, after a warm-up): on a
   loaded box the calibrated node rightly refuses what the quiet box's SLOs ask of it.
2. Elastic memory vs a half-node static split: one burst per model, one after the other, fits the
   shared node (KV scales up for one model, lazily down, up for the other) and meets its SLOs; on a
   node with half the memory each burst is partly refused with reason `memory` - those requests
   could only wait.

SLOs are judged on the node's recorded timeline (when each iteration that produced a request's
token ended), not on when the test's subscriber saw the token; and a token may be late by at most
the longest iteration the node ran: the core decides with predictions, and how much one step on
this shared box overran its prediction is not the policy's doing. The decisions themselves (which
instance ran, what was admitted or refused and why) are asserted exactly.
"""

from __future__ import annotations

import pytest

from shared.core.calibration import DECODE
from shared.core.iteration import IterationKind
from shared.registry import model_record_from_dir

from tests.node.harness import MODELS, Harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _late_tokens(h: Harness, reqs, history) -> dict[str, tuple[int, float]]:
    """request id -> (token index, seconds late) of tokens that the node's timeline shows later
    than their deadline (ST + TTFT + TPOT*k) by more than the longest iteration it ran."""
    slack = max(rec.finished - rec.started for rec in history)
    late = {}
    for req in reqs:
        ends = [rec.finished for rec in history if req.request_id in rec.request_ids]
        assert len(ends) == req.max_tokens, (req.request_id, len(ends))  # every token recorded
        for k, end in enumerate(ends):
            over = end - (req.arrival + req.ttft_slo_s + req.tpot_slo_s * k)
            if over > slack:
                late[req.request_id] = (k, over)
                break
    return late


async def _box_slowness(h: Harness) -> float:
    """How many times slower than its measured profile this box decodes now, as the node itself
    learned it (its calibrated decode factor, at least 1): one warm-up request per model, whose
    instances stay loaded for what follows. The SLOs below are the quiet box's times that much
    longer, so a loaded box gives the node the same relative slack to schedule in."""
    warm = []
    for model in MODELS:
        req, reply = await h.admit(model, prompt_len=64, max_tokens=24, ttft=30.0, tpot=5.0)
        assert reply.accepted, reply.reason
        warm.append(req)
    await h.wait(warm)
    return max(1.0, *(h.worker.calibrator.factor(m, DECODE) for m in MODELS))


async def test_iterations_interleave_by_headroom_and_meet_slos(connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * 1024**2, "share-a")
    await h.worker.start()
    try:
        slow = await _box_slowness(h)
        reqs = []
        for model, ttft in (("alpha", 1.0), ("beta", 2.0), ("alpha", 1.5), ("beta", 2.5)):
            req, reply = await h.admit(model, prompt_len=64, max_tokens=30, ttft=ttft * slow,
                                       tpot=0.25 * slow)
            assert reply.accepted, (reply.reason, slow)
            reqs.append(req)
        await h.wait(reqs)
        ids = {r.request_id for r in reqs}
        history = [rec for rec in h.worker.history if ids & set(rec.request_ids)]
    finally:
        await h.worker.stop()
    ran = [rec.instance_id for rec in history]
    assert set(ran) == set(h.instances.values())  # both models' instances ran
    switches = sum(1 for a, b in zip(ran, ran[1:]) if a != b)
    assert switches >= 4  # interleaved at token granularity, not one model after the other
    for rec in history:  # every cycle picked the least-headroom runnable instance
        least = min(headroom for _, headroom in rec.considered)
        assert dict(rec.considered)[rec.instance_id] == pytest.approx(least)
    assert sum(rec.kind is IterationKind.PREFILL for rec in history) == 4
    assert all(len(h.finals[r.request_id].output_token_ids) == 30 for r in reqs)
    assert not _late_tokens(h, reqs, history), slow


async def _burst(h: Harness, model: str, n: int, ttft: float):
    out = [await h.admit(model, prompt_len=900, max_tokens=40, ttft=ttft) for _ in range(n)]
    return [r for r, _ in out], [rep for _, rep in out]


async def test_bursts_share_memory_that_a_static_split_cannot(connections, model_dir, profile):
    nc, redis = connections
    # This test is about memory: give the TTFT room for the whole burst's prefills (3x the
    # profile) so compute never decides; the paper's 1.76 s for 900 tokens is the floor.
    ttft = max(1.76, 3 * 8 * profile.prefill_s(900) + profile.load_s)
    rec = model_record_from_dir("alpha", model_dir)
    # One burst: 8 requests x (900 prompt + 40 output) tokens of KV = eq. 2 before the watermark.
    burst_kv = 8 * 940 * rec.kv_bytes_per_token
    floor_kv = rec.max_context * rec.kv_bytes_per_token  # L_min of the idle neighbour
    memory = 2 * rec.weight_bytes + int(burst_kv * 1.25) + int(floor_kv * 1.25) + 2 * 1024**2

    shared = Harness(nc, redis, model_dir, memory, "share-b")
    await shared.worker.start()
    try:
        served = []
        for model in MODELS:  # alpha's burst, then beta's: each has the node's spare memory
            reqs, replies = await _burst(shared, model, 8, ttft)
            assert [r.reason for r in replies] == ["admitted"] * 8
            await shared.wait(reqs)
            served += reqs
        history = list(shared.worker.history)
        assert not _late_tokens(shared, served, history)
    finally:
        await shared.worker.stop()

    for k, model in enumerate(MODELS):  # the same burst on half the node, alone
        half = Harness(nc, redis, model_dir, memory // 2, f"half-{k}")
        await half.worker.start()
        try:
            reqs, replies = await _burst(half, model, 8, ttft)
            refused = [r.reason for r in replies if not r.accepted]
            assert refused and set(refused) == {"memory"}
            await half.wait([r for r, rep in zip(reqs, replies) if rep.accepted])
        finally:
            await half.worker.stop()
