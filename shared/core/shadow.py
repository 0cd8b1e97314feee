"""Shadow validation (SLINFER §VI-C, Fig. 15).

To decide whether a new request may join an instance, virtually add it and simulate the node's
next iterations with the token-level pick of `iteration.choose_iteration`, every iteration
overestimated by 10%. Reject on:
  1. TTFT_MISS    - the new request's first token comes after its TTFT deadline;
  2. HEADROOM     - some request already on the node is pushed past its deadline;
  3. TPOT_BUDGET  - one decode step of every busy instance on the node, added up, exceeds the
                    tightest TPOT SLO on the node.

The simulation starts from the node as it really is:
- the iteration running now (`NodeView.running`) ends at `busy_until`, and its requests get
  their token then: a prefill in flight is not run a second time;
- an instance runs nothing before its `ready_at`: the end of its load, or of a KV resize that is
  running or parked in the reservation station;
- an instance handing its requests over by live migration (a preemption's victim) runs them
  until its `leaves_at` and then is gone; it is not part of the steady state case 3 checks.
A target that can never run (`ready_at` infinite) is refused with NEVER_READY: its simulation
would find nothing left to run and say yes.
A request is not counted against the newcomer when it is lost either way: already late at the
start, or late in an iteration that starts before the newcomer's instance can first run (until
then the newcomer changes nothing on the node).

It runs until the new request has its first token and then until every request on the node has
at least one full decode round of slack, assuming no request finishes meanwhile. Past that point
nothing the newcomer did can make anyone late: case 3 already guarantees a round fits within the
TPOT SLO, so each request is served again in time. Up to `shadow_max_steps` simulated iterations
from the first the newcomer's instance can run (and `shadow_max_wait_steps` before it: the other
instances' iterations during a cold start, which only mark their own requests late) the answer
is exact; a future that takes longer to decide is refused with HORIZON (conservative: running out
of budget never means yes).

The placer runs this for every candidate it tries, so the simulation works on a compact copy of
the node (`_SimInstance`) that keeps each instance's earliest deadline up to date instead of
rescanning every request on every step, and credits a decode step of a batch with one TPOT SLO
as a count rather than request by request. It makes exactly the choices `choose_iteration` and
`apply_iteration` make on the views (tests/core/test_shadow_equivalence.py checks this against a
step-by-step simulation on those functions), only cheaper: a decode step costs O(instances).

Chunked prefill (`CoreConfig.prefill_chunk_tokens`): a prefill is simulated chunk by chunk, each
sized by `iteration.chunk_tokens` from the same decode units the node's `plan_chunk` sees, and
timed by `Profile.prefill_chunk_s`; between chunks the instance's prefilled requests may run a
decode step of their own. An instance whose engine cannot chunk (`ModelSpec.chunked_prefill`
False) keeps whole prefills. A chunk in flight (`RunningIteration.chunk_of`) is not run again. Off,
nothing here changes.
"""

from __future__ import annotations

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.iteration import chunk_tokens, decode_step_s, distinct_adapters
from shared.core.perf_model import Profile
from shared.core.types import (InstanceStatus, InstanceView, RequestView, RunningIteration,
                               token_deadline)

INF = float("inf")


class _SimRequest:
    __slots__ = ("request_id", "base", "tpot", "generated", "input_len", "prefilled", "late",
                 "deadline", "lora_rank", "adapter", "done")

    def __init__(self, r: RequestView, done: int = 0) -> None:
        self.request_id = r.request_id
        self.base = r.deadline_base()
        self.tpot = r.slo.tpot_s
        self.generated = r.generated
        self.input_len = r.input_len
        self.prefilled = r.prefilled
        self.late = False  # lost with or without the newcomer: never counted against it
        self.deadline = r.deadline()  # kept current by `credit` (read on every step)
        self.lora_rank = r.lora_rank
        self.adapter = r.adapter
        self.done = done  # chunked prefill: tokens of its context already in the cache

    def context_len(self) -> int:
        return self.input_len + self.generated

    def prefill_s(self, profile: Profile) -> float:
        """Its prefill (of everything so far), through its adapter if it has one."""
        return profile.prefill_through(self.input_len + self.generated, self.lora_rank)

    def credit(self) -> None:
        """The request got a token: its KV cache holds it and the next one is due later."""
        self.generated += 1
        self.prefilled = True
        self.done = 0
        self.deadline = token_deadline(self.base, self.tpot, self.generated)


