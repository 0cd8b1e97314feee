"""The answer to "may this request join that instance?", as an enum the services, the simulator
and traces can count."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AdmitReason(str, enum.Enum):
    ADMITTED = "admitted"
    TTFT_MISS = "ttft_miss"  # §VI-C case 1: the new request's first token would be late
    HEADROOM = "headroom"  # case 2: an existing request's headroom would go negative
    TPOT_BUDGET = "tpot_budget"  # case 3: one decode round of the node would exceed TPOT
    # The shadow simulation's step bound ran out before it could decide: refused, because an
    # unchecked future is not an admission (a conservative answer, counted apart from the others).
    HORIZON = "shadow_horizon"
    MEMORY = "memory"  # not even M_require fits the node's optimistic budget (§VII-D)
    NO_PROFILE = "no_profile"  # no timing profile for this model on this hardware
    SLO_INFEASIBLE = "slo_infeasible"  # the profile says this hardware cannot meet the SLO
    NO_MATRIX_ACCEL = "no_matrix_accel"  # a CPU without AMX-like units (§V)
    CPU_DISABLED = "cpu_disabled"  # ablation
    NOT_SHARED = "not_shared"  # sharing disabled and the node already holds an instance
    INSTANCE_GONE = "instance_gone"  # the instance is unloading or unknown (stale view)
    # Preempt-and-admit: a victim is gone or no longer strictly smaller than the preemptor.
    VICTIMS_CHANGED = "victims_changed"
    CONTEXT_TOO_LONG = "context_too_long"  # input + max_tokens exceeds the model's context
    NEVER_READY = "never_ready"  # the target instance can never run (its ready_at is infinite)


@dataclass(frozen=True)
class Admission:
    reason: AdmitReason
    kv_target_bytes: int | None = None  # KV size the instance must scale to (None: no change)
    compromise: bool = False  # scaled to M_require only, because M_recommend did not fit
    # TTFT grace the request is admitted with: a cold start's load time (§IX-A), or what is left
    # of the load when it joins an instance that is still loading.
    grace_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reason is AdmitReason.ADMITTED
