"""Chunked prefill on a real node worker (real NATS, valkey, torch engine), issue 26: with
SLINFER_PREFILL_CHUNK_TOKENS on (`CoreConfig.prefill_chunk_tokens`), a long prompt admitted next
to a decoding request on the same instance runs as the core's chunks, each sized to that
request's slack, and its greedy output is what one whole prefill gives. Off, the same prompt is
refused: run whole, it would hold the decoding request past its next deadline.

The stored profile prices prefills (and chunks) slower than the tiny model measured, so that
the long prompt's whole prefill is predicted at `WHOLE_S`, several times the decoding request's
TTFT (twice its own prefill as predicted, 1 s at least): when the long prompt arrives, that request has a few
tokens and its slack is about its TTFT, which holds part of the prompt, not all of it (it would
take a lead of `WHOLE_S` / TPOT tokens, far more than this box decodes while the test admits). The chunking is then the core's decision on that
profile, asserted on the node's recorded iterations (what ran, in which chunks), not on
wall-clock times. Calibration is off, so the node keeps deciding with that profile.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.cluster import save_profile
from shared.core.calibration import calibrated
from shared.core.config import CoreConfig
from shared.core.iteration import IterationKind

from tests.node.harness import Harness, until
from tests.reference import greedy_output

pytestmark = [pytest.mark.integration]

WHOLE_S = 3.0  # the long prompt's whole prefill, as the stored profile predicts it
LONG, SHORT = 1000, 32  # prompt tokens of the long request and of the decoding one
SHORT_TPOT, SHORT_TOKENS = 0.1, 120  # the decoding request's


async def run_long_beside_decode(connections, model_dir, profile, chunk_tokens: int):
    """A decoding request, then a long prompt on its instance: the two requests, the long one's
    admission reply, their final messages and the node's iteration records of the two."""
    nc, redis = connections
    slower = WHOLE_S / profile.prefill_s(LONG)
    short_ttft = max(1.0, 2 * slower * profile.prefill_s(SHORT))
    assert short_ttft < WHOLE_S / 2  # the profile's shape
    await save_profile(redis, replace(calibrated(profile, slower, 1.0), model="alpha"))
    # Validation simulates the long prefill's chunks between the decoding request's steps (one
    # every TPOT for WHOLE_S): more steps than the default horizon.
    core = CoreConfig(keep_alive_s=30.0, prefill_chunk_tokens=chunk_tokens,
                      shadow_max_steps=4096)
    h = Harness(nc, redis, model_dir, 512 * 1024**2, f"chunk-{chunk_tokens}", calibrate=False,
                core=core)
    await h.worker.start()
    try:
        short, reply = await h.admit("alpha", SHORT, SHORT_TOKENS, ttft=short_ttft,
                                     tpot=SHORT_TPOT)
        assert reply.accepted, reply.reason
        await until(lambda: len(h.tokens[short.request_id]) >= 1, timeout_s=30)
        long, reply = await h.admit("alpha", LONG, 6, ttft=10 * WHOLE_S, tpot=1.0)
        await h.wait([short, long] if reply.accepted else [short], timeout=120)
        ids = {short.request_id, long.request_id}
        history = [rec for rec in h.worker.history
                   if ids & set(rec.request_ids) or (rec.chunk and rec.chunk[0] in ids)]
    finally:
        await h.worker.stop()
    return short, long, reply, h.finals, history


async def test_a_long_prompt_beside_a_decode_runs_in_chunks_with_the_whole_prefills_output(
        connections, model_dir, profile):
    short, long, reply, finals, history = await run_long_beside_decode(connections, model_dir,
                                                                       profile, 16)
    assert reply.accepted, reply.reason
    rid = long.request_id
    chunks = [rec.chunk for rec in history if rec.chunk and rec.chunk[0] == rid]
    assert len(chunks) >= 2, chunks  # the slack held part of the prompt, not all of it
    assert all(rec.kind is IterationKind.PREFILL for rec in history if rec.chunk)
    # Chunks follow each other over the whole prompt; only the last gives the first token.
    assert [c[1] for c in chunks] == [0, *(c[1] + c[2] for c in chunks[:-1])]
    assert chunks[-1][1] + chunks[-1][2] == LONG
    assert [c[3] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    first_chunk = next(i for i, rec in enumerate(history) if rec.chunk and rec.chunk[0] == rid)
    assert short.request_id in history[first_chunk - 1].request_ids  # it was decoding then
    assert all(not rec.request_ids for rec in history if rec.chunk and not rec.chunk[3])
    # Each request's output is what it gets alone from whole prefills.
    for req in (long, short):
        final = finals[req.request_id]
        assert final.error is None
        assert final.output_token_ids == greedy_output(model_dir, req.prompt_token_ids,
                                                      req.max_tokens)


async def test_off_the_long_prompt_is_refused_for_the_decoding_requests_sake(
        connections, model_dir, profile):
    short, _, reply, finals, history = await run_long_beside_decode(connections, model_dir,
                                                                    profile, 0)
    assert not reply.accepted and reply.reason == "headroom"
    assert not any(rec.chunk for rec in history)
    assert finals[short.request_id].output_token_ids == greedy_output(
        model_dir, short.prompt_token_ids, short.max_tokens)