class _SimInstance:
    __slots__ = ("instance_id", "profile", "ready_at", "can_run", "requests", "context",
                 "min_deadline", "min_on_time", "unprefilled", "decode_at", "tpot", "pending",
                 "lowest", "on_time", "leaves_at", "chunks")

    def __init__(self, inst: InstanceView, profile: Profile, requests: list[_SimRequest]) -> None:
        self.instance_id = inst.instance_id
        self.profile = profile
        self.ready_at = inst.ready_at
        self.can_run = inst.status is not InstanceStatus.UNLOADING
        self.leaves_at = inst.leaves_at if inst.status is InstanceStatus.HANDOVER else INF
        self.chunks = inst.model.chunked_prefill  # its engine can chunk (when chunking is on)
        self.requests = requests
        self.context = sum(r.input_len + r.generated for r in requests)  # tokens in its KV cache
        self.unprefilled = 0  # requests still to prefill (set by `refresh`)
        self.decode_at = _decode_at(profile, requests)  # no request finishes in the simulation
        # With one TPOT SLO across the batch (the usual case: one model, one SLO class) a decode
        # step moves every deadline by the same amount, so the earliest ones stay the earliest:
        # the step is credited to the batch as a count (`pending`) and only the two requests
        # holding the minima are looked at, instead of every request on every step.
        tpots = {r.tpot for r in requests}
        self.tpot = tpots.pop() if len(tpots) == 1 else None
        self.pending = 0  # decode steps not yet written into the requests (see `settle`)
        self.lowest: _SimRequest | None = None  # the request with `min_deadline`
        self.on_time: _SimRequest | None = None  # the one with `min_on_time`
        self.refresh()

    def settle(self) -> None:
        """Write the pending decode steps into the requests (before anyone reads them)."""
        if self.pending:
            k, self.pending = self.pending, 0
            for r in self.requests:
                r.generated += k
                r.deadline = token_deadline(r.base, r.tpot, r.generated)

    def refresh(self) -> None:
        """Earliest deadline of all requests (the pick) and of the ones still on time (the checks)."""
        self.settle()
        lowest = on_time = INF
        low_r = on_r = None
        unprefilled = 0
        for r in self.requests:
            d = r.deadline
            if d < lowest:
                lowest, low_r = d, r
            if d < on_time and not r.late:
                on_time, on_r = d, r
            if not r.prefilled:
                unprefilled += 1
        self.min_deadline, self.min_on_time, self.unprefilled = lowest, on_time, unprefilled
        self.lowest, self.on_time = low_r, on_r

    def next_s(self, t: float) -> float:
        """Its next iteration at `t`, unscaled: the prefill of its waiting request with the
        least headroom, else a decode step of its batch (what `_simulate` then runs)."""
        if not self.unprefilled:
            return self.decode_s()
        self.settle()
        first = min((r for r in self.requests if not r.prefilled),
                    key=lambda r: (r.deadline - t, r.request_id))
        return first.prefill_s(self.profile)

    def decode_s(self) -> float:
        n = len(self.requests)
        return self.decode_at(self.context / n) if n else 0.0

    def first_waiting(self, t: float) -> _SimRequest:
        """The waiting request with the least headroom (`choose_iteration`'s prefill)."""
        self.settle()
        return min((r for r in self.requests if not r.prefilled),
                   key=lambda r: (r.deadline - t, r.request_id))

    def decoding(self) -> list[_SimRequest]:
        """Its prefilled requests (settled): the batch of a decode step while a prefill waits."""
        self.settle()
        return [r for r in self.requests if r.prefilled]

    def unit(self, t: float, scale: float, joining: _SimRequest) -> tuple[float, float] | None:
        """`iteration.decode_units`' entry for this instance: (earliest deadline of its
        prefilled requests, their decode step scaled, with `joining` if it is here), None if
        it has none on time."""
        if not self.unprefilled:
            deadline, step = self.min_deadline, self.decode_s()
        else:
            decoding = self.decoding()
            if not decoding:
                return None
            deadline = min(r.deadline for r in decoding)
            batch = [*decoding, joining] if joining in self.requests else decoding
            step = decode_step_s(self.profile, batch)
        return None if deadline < t else (deadline, step * scale)

    def credit_batch(self) -> None:
        """A decode step ran: every request got a token (all are prefilled: a decode runs only
        then). With one TPOT across the batch the minima move with their requests; otherwise
        (or when `refresh` must re-read the late flags) every request is credited."""
        self.context += len(self.requests)
        if self.tpot is None:
            for r in self.requests:
                r.generated += 1
                r.deadline = token_deadline(r.base, r.tpot, r.generated)
            self.refresh()
            return
        self.pending += 1
        low, on = self.lowest, self.on_time
        self.min_deadline = INF if low is None else \
            token_deadline(low.base, low.tpot, low.generated + self.pending)
        self.min_on_time = INF if on is None else \
            token_deadline(on.base, on.tpot, on.generated + self.pending)


