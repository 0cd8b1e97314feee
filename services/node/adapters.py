"""LoRA adapters on a node (issue 12; ServerlessLoRA §4.4).

A request for an adapter comes with `model` = its backbone and `adapter` = the adapter's registry
id. It is admitted to a backbone instance; where that instance lacks the adapter, the core holds
the adapter's bytes and issues a LOAD memory op for it (its key names the instance and the
adapter), executed like any other memory op (`run_op`): the request joins the engine once the
adapter is loaded (`after_load`), or fails with it (`LoadFailures`: broken files fail the
adapter's lifecycle too). Instance unloads take their adapters with them.
"""

from __future__ import annotations

import time

from services.node.book import RequestBook
from services.node.engines.base import ServesAdapters
from services.node.lifecycle import RequestLifecycle
from services.node.load_failure import LoadFailures
from services.node.runtime import NodeRuntime
from shared.core.memory import MemOp, MemOpKind
from shared.core.types import AdapterSpec
from shared.registry import ModelRegistry
from shared.schemas import InferenceRequest, MemOpCompletion, ModelRecord, NodeReply


class Adapters:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 failures: LoadFailures) -> None:
        self.rt, self.book, self.requests, self.failures = rt, book, requests, failures
        self.records: dict[str, ModelRecord] = {}  # adapters by registry id

    async def spec(self, req: InferenceRequest,
                   record: ModelRecord) -> AdapterSpec | None | NodeReply:
        """The request's adapter for the core (None: the plain backbone), or the refusal."""
        if req.adapter is None:
            return None
        adapter = self.records.get(req.adapter)
        if adapter is None:
            try:
                adapter = await ModelRegistry(self.rt.redis).get(req.adapter)
            except Exception as exc:  # Redis blip: the placer asks again
                return NodeReply(False, f"error: reading the adapter's record: {exc!r}")
        if adapter is None or adapter.base_model != record.name:
            return NodeReply(False, f"bad_command: {req.adapter!r} is not a LoRA adapter of "
                                    f"{record.name!r}")
        self.records[req.adapter] = adapter
        return AdapterSpec(adapter.name, adapter.weight_bytes)

    def run_op(self, op: MemOp, instance_id: str, name: str) -> None:
        """An adapter's memory op, on a worker thread: load it into (or drop it from) the
        instance's engine. A load waits for the engine, whose own load may be running."""
        if op.kind is MemOpKind.UNLOAD:
            engine = self.rt.engines.get(instance_id)
            if isinstance(engine, ServesAdapters):
                engine.unload_adapter(name)
            return
        while (engine := self.rt.engines.get(instance_id)) is None:
            if self.rt.sched.node.instance(instance_id) is None or self.rt.stopping:
                return  # the instance is gone (its load failed or was cancelled)
            time.sleep(0.005)
        if not isinstance(engine, ServesAdapters):
            raise RuntimeError(f"the {engine.name} engine does not serve LoRA adapters")
        engine.load_adapter(name, self.records[name].path)

    async def after_load(self, instance_id: str, name: str, done: MemOpCompletion) -> None:
        """An adapter's load completed: its waiting requests join the engine, or fail with it."""
        waiting = [lv for lv in self.book.live.values() if lv.instance_id == instance_id
                   and lv.request.adapter == name and not lv.in_engine]
        if done.ok:
            if self.rt.loaded(instance_id):  # else the instance's own load completion adds them
                for live in waiting:
                    self.requests.engine_add(live)
            return
        # The core counted the load done: detach it before anything awaits, or a request
        # admitted meanwhile would run through an adapter the engine does not have.
        self.rt.start_ops(self.rt.sched.detach_adapter(instance_id, name, time.time()))
        await self.failures.ended(self.records.get(name), "LoRA adapter", done.error, waiting)
