"""Is a request's model servable yet? A registered model becomes servable once its lifecycle
(`shared.model_state`: converting -> profiling -> ready) stored a profile for a hardware kind
the cluster has. Before that the core would only answer `no_profile` on every node and drop the
request as if the cluster were overloaded; instead:

- the model is still converting or profiling (also when a profile was just stored that this
  placer has not read yet: it re-reads them; a kind whose lifecycle runs again, e.g. for a
  replaced checkpoint, does not serve on its old profile): the request stays queued until its
  TTFT deadline, then fails with an error that says the model is not ready, with the state and
  progress;
- its lifecycle failed on every kind the cluster has: it fails at once, with the reason;
- it has no profile and no lifecycle (registered around the admin API and never profiled): it
  fails at once and says how to profile it;
- its LoRA adapter's lifecycle failed (a node found the adapter's files broken): it fails at
  once, with the reason (`judge_adapter`).

The errors carry a code (`shared.model_state.lifecycle_error`) the gateway maps to a 503 with
`model_not_ready` or `model_failed`. `judge` is the pure rule; `ReadinessGate` feeds it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace

from redis.asyncio import Redis

from services.placer.intake import Pending, RequestIntake
from services.placer.port import PlacerPort
from services.placer.tracing import decision_span
from shared.cluster import request_view
from shared.core.perf_model import PerfModel
from shared.core.types import Hardware, NodeView
from shared.model_state import (NOT_READY, ModelState, ModelStatus, failed_error, get_status,
                                lifecycle_error)
from shared.registry import display_name
from shared.schemas import FinishReason, ModelRecord

STATUS_TTL_S = 0.25  # a queued request is re-judged every few tens of ms: read Redis less often
_WAITING = (ModelState.CONVERTING, ModelState.PROFILING)


class Verdict(str, enum.Enum):
    SERVE = "serve"  # profiled for a kind the cluster has (or no node is up): place it
    WAIT = "wait"  # keep it queued; past its TTFT deadline, fail it with `message`
    FAIL = "fail"  # fail it now with `message`


@dataclass(frozen=True)
class Readiness:
    verdict: Verdict
    message: str = ""  # an error text made by `lifecycle_error`
    refresh: bool = False  # a kind is ready but the placer's profiles predate it: reload them


def judge(model: str, status: ModelStatus | None, profiled: set[str], present: set[str]) -> Readiness:
    """The rule. `profiled`: kinds the placer has a profile of `model` for; `present`: kinds of
    the live nodes (empty: none up, then every kind the lifecycle covers counts). A profiled
    kind serves unless its lifecycle is under way again or failed (a replaced checkpoint). The
    profiler stores a profile before it reports `ready`, and a node re-reads the profiles before
    it refuses a model it has none of, so `ready` can be served at once."""
    servable = {k for k in profiled
                if status is None or (s := status.kind(k)) is None or s.state is ModelState.READY}
    if servable & present or (servable and not present):
        return Readiness(Verdict.SERVE)
    if status is None:
        kinds = ", ".join(sorted(present)) or "any hardware"
        return Readiness(Verdict.FAIL, lifecycle_error(NOT_READY, (
            f"The model {model!r} has no profile for {kinds} and no profiling was started; "
            "register it again (POST /admin/models with replace=true) or run `slinfer profile`.")))
    kinds = sorted(present & set(status.hardware)) if present else sorted(status.hardware)
    steps = {k: status.kind(k) for k in kinds}
    if any(s is not None and s.state is ModelState.READY for s in steps.values()):
        return Readiness(Verdict.WAIT, _not_ready(model, status, kinds), refresh=True)
    if any(s is not None and s.state in _WAITING for s in steps.values()):
        return Readiness(Verdict.WAIT, _not_ready(model, status, kinds))
    if kinds:  # every kind the cluster has failed
        return Readiness(Verdict.FAIL, failed_error(model, status, kinds))
    return Readiness(Verdict.FAIL, lifecycle_error(NOT_READY, (
        f"The model {model!r} is not profiled for the hardware of the live nodes "
        f"({', '.join(sorted(present))}); its lifecycle: {status.describe()}.")))


def judge_adapter(adapter: str, status: ModelStatus | None, present: set[str]) -> Readiness:
    """A LoRA adapter runs on its backbone's profile and lifecycle; its own lifecycle only says
    whether a node found its files broken (`shared.model_state.files_failure`): failed on every
    kind the cluster has (on every kind it names, with no node up), the request fails with why."""
    if status is None:
        return Readiness(Verdict.SERVE)
    kinds = sorted(present & set(status.hardware)) if present else sorted(status.hardware)
    steps = [status.kind(k) for k in kinds]
    if steps and all(s is not None and s.state is ModelState.FAILED for s in steps):
        return Readiness(Verdict.FAIL, failed_error(adapter, status, kinds))
    return Readiness(Verdict.SERVE)


def _not_ready(model: str, status: ModelStatus, kinds: list[str]) -> str:
    return lifecycle_error(NOT_READY, f"The model {model!r} is not ready yet: "
                           f"{status.describe(kinds)}; retry once GET /admin/models "
                           "shows it ready.")


class ReadinessGate:
    """Collaborator: an open Redis. The placer asks `check` before it places a request."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._cache: dict[str, tuple[float, ModelStatus | None]] = {}

    async def check(self, record: ModelRecord, nodes: list[NodeView], perf: PerfModel,
                    adapter: ModelRecord | None = None) -> Readiness:
        """`record`'s readiness; with `adapter` (the request's LoRA adapter), the adapter's too.
        A failure is final for the request: it is never judged on a cached state (the model may
        have been registered again, fixed, a moment ago)."""
        present = {n.hardware.value for n in nodes}
        profiled = {hw.value for hw in Hardware if perf.get(record.name, hw) is not None}
        ready = await self._judge(record, adapter, profiled, present, fresh=False)
        if ready.verdict is Verdict.FAIL:
            ready = await self._judge(record, adapter, profiled, present, fresh=True)
        # The client sees the message: the server's paths (in a failure's reason) stay out.
        message = ready.message
        for path in (record.path, adapter.path if adapter is not None else None):
            if path:
                message = message.replace(path, "<model directory>")
        return replace(ready, message=message)

    async def _judge(self, record: ModelRecord, adapter: ModelRecord | None, profiled: set[str],
                     present: set[str], fresh: bool) -> Readiness:
        ready = judge(display_name(record), await self._status(record.name, fresh), profiled,
                      present)
        if ready.verdict is Verdict.SERVE and adapter is not None:
            ready = judge_adapter(display_name(adapter), await self._status(adapter.name, fresh),
                                  present)
        return ready

    async def _status(self, model: str, fresh: bool = False) -> ModelStatus | None:
        now = time.monotonic()
        cached = self._cache.get(model)
        if cached is not None and now - cached[0] < STATUS_TTL_S and not fresh:
            return cached[1]
        status = await get_status(self._redis, model)
        self._cache[model] = (now, status)
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < STATUS_TTL_S}
        return status


async def hold_or_fail(port: PlacerPort, intake: RequestIntake, p: Pending,
                       ready: Readiness) -> None:
    """Carry out a WAIT or FAIL verdict for a queued request (the placer's call site is one
    line): WAIT keeps it queued (its claim is renewed like any queued request's) until its
    TTFT deadline; FAIL, or WAIT past that deadline, answers it with the verdict's message."""
    if ready.refresh:
        port.reread_perf()  # the profile is in Redis: read the profiles at the next turn
    late = time.time() > request_view(p.request).deadline()
    if ready.verdict is Verdict.WAIT and not late:
        port.count("held_not_ready")  # each turn that held it (the tests wait on this count)
        return
    port.count("not_ready")
    with decision_span(p, None):
        await intake.fail(p, FinishReason.ERROR, ready.message)
