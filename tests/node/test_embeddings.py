"""An embedding request on a real node worker (real NATS, valkey, torch engine); the test plays
the placer. It joins an instance like a generation, runs one prefill alone (the core's pick),
and ends with that prefill: its final message carries the pooled vector and no token, nothing of
it is left in the engine or the core, and a generation on the same instance runs on unharmed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shared.core.iteration import IterationKind
from shared.schemas import CommandKind, Embedding, FinishReason, NodeCommand, RequestState

from tests.node.harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_an_embedding_is_one_prefill_beside_a_generation(connections, model_dir):
    nc, redis = connections
    h = Harness(nc, redis, model_dir, 512 * 1024**2, "embed-a")
    await h.worker.start()
    try:
        gen, reply = await h.admit("alpha", prompt_len=64, max_tokens=30, ttft=30.0, tpot=5.0)
        assert reply.accepted, reply.reason
        emb = replace(h.request("alpha", prompt_len=40, max_tokens=0, ttft=30.0, tpot=5.0),
                      embedding=Embedding("mean", True))
        await h.watch(emb)
        reply = await h.command(NodeCommand(CommandKind.ADMIT, request=emb,
                                            instance_id=h.instances["alpha"]))
        assert reply.accepted, reply.reason
        await h.wait([gen, emb])
        status = await h.command(NodeCommand(CommandKind.STATUS, request_id=emb.request_id))
        engine = h.worker.rt.engines[h.instances["alpha"]]
        left_in_engine, hidden = emb.request_id in engine.requests, engine.config.hidden_size
        in_core = [r.request_id for i in h.worker.rt.sched.view().instances for r in i.requests]
        history = [rec for rec in h.worker.history if emb.request_id in rec.request_ids]
    finally:
        await h.worker.stop()
    final = h.finals[emb.request_id]
    assert final.finish_reason is FinishReason.STOP and final.error is None
    assert final.output_token_ids == [] and final.token_ids == [] and h.tokens[emb.request_id] == []
    assert final.prompt_tokens == 40 and final.prefill_s is not None
    vector = np.frombuffer(final.embedding, dtype="<f4")
    assert vector.shape == (hidden,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert [rec.kind for rec in history] == [IterationKind.PREFILL]  # and never in a decode
    assert not left_in_engine and emb.request_id not in in_core
    # The watchdog's question gets the final message again, vector included.
    assert status.reason == RequestState.FINISHED.value
    assert status.final.embedding == final.embedding
    assert len(h.finals[gen.request_id].output_token_ids) == 30
