"""Shadow validation (SLINFER §VI-C, Fig. 15).

To decide whether a new request may join an instance, virtually add it and simulate the node's
next iterations with the real token-level pick, every iteration overestimated by 10%. Reject on:
  1. TTFT_MISS    - the new request's first token comes after its TTFT deadline;
  2. HEADROOM     - some request already on the node is pushed past its deadline;
  3. TPOT_BUDGET  - one decode step of every busy instance on the node, added up, exceeds the
                    tightest TPOT SLO on the node.
The simulation runs until the new request has its first token and then until every request on the
node has at least one full decode round of slack (or `shadow_max_steps` iterations), assuming no
request finishes meanwhile. Past that point nothing the newcomer did can make anyone late: case 3
already guarantees a round fits within the TPOT SLO, so each request is served again in time.
"""

from __future__ import annotations

from dataclasses import replace

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.iteration import (IterationKind, apply_iteration, choose_iteration,
                                   decode_shape, predict_seconds)
from shared.core.perf_model import Profile
from shared.core.types import InstanceView, RequestView


def copy_instances(instances: list[InstanceView]) -> list[InstanceView]:
    """Copies deep enough that simulating iterations leaves the originals untouched."""
    return [replace(i, requests=[replace(r) for r in i.requests]) for i in instances]


def decode_round_s(instances: list[InstanceView], profiles: dict[str, Profile],
                   overestimate: float) -> float:
    total = 0.0
    for inst in instances:
        if inst.requests:
            total += profiles[inst.instance_id].decode_s(*decode_shape(inst.requests))
    return total * (1 + overestimate)


def simulate(instances: list[InstanceView], profiles: dict[str, Profile], start: float,
             config: CoreConfig, new_request_id: str | None = None) -> AdmitReason:
    """Run the node's future on copies; ADMITTED if nobody misses a deadline within the horizon.

    Requests already late at `start` are not counted again: they are lost with or without the
    newcomer, and counting them would make every later admission on the node fail.
    """
    sim = copy_instances(instances)
    by_id = {i.instance_id: i for i in sim}
    late = {r.request_id for i in sim for r in i.requests if r.headroom(start) < 0}
    round_s = decode_round_s(sim, profiles, config.overestimate)
    t = start
    new_done = new_request_id is None
    for _ in range(config.shadow_max_steps):
        if new_done and _all_have_slack(sim, late, t, round_s):
            break
        choice = choose_iteration(sim, t)
        if choice is None:
            waiting = [i.ready_at for i in sim if i.requests and i.ready_at > t]
            if not waiting:
                break
            t = min(waiting)  # only loading instances have work: jump to the first ready one
            continue
        inst = by_id[choice.instance_id]
        t += predict_seconds(choice, inst, profiles[inst.instance_id]) * (1 + config.overestimate)
        for r in inst.requests:
            if r.request_id in choice.request_ids and r.request_id not in late and r.headroom(t) < 0:
                return AdmitReason.TTFT_MISS if r.request_id == new_request_id else AdmitReason.HEADROOM
        apply_iteration(choice, inst)
        if choice.kind is IterationKind.PREFILL and choice.request_ids[0] == new_request_id:
            new_done = True
    return AdmitReason.ADMITTED


def _all_have_slack(sim: list[InstanceView], late: set[str], t: float, round_s: float) -> bool:
    """Every request still waiting for its prefill is done, and every other one can wait a whole
    decode round of the node and still be on time."""
    for inst in sim:
        for r in inst.requests:
            if r.request_id in late:
                continue
            if not r.prefilled or r.headroom(t) < round_s:
                return False
    return True


def shadow_validate(instances: list[InstanceView], profiles: dict[str, Profile], target_id: str,
                    request: RequestView, now: float, busy_until: float,
                    config: CoreConfig) -> AdmitReason:
    """Virtually add `request` to instance `target_id` and check the three cases of Fig. 15."""
    with_new = [replace(i, requests=[*i.requests, request]) if i.instance_id == target_id else i
                for i in instances]
    tpot = min(r.slo.tpot_s for i in with_new for r in i.requests)
    if decode_round_s(with_new, profiles, config.overestimate) > tpot:
        return AdmitReason.TPOT_BUDGET
    return simulate(with_new, profiles, max(now, busy_until), config, request.request_id)