def _decode_at(profile: Profile, requests: list[_SimRequest]):
    """The batch's decode step as a function of its average length; a batch with adapter
    requests costs its largest rank's measured overhead on top (`iteration.predict_seconds`)."""
    n = len(requests)
    plain = profile.decode_at(n)
    rank = max((r.lora_rank for r in requests), default=0)
    if not rank:
        return plain
    factor = profile.lora_decode_factor(rank, n, distinct_adapters(requests))
    return lambda avg_len: plain(avg_len) * factor


def _round_over_budget(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                       request: RequestView | None, overestimate: float) -> tuple[bool, float]:
    """Case 3: is one decode step of every busy instance (the newcomer, if any, in the target's
    batch), overestimated, longer than the tightest TPOT SLO on the node? Returns that and the
    round.

    The round only grows and the tightest SLO only shrinks as instances are added, so the first
    instance that tips it over decides; most nodes the placer rejects stop after a few.
    """
    total = 0.0
    scale = 1 + overestimate
    tpot = request.slo.tpot_s if request is not None else INF
    for inst in instances:
        if inst.status is InstanceStatus.HANDOVER:
            continue  # its requests are leaving: no round of the node's future holds them
        reqs = inst.requests
        n = len(reqs)
        context = sum(r.input_len + r.generated for r in reqs)
        if n:
            tpot = min(tpot, min(r.slo.tpot_s for r in reqs))
        if request is not None and inst.instance_id == target_id:
            n += 1
            context += request.input_len + request.generated
            reqs = [*reqs, request]
        rank = max((r.lora_rank for r in reqs), default=0)
        if n:
            profile = profiles[inst.instance_id]
            step = profile.decode_s(n, context / n)
            total += step * profile.lora_decode_factor(rank, n, distinct_adapters(reqs)) \
                if rank else step
            if total * scale > tpot:
                return True, total * scale
    return False, total * scale


def _build(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
           request: RequestView | None) -> list[_SimInstance]:
    sim = []
    for inst in instances:
        progress = inst.prefill_progress
        reqs = [_SimRequest(r, 0 if r.prefilled else progress.get(r.request_id, 0))
                for r in inst.requests]
        if request is not None and inst.instance_id == target_id:
            reqs.append(_SimRequest(request))
        sim.append(_SimInstance(inst, profiles[inst.instance_id], reqs))
    return sim


def _start_state(sim: list[_SimInstance], running: RunningIteration | None, busy_until: float,
                 start: float, new_request_id: str | None) -> None:
    """Credit the iteration in flight with its tokens at `busy_until` (a token that comes after
    its deadline is late whatever the newcomer does), then mark every request already late.
    The newcomer is never written off: if it is already late, that is its miss (case 1)."""
    if running is not None and running.chunk_of:  # a chunk in flight: not run again
        for si in sim:
            for r in si.requests:
                if si.instance_id == running.instance_id and r.request_id == running.chunk_of:
                    r.done = running.chunk_to
    if running is not None:
        ids = set(running.request_ids)
        for si in sim:
            if si.instance_id != running.instance_id:
                continue
            for r in si.requests:
                if r.request_id in ids:
                    r.late = r.deadline - busy_until < 0
                    r.credit()
                    si.context += 1
    for si in sim:
        for r in si.requests:
            if r.deadline - start < 0 and r.request_id != new_request_id:
                r.late = True
        si.refresh()


def _runs(si: _SimInstance, t: float) -> bool:
    return bool(si.requests) and si.can_run and si.ready_at <= t < si.leaves_at


