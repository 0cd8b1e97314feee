"""A failed load, told by its cause: a model's (or LoRA adapter's) files missing or broken are
not an engine's bad luck, and the client, the placer and the operator all hear so.

A LOAD memory op that raised is classified on its worker thread (`problem`): when the
directory's files are not whole (`shared.registry.files_problem`), the op fails with
`FilesBroken`, whose text is a coded lifecycle failure (`lifecycle_error(FAILED, reason)`) that
the completion carries through the reservation-station stream. Its completion (`ended`) then
ends the requests that waited for the load with the error the placer gives a failed lifecycle
(`shared.model_state.failed_error`), marks the model failed on this node's hardware kind in its
lifecycle (GET /admin/models says why, and the placer answers every later request for it at
once, in the same words), and keeps each final message in Redis too (`shared.outcomes`). Any
other failure ends them with `<what> failed to load: <error>`, as before: nothing says the
model cannot be served.
"""

from __future__ import annotations

import logging

from services.node.book import Live
from services.node.lifecycle import RequestLifecycle
from services.node.runtime import NodeRuntime
from shared.model_state import (FAILED, ModelState, failed_error, failed_locally, files_failure,
                                lifecycle_error, parse_lifecycle_error, set_hardware_state)
from shared.outcomes import record_outcome
from shared.registry import display_name, files_problem
from shared.schemas import FinishReason, ModelRecord, TokenMessage

log = logging.getLogger("slinfer.node")


class FilesBroken(Exception):
    """A load failed because the model's files are missing or broken (text: a coded reason)."""


class LoadFailures:
    def __init__(self, rt: NodeRuntime, requests: RequestLifecycle) -> None:
        self.rt, self.requests = rt, requests

    def problem(self, record: ModelRecord) -> FilesBroken | None:
        """(Worker thread, after `record`'s load raised) the files' fault, if they have one."""
        problem = files_problem(record.path, adapter=record.base_model is not None)
        if problem is None:
            return None
        reason = files_failure(problem, f"node {self.rt.s.node_id}")
        return FilesBroken(lifecycle_error(FAILED, reason))

    async def ended(self, record: ModelRecord | None, what: str, error: str | None,
                    waiting: list[Live]) -> None:
        """The load of `record` (`what`: "model", "LoRA adapter") failed with `error`; `waiting`:
        the requests that waited for it."""
        coded = parse_lifecycle_error(error)
        broken = coded is not None and coded[0] == FAILED and record is not None
        if broken:  # the placer's words for a failed lifecycle, on this node's kind
            kind = self.rt.s.hardware
            message = failed_error(display_name(record), failed_locally([kind], coded[1]), [kind],
                                   hide=(record.path,))
        else:
            message = f"{what} failed to load: {error}"
        # Between two iterations: the core still holds the waiting requests (the engine never
        # got them); no iteration may pick one before it has ended.
        async with self.rt.iter_lock:
            finals = [await self.requests.finish(live, FinishReason.ERROR, message)
                      for live in waiting]
        if broken:
            await self._mark_failed(record, coded[1])
            for final in finals:
                await self._keep(final)

    async def _mark_failed(self, record: ModelRecord, reason: str) -> None:
        """The model's lifecycle says failed on this node's kind (with Redis down, the next
        failed load writes it)."""
        log.error("node %s: %s cannot be served: %s", self.rt.s.node_id, record.name, reason)
        try:
            await set_hardware_state(self.rt.redis, record.name, self.rt.s.hardware,
                                     ModelState.FAILED, reason)
        except Exception as exc:
            log.warning("could not mark %s failed in its lifecycle: %r", record.name, exc)

    async def _keep(self, final: TokenMessage) -> None:
        """The answer outlives this node: a resumed attempt would meet the same files."""
        try:
            await record_outcome(self.rt.redis, final)
        except Exception as exc:  # Redis down: the node still answers STATUS with it
            log.warning("outcome of %s not kept: %r", final.request_id, exc)
