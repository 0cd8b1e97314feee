"""Shadow validation (SLINFER §VI-C, Fig. 15).

To decide whether a new request may join an instance, virtually add it and simulate the node's
next iterations with the token-level pick of `iteration.choose_iteration`, every iteration
overestimated by 10%. Reject on:
  1. TTFT_MISS    - the new request's first token comes after its TTFT deadline;
  2. HEADROOM     - some request already on the node is pushed past its deadline;
  3. TPOT_BUDGET  - one decode step of every busy instance on the node, added up, exceeds the
                    tightest TPOT SLO on the node.
The simulation runs until the new request has its first token and then until every request on the
node has at least one full decode round of slack (or `shadow_max_steps` iterations), assuming no
request finishes meanwhile. Past that point nothing the newcomer did can make anyone late: case 3
already guarantees a round fits within the TPOT SLO, so each request is served again in time.

The placer runs this for every candidate it tries, so the simulation works on a compact copy of
the node (`_SimInstance`) that keeps each instance's earliest deadline up to date instead of
rescanning every request on every step. It makes exactly the choices `choose_iteration` and
`apply_iteration` make on the views (tests/core/test_shadow_equivalence.py checks this against a
step-by-step simulation on those functions), only cheaper: a step costs O(instances + batch).
"""

from __future__ import annotations

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.perf_model import Profile
from shared.core.types import InstanceStatus, InstanceView, RequestView

INF = float("inf")


class _SimRequest:
    __slots__ = ("request_id", "base", "tpot", "generated", "input_len", "prefilled", "late")

    def __init__(self, r: RequestView, start: float) -> None:
        self.request_id = r.request_id
        # Eq. 1 as RequestView.headroom computes it, term by term, so the float results match.
        self.base = r.arrival + r.grace_s + r.slo.ttft_s
        self.tpot = r.slo.tpot_s
        self.generated = r.generated
        self.input_len = r.input_len
        self.prefilled = r.prefilled
        # Already late at the start: lost with or without the newcomer, so not counted again.
        self.late = self.deadline() - start < 0

    def deadline(self) -> float:
        return self.base + self.tpot * self.generated


class _SimInstance:
    __slots__ = ("instance_id", "profile", "ready_at", "can_run", "requests", "context",
                 "min_deadline", "min_on_time")

    def __init__(self, inst: InstanceView, profile: Profile, requests: list[_SimRequest]) -> None:
        self.instance_id = inst.instance_id
        self.profile = profile
        self.ready_at = inst.ready_at
        self.can_run = inst.status is not InstanceStatus.UNLOADING
        self.requests = requests
        self.context = sum(r.input_len + r.generated for r in requests)  # tokens in its KV cache
        self.refresh()

    def refresh(self) -> None:
        """Earliest deadline of all requests (the pick) and of the ones still on time (the checks)."""
        lowest = on_time = INF
        for r in self.requests:
            d = r.base + r.tpot * r.generated  # r.deadline(), inlined: this is the hot loop
            if d < lowest:
                lowest = d
            if d < on_time and not r.late:
                on_time = d
        self.min_deadline, self.min_on_time = lowest, on_time

    def decode_s(self) -> float:
        n = len(self.requests)
        return self.profile.decode_s(n, self.context / n) if n else 0.0


def _round_over_budget(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                       request: RequestView, overestimate: float) -> tuple[bool, float]:
    """Case 3: is one decode step of every busy instance (the newcomer in the target's batch),
    overestimated, longer than the tightest TPOT SLO on the node? Returns that and the round.

    The round only grows and the tightest SLO only shrinks as instances are added, so the first
    instance that tips it over decides; most nodes the placer rejects stop after a few.
    """
    total = 0.0
    scale = 1 + overestimate
    tpot = request.slo.tpot_s
    for inst in instances:
        reqs = inst.requests
        n = len(reqs)
        context = sum(r.input_len + r.generated for r in reqs)
        if n:
            tpot = min(tpot, min(r.slo.tpot_s for r in reqs))
        if inst.instance_id == target_id:
            n += 1
            context += request.input_len + request.generated
        if n:
            total += profiles[inst.instance_id].decode_s(n, context / n)
            if total * scale > tpot:
                return True, total * scale
    return False, total * scale


def _build(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
           request: RequestView, start: float) -> list[_SimInstance]:
    sim = []
    for inst in instances:
        reqs = [_SimRequest(r, start) for r in inst.requests]
        if inst.instance_id == target_id:
            reqs.append(_SimRequest(request, start))
        sim.append(_SimInstance(inst, profiles[inst.instance_id], reqs))
    return sim


def _pick(sim: list[_SimInstance], t: float) -> _SimInstance | None:
    """`choose_iteration`'s instance: the runnable one with the least headroom, ids break ties."""
    best, best_h = None, INF
    for si in sim:
        if not si.requests or not si.can_run or si.ready_at > t:
            continue
        h = si.min_deadline - t
        if best is None or h < best_h or (h == best_h and si.instance_id < best.instance_id):
            best, best_h = si, h
    return best


def _missed(chosen: list[_SimRequest], t: float, new_request_id: str) -> AdmitReason | None:
    for r in chosen:
        if not r.late and r.deadline() - t < 0:
            return AdmitReason.TTFT_MISS if r.request_id == new_request_id else AdmitReason.HEADROOM
    return None


def _simulate(sim: list[_SimInstance], round_s: float, start: float, config: CoreConfig,
              new_request_id: str) -> AdmitReason:
    """Run the node's future on the copy; ADMITTED if nobody misses a deadline within the horizon."""
    waiting = sum(1 for si in sim for r in si.requests if not r.prefilled and not r.late)
    t = start
    new_done = False
    for _ in range(config.shadow_max_steps):
        if new_done and waiting == 0 and all(si.min_on_time - t >= round_s for si in sim):
            break  # every request can wait a whole decode round and still be on time
        inst = _pick(sim, t)
        if inst is None:
            ready = [si.ready_at for si in sim if si.requests and si.ready_at > t]
            if not ready:
                break
            t = min(ready)  # only loading instances have work: jump to the first ready one
            continue
        unprefilled = [r for r in inst.requests if not r.prefilled]
        if unprefilled:  # a prefill runs alone: the waiting request with the least headroom
            first = min(unprefilled, key=lambda r: (r.deadline() - t, r.request_id))
            chosen = [first]
            t += inst.profile.prefill_s(first.input_len + first.generated) * (1 + config.overestimate)
        else:
            chosen = inst.requests
            t += inst.decode_s() * (1 + config.overestimate)
        if inst.min_on_time - t < 0:
            missed = _missed(chosen, t, new_request_id)
            if missed is not None:
                return missed
        for r in chosen:
            if not r.prefilled and not r.late:
                waiting -= 1
            r.generated += 1
            r.prefilled = True
        inst.context += len(chosen)
        inst.refresh()
        if unprefilled and chosen[0].request_id == new_request_id:
            new_done = True
    return AdmitReason.ADMITTED


def shadow_validate(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                    request: RequestView, now: float, busy_until: float,
                    config: CoreConfig) -> AdmitReason:
    """Virtually add `request` to instance `target_id` and check the three cases of Fig. 15."""
    over, round_s = _round_over_budget(instances, profiles, target_id, request, config.overestimate)
    if over:
        return AdmitReason.TPOT_BUDGET
    start = max(now, busy_until)
    sim = _build(instances, profiles, target_id, request, start)
    return _simulate(sim, round_s, start, config, request.request_id)