def _chunk_plan(sim: list[_SimInstance], inst: _SimInstance, t: float, scale: float,
                min_tokens: int) -> tuple[_SimRequest, int, float]:
    """`iteration.plan_chunk` on the copy: (the waiting request, the chunk's tokens, its
    seconds unscaled); 0 tokens: a decode step of the instance's prefilled requests instead."""
    first = inst.first_waiting(t)
    remaining = max(1, first.context_len() - first.done)
    units = [u for si in sim if _runs(si, t) for u in [si.unit(t, scale, first)] if u is not None]
    decoding = inst.decoding()
    urgent = min((r.deadline for r in decoding), default=INF) < first.deadline
    tokens = chunk_tokens(inst.profile, first.done, remaining, first.lora_rank, units, t, urgent,
                          min_tokens, scale)
    if tokens == 0:
        return first, 0, decode_step_s(inst.profile, decoding)
    return first, tokens, inst.profile.prefill_chunk_s(first.done, tokens, first.lora_rank)


def _next_s(sim: list[_SimInstance], si: _SimInstance, t: float, scale: float,
            chunking: int) -> float:
    """Its next iteration's seconds, unscaled, as `_simulate` would run it."""
    if chunking and si.chunks and si.unprefilled:
        return _chunk_plan(sim, si, t, scale, chunking)[2]
    return si.next_s(t)


def _pick(sim: list[_SimInstance], t: float, scale: float,
          chunking: int = 0) -> _SimInstance | None:
    """`choose_iteration`'s instance: the runnable one with the least headroom, ids break ties.
    A live preemption's victim runs only an iteration that ends by its handover (the node's
    token loop does the same): one running past it would hold up the handover."""
    best, best_h = None, INF
    for si in sim:
        if not si.requests or not si.can_run or si.ready_at > t or si.leaves_at <= t:
            continue
        if si.leaves_at < INF and t + _next_s(sim, si, t, scale, chunking) * scale > si.leaves_at:
            continue
        h = si.min_deadline - t
        if best is None or h < best_h or (h == best_h and si.instance_id < best.instance_id):
            best, best_h = si, h
    return best


def _missed(chosen: list[_SimRequest], t: float) -> list[_SimRequest]:
    return [r for r in chosen if not r.late and r.deadline - t < 0]


def _verdict(missed: list[_SimRequest], new_request_id: str | None) -> AdmitReason:
    first = missed[0]
    return AdmitReason.TTFT_MISS if first.request_id == new_request_id else AdmitReason.HEADROOM


def _simulate(sim: list[_SimInstance], round_s: float, start: float, config: CoreConfig,
              new_request_id: str | None, blame_from: float) -> AdmitReason:
    """Run the node's future on the copy. Misses in iterations that start before `blame_from`
    (the newcomer's instance cannot run yet) are the node's own and only mark requests late.
    `new_request_id` None: there is no newcomer (`shadow_hold`)."""
    waiting = sum(1 for si in sim if si.leaves_at == INF
                  for r in si.requests if not r.prefilled and not r.late)
    last_ready = max((si.ready_at for si in sim if si.requests and si.can_run), default=start)
    t = start
    new_done = not new_request_id  # no newcomer: `shadow_hold`, `admitted_hold`
    steps = waited = 0  # iterations from `blame_from` on, and before it
    scale = 1 + config.overestimate
    chunking = config.prefill_chunk_tokens
    while True:
        if new_done and waiting == 0 and t >= last_ready \
                and all(si.min_on_time - t >= round_s or si.leaves_at <= t for si in sim):
            return AdmitReason.ADMITTED  # every request can wait a whole decode round
        inst = _pick(sim, t, scale, chunking)
        if inst is None:
            ready = [si.ready_at for si in sim if si.requests and si.can_run
                     and t < si.ready_at < si.leaves_at]
            if not ready:
                return AdmitReason.ADMITTED  # nothing left that could run
            t = min(ready)  # only blocked instances have work: jump to the first one ready
            continue
        blamed = t >= blame_from
        if blamed:
            if steps == config.shadow_max_steps:
                return AdmitReason.HORIZON
            steps += 1
        else:
            if waited == config.shadow_max_wait_steps:
                return AdmitReason.HORIZON
            waited += 1
        prefill = inst.unprefilled > 0
        part = None  # chunked: the decode step of the prefilled requests, or a chunk's tokens
        if prefill and chunking and inst.chunks:
            first, tokens, seconds = _chunk_plan(sim, inst, t, scale, chunking)
            t += seconds * scale
            if tokens == 0:
                chosen = part = inst.decoding()
            elif tokens < first.context_len() - first.done:
                chosen, part = [], tokens  # not its last chunk: nobody gets a token
            else:
                chosen = [first]
        elif prefill:  # a prefill runs alone: the waiting request with the least headroom
            first = inst.first_waiting(t)
            chosen = [first]
            t += first.prefill_s(inst.profile) * scale
        else:
            chosen = inst.requests
            t += inst.decode_s() * scale
        marked = False
        if inst.min_on_time - t < 0:
            inst.settle()
            missed = _missed(chosen, t)
            if missed and blamed:
                return _verdict(missed, new_request_id)
            for r in missed:  # the node's own loss, not the newcomer's doing
                r.late = True
                waiting -= not r.prefilled and inst.leaves_at == INF
            marked = bool(missed)
        if isinstance(part, list):  # the prefilled requests' decode step, a prefill waiting
            for r in part:
                r.generated += 1
                r.deadline = token_deadline(r.base, r.tpot, r.generated)
            inst.context += len(part)
            inst.refresh()
        elif part is not None:
            first.done += part
        elif prefill:
            first = chosen[0]
            waiting -= not first.late and inst.leaves_at == INF
            first.credit()
            inst.context += 1
            inst.refresh()
            new_done = new_done or first.request_id == new_request_id
        else:
            inst.credit_batch()
            if marked:
                inst.refresh()  # the minimum on time was one of the requests just marked late


