"""Live migration, destination side: BEGIN admits the request (loading the model if it must) and
computes the KV of its tokens so far, parked out of the batches; EXTEND computes the source's
new tokens; COMMIT takes the request over and streams the token sampled after the last delta;
ABORT forgets it. Any failure refuses: the source keeps the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from services.node.adapters import Adapters
from services.node.book import Incoming, RequestBook, sampling_params
from services.node.cluster_sync import ClusterSync
from services.node.engines import resolve_engine
from services.node.lifecycle import RequestLifecycle
from services.node.memops import MemOps
from services.node.runtime import NodeRuntime
from shared.cluster import model_spec, request_view
from shared.core.migration import MigrationPolicy, engine_refusal
from shared.schemas import CommandKind, NodeCommand, NodeReply

log = logging.getLogger("slinfer.node")


class MigrationDestination:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 adapters: Adapters, memops: MemOps, sync: ClusterSync,
                 policy: MigrationPolicy | None = None) -> None:
        self.rt, self.book, self.requests = rt, book, requests
        self.adapters, self.memops, self.sync = adapters, memops, sync
        self.policy = policy or MigrationPolicy()
        self.handlers = {CommandKind.MIGRATE_BEGIN: self.begin,
                         CommandKind.MIGRATE_EXTEND: self.extend,
                         CommandKind.MIGRATE_COMMIT: self.commit,
                         CommandKind.MIGRATE_ABORT: self.abort}

    def cleanup(self, cmd: NodeCommand) -> None:
        """A round failed: the request's copy here goes (the source keeps it)."""
        self.drop(cmd.request.request_id if cmd.request else cmd.request_id or "")

    async def begin(self, cmd: NodeCommand) -> NodeReply:
        req = cmd.request
        if req is None:
            return NodeReply(False, "bad_command: migrate_begin without a request")
        rid = req.request_id
        if self.rt.draining:
            return NodeReply(False, "draining")
        if rid in self.book.live or rid in self.book.incoming:
            return NodeReply(False, "already_here")
        record = cmd.model if cmd.instance_id is None else self.rt.records.get(cmd.instance_id)
        if record is None:
            return NodeReply(False, "instance_gone" if cmd.instance_id else "bad_command: no model")
        refusal = engine_refusal(resolve_engine(record.engine, self.rt.s.device))
        if refusal is not None:
            return NodeReply(False, f"engine: {refusal}")
        await self.sync.learn_model(record, backbone=False)
        adapter = await self.adapters.spec(req, record)  # LoRA (issue 12)
        if isinstance(adapter, NodeReply):
            return adapter
        sched = self.rt.sched
        result = sched.admit(request_view(req), cmd.instance_id, model_spec(record), time.time(),
                             adapter)
        if not self.memops.carry_out(result, record, cold=cmd.instance_id is None):
            return NodeReply(False, result.admission.reason.value)
        iid = result.instance_id
        view = sched.park(iid, rid)  # admitted (memory counted), but not to be batched yet
        incoming = Incoming(replace(req, grace_s=result.admission.grace_s, target_node=None,
                                    target_instance=None), iid, view, list(req.resumed_token_ids))
        self.book.incoming[rid] = incoming
        if not await self._until_loaded(iid, self.policy.begin_timeout_s, req.adapter):
            self.drop(rid)
            return NodeReply(False, "load_failed")
        async with self.rt.iter_lock:
            engine = self.rt.engines[iid]
            engine.add_request(rid, incoming.all_tokens, sampling_params(req, len(incoming.known)))
            step = await asyncio.to_thread(engine.prefill, rid)
        incoming.pending, incoming.pending_logprobs = step.tokens[rid], step.logprobs.get(rid)
        return NodeReply(True, "prefilled", iid, generated=len(incoming.known))

    async def _until_loaded(self, iid: str, timeout: float, adapter: str | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while not self.rt.loaded(iid) or not self.rt.adapter_ready(iid, adapter):
            if self.rt.sched.node.instance(iid) is None or time.monotonic() > deadline:
                return False  # its load failed (the instance is gone) or takes too long
            await asyncio.sleep(0.01)
        return True

    async def _catch_up(self, rid: str, tokens: list[int], seq: int) -> Incoming | NodeReply:
        """Compute the KV of the source's tokens `tokens` (output index `seq` on)."""
        incoming = self.book.incoming.get(rid)
        if incoming is None or incoming.pending is None:
            return NodeReply(False, "not_migrating")
        if seq != len(incoming.known):
            return NodeReply(False, f"out_of_step: have {len(incoming.known)} tokens, "
                                    f"got seq {seq}")
        if not tokens:
            return incoming
        async with self.rt.iter_lock:  # one pass over the new tokens only (LIVE_ENGINES extend)
            engine = self.rt.engines[incoming.instance_id]
            step = await asyncio.to_thread(engine.extend, rid, tokens)
        incoming.known.extend(tokens)
        incoming.pending, incoming.pending_logprobs = step.tokens[rid], step.logprobs.get(rid)
        return incoming

    async def extend(self, cmd: NodeCommand) -> NodeReply:
        done = await self._catch_up(cmd.request_id or "", cmd.tokens, cmd.seq)
        if isinstance(done, NodeReply):
            return done
        return NodeReply(True, "extended", done.instance_id, generated=len(done.known))

    async def commit(self, cmd: NodeCommand) -> NodeReply:
        """Take the request over: the source has stopped it. The token sampled after the last
        delta is the next output token, streamed with the next sequence number."""
        rid = cmd.request_id or ""
        done = await self._catch_up(rid, cmd.tokens, cmd.seq)
        if isinstance(done, NodeReply):
            return done
        gone = self.rt.sched.node.instance(done.instance_id) is None
        if done.cancelled or gone or self.rt.draining:
            self.drop(rid)
            return NodeReply(False, "cancelled" if done.cancelled else "draining"
                             if self.rt.draining else "instance_gone")
        del self.book.incoming[rid]
        output = list(done.known)
        req = replace(done.request, resumed_token_ids=output)
        # + the token below: it is the next output token
        self.rt.sched.commit_parked(done.instance_id, done.view, len(output) + 1, time.time())
        live = self.requests.adopt(req, done.instance_id, output, cold=False, in_engine=True)
        await self.requests.emit(live, done.pending, logprobs=done.pending_logprobs)
        self.rt.wake.set()
        return NodeReply(True, "admitted", done.instance_id, generated=len(output))

    async def abort(self, cmd: NodeCommand) -> NodeReply:
        self.drop(cmd.request_id or "")
        return NodeReply(True, "aborted")

    def drop(self, rid: str) -> None:
        incoming = self.book.incoming.pop(rid, None)
        if incoming is None:
            return
        engine = self.rt.engines.get(incoming.instance_id)
        if engine is not None:
            engine.release(rid)