def shadow_validate(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                    request: RequestView, now: float, busy_until: float, config: CoreConfig,
                    running: RunningIteration | None = None) -> AdmitReason:
    """Virtually add `request` to instance `target_id` and check the three cases of Fig. 15.
    `busy_until` and `running`: the node's iteration in flight (see the module docstring)."""
    over, round_s = _round_over_budget(instances, profiles, target_id, request, config.overestimate)
    if over:
        return AdmitReason.TPOT_BUDGET
    if not next(i for i in instances if i.instance_id == target_id).ready_at < INF:
        return AdmitReason.NEVER_READY  # what it waits for never ends: it would never run
    start = max(now, busy_until)
    sim = _build(instances, profiles, target_id, request)
    _start_state(sim, running, busy_until, start, request.request_id)
    target = next(si for si in sim if si.instance_id == target_id)
    return _simulate(sim, round_s, start, config, request.request_id, max(start, target.ready_at))


def shadow_hold(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                now: float, busy_until: float, config: CoreConfig,
                running: RunningIteration | None = None) -> AdmitReason:
    """The validation without a newcomer: may instance `target_id` run nothing until its
    `ready_at` (set by the caller: a memory op of its own, such as an adapter pre-loaded onto it,
    holds it up) without making a request on the node late that would otherwise be on time?
    Misses in iterations that start before then are the node's own (the hold only gives the
    other instances more time); from then on, as for an admission, every request must make its
    deadlines until each has a decode round of slack. HEADROOM if not, HORIZON when that takes
    more iterations to decide than the step budgets allow."""
    _, round_s = _round_over_budget(instances, profiles, target_id, None, config.overestimate)
    start = max(now, busy_until)
    sim = _build(instances, profiles, target_id, None)
    _start_state(sim, running, busy_until, start, None)
    target = next(si for si in sim if si.instance_id == target_id)
    return _simulate(sim, round_s, start, config, None, max(start, target.ready_at))


def admitted_hold(instances: list[InstanceView], profiles: dict[str, Profile], now: float,
                  busy_until: float, config: CoreConfig,
                  running: RunningIteration | None = None) -> AdmitReason:
    """The node's admitted requests, with no newcomer, under `profiles` (a change of what its
    iterations cost: a stage taking some of its compute, hops added to an instance): TPOT_BUDGET
    when a decode round of its busy instances exceeds their tightest TPOT SLO (case 3),
    HEADROOM when one of them would miss a deadline it still meets as things are (case 2),
    else ADMITTED. Requests already late at the start are not counted."""
    over, round_s = _round_over_budget(instances, profiles, "", None, config.overestimate)
    if over:
        return AdmitReason.TPOT_BUDGET
    start = max(now, busy_until)
    sim = _build(instances, profiles, "", None)
    _start_state(sim, running, busy_until, start, "")
    return _simulate(sim, round_s, start, config, "", start)
