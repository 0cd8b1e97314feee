"""One admission check, run by the placer on its (possibly stale) view and again by the node on its
own state before it accepts: hardware fit, context, memory (§VII-D) and shadow validation (§VI-C).
"""

from __future__ import annotations

from dataclasses import replace

from shared.core.admission import Admission, AdmitReason
from shared.core.config import CoreConfig
from shared.core.cost import (budget_room, contended, instance_profile, kv_ceiling, kv_demand,
                              serves)
from shared.core.memory import watermark_target
from shared.core.perf_model import PerfModel, Profile
from shared.core.readiness import (NEW_INSTANCE_ID, blocked_while_growing, cold_start_ready_at,
                                   join_grace, load_seconds, new_instance_view)
from shared.core.shadow import admitted_hold, shadow_hold, shadow_validate
from shared.core.types import Hardware, InstanceStatus, InstanceView, ModelSpec, NodeView, RequestView


def node_check(node: NodeView, config: CoreConfig) -> AdmitReason | None:
    """Node rules (§V): CPUs only when enabled and only with a matrix accelerator."""
    if node.hardware is Hardware.CPU:
        if not config.enable_cpu:
            return AdmitReason.CPU_DISABLED
        if config.require_matrix_accel and not node.matrix_accel:
            return AdmitReason.NO_MATRIX_ACCEL
    return None


def slo_check(profile: Profile | None, request: RequestView, config: CoreConfig,
              grace_s: float | None = None) -> AdmitReason | None:
    """Can this hardware meet the request's SLO at all, running it alone? (The profile decides;
    the same answer for every node of one hardware kind.) `grace_s` overrides the request's."""
    if profile is None:
        return AdmitReason.NO_PROFILE
    grace = request.grace_s if grace_s is None else grace_s
    prefill = profile.prefill_s(request.context_len())
    decode = profile.decode_s(1, request.context_len())
    if request.lora_rank:  # through its adapter, at the cost measured for its rank
        prefill *= profile.lora_prefill_factor(request.lora_rank)
        decode *= profile.lora_decode_factor(request.lora_rank, 1)
    alone_ttft = prefill * (1 + config.overestimate)
    alone_tpot = decode * (1 + config.overestimate)
    if alone_ttft > request.slo.ttft_s + grace or alone_tpot > request.slo.tpot_s:
        return AdmitReason.SLO_INFEASIBLE
    return None


def kv_admission(instance: InstanceView, request: RequestView, node: NodeView,
                 config: CoreConfig) -> Admission:
    """Memory side: M_require with the newcomer; scale to M_recommend, or compromise to M_require,
    within the node's optimistic budget (§VII-B, §VII-D)."""
    spec = instance.model
    need = kv_demand(spec, [*instance.requests, request])
    if instance.kv_bytes >= need:
        return Admission(AdmitReason.ADMITTED)
    ceiling = kv_ceiling(instance)  # its stages' hosts reserved no more (issue 22 #1)
    if ceiling is not None and need > ceiling:
        return Admission(AdmitReason.MEMORY)
    recommend = watermark_target(instance.kv_bytes, need, config.watermark) or need
    if ceiling is not None:
        recommend = min(recommend, ceiling)
    current_total = (spec.weight_bytes + instance.kv_bytes) if instance.instance_id != NEW_INSTANCE_ID else 0
    headroom_bytes = budget_room(node) + current_total
    if spec.weight_bytes + recommend <= headroom_bytes:
        return Admission(AdmitReason.ADMITTED, kv_target_bytes=recommend)
    if spec.weight_bytes + need <= headroom_bytes:
        return Admission(AdmitReason.ADMITTED, kv_target_bytes=need, compromise=True)
    return Admission(AdmitReason.MEMORY)


def node_profiles(node: NodeView, perf: PerfModel, extra: InstanceView | None = None) -> dict[str, Profile] | None:
    profiles: dict[str, Profile] = {}
    for inst in [*node.instances, *([extra] if extra else [])]:
        p = instance_profile(perf, inst, node.hardware)  # a split or pipelined one pays its hops
        if p is None:
            return None
        profiles[inst.instance_id] = p
    return profiles


def keeps_promises(node: NodeView, instances: list[InstanceView], load: float, perf: PerfModel,
                   config: CoreConfig, now: float) -> bool:
    """Would the requests `node` already admitted still meet their deadlines, and its busy
    instances one decode round within their tightest TPOT, with its instances as `instances`
    (one of them with its layers shed, say) and the stages it hosts taking `load` of its
    compute (`shadow.admitted_hold`, as its own validation would see it)? What a node must
    answer before it takes on a stage of another node's instance: a CoCoServe shed's or a
    λScale pipeline's."""
    if load >= 1:
        return not any(serves(i) for i in instances)
    profiles = node_profiles(replace(node, instances=instances), perf)
    if profiles is None:
        return False
    return admitted_hold(instances, profiles, now, node.busy_until, contended(config, load),
                         node.running) is AdmitReason.ADMITTED


def may_hold(node: NodeView, instance_id: str, until: float, perf: PerfModel, now: float,
             config: CoreConfig) -> bool:
    """May the instance run nothing until `until` (an adapter pre-loaded onto it, ServerlessLoRA
    §4.1; a lazy scale-down of its K/V pool, `may_shrink`) without making a request on the node
    late? An instance without requests holds nobody up; one with requests is validated as an
    admission would be (`shadow.shadow_hold`)."""
    inst = node.instance(instance_id)
    if inst is None or not inst.requests:
        return True
    profiles = node_profiles(node, perf)
    if profiles is None:
        return False
    if node.stage_load >= 1:
        return False  # its hosted stages may take all its compute: nothing can be promised
    held = [replace(i, ready_at=max(i.ready_at, until)) if i.instance_id == instance_id else i
            for i in node.instances]
    verdict = shadow_hold(held, profiles, instance_id, now, node.busy_until,
                          contended(config, node.stage_load), node.running)
    return verdict is AdmitReason.ADMITTED


def may_shrink(node: NodeView, inst: InstanceView, kv_bytes: int, perf: PerfModel, now: float,
               config: CoreConfig) -> bool:
    """May `inst` shrink its K/V pool to `kv_bytes` now (SLINFER's lazy scale-down, §VII-B,
    once requests left it)? The resize holds it up like any memory op: it runs after what the
    instance waits for already and takes the profile's resize time, and the requests it keeps
    must be able to wait that long (`may_hold`). A scale-down put off only keeps memory a while
    longer: the next request that leaves asks again."""
    profile = perf.get(inst.model.name, node.hardware)
    if profile is None:
        return False
    until = max(now, inst.ready_at) + profile.kv_scale_s(inst.kv_bytes, kv_bytes)
    return may_hold(node, inst.instance_id, until, perf, now, config)


def evaluate(node: NodeView, instance_id: str | None, request: RequestView, model: ModelSpec,
             perf: PerfModel, now: float, config: CoreConfig,
             not_before: float | None = None) -> Admission:
    """May `request` join instance `instance_id` on `node` (None: a new instance of `model`)?
    `not_before`: the instance runs nothing before then (a live preemption's newcomer waits for
    the victims' handover: `handover_ready_at`)."""
    if request.context_len() + (request.max_tokens - request.generated) > model.max_context:
        return Admission(AdmitReason.CONTEXT_TOO_LONG)
    if node.stage_load >= 1:
        return Admission(AdmitReason.TPOT_BUDGET)  # its hosted stages may take all its compute
    config = contended(config, node.stage_load)  # a host's stages take their share first
    if instance_id is None:
        if not config.enable_sharing and node.instances:
            return Admission(AdmitReason.NOT_SHARED)
        profile = perf.get(model.name, node.hardware)
        if profile is None:
            return Admission(AdmitReason.NO_PROFILE)
        reason = node_check(node, config) or slo_check(
            profile, request, config, max(request.grace_s, load_seconds(node, model, profile)))
        if reason is not None:
            return Admission(reason)
        target = new_instance_view(node, model, now)
        instances = [*node.instances, target]
    else:
        target = node.instance(instance_id)
        if target is None or not target.accepts:
            return Admission(AdmitReason.INSTANCE_GONE)
        reason = node_check(node, config) or slo_check(perf.get(model.name, node.hardware), request,
                                                       config, join_grace(request, target, now))
        if reason is not None:
            return Admission(reason)
        instances = node.instances
    memory = kv_admission(target, request, node, config)
    if not memory.ok:
        return memory
    profiles = node_profiles(node, perf, target if instance_id is None else None)
    if profiles is None:
        return Admission(AdmitReason.NO_PROFILE)
    if instance_id is None:  # the load (and its wait) is known now that the KV size is
        kv = memory.kv_target_bytes or 0
        load = load_seconds(node, model, profiles[NEW_INSTANCE_ID])
        target.ready_at = cold_start_ready_at(node, model.weight_bytes + kv, load, now)
        request = replace(request, grace_s=max(request.grace_s, load))  # the load, not the wait
    else:
        request = replace(request, grace_s=join_grace(request, target, now))
    if not_before is not None and not_before > target.ready_at:
        # The whole instance waits (its KV growth is parked behind the victims' memory, or it
        # would crowd their last iterations): a copy, so the caller's view is left as it was.
        target = replace(target, ready_at=not_before)
        instances = [target if i.instance_id == target.instance_id else i for i in instances]
    if instance_id is not None:  # then its KV growth, if any
        instances = blocked_while_growing(node, instances, target, memory,
                                          profiles[target.instance_id], now)
    verdict = shadow_validate(instances, profiles, target.instance_id, request, now,
                              node.busy_until, config, node.running)
    if verdict is not AdmitReason.ADMITTED:
        return Admission(verdict)
    return replace(memory, grace_s=request.grace_s)


def with_request(node: NodeView, instance_id: str, request: RequestView,
                 admission: Admission) -> NodeView:
    """The node as it will be once an admitted request joined an existing instance (for a caller
    that places several requests on one view, e.g. relocating preempted requests)."""
    instances = []
    budget = node.budget_bytes
    for inst in node.instances:
        if inst.instance_id == instance_id:
            kv = inst.kv_bytes
            if admission.kv_target_bytes is not None:
                budget += admission.kv_target_bytes - inst.kv_bytes
                kv = admission.kv_target_bytes
            joined = replace(request, grace_s=admission.grace_s)
            inst = replace(inst, kv_bytes=kv, requests=[*inst.requests, joined])
        instances.append(inst)
    return replace(node, instances=instances, budget_bytes=budget)


def without_instances(node: NodeView, instance_ids: set[str]) -> NodeView:
    """The node once these instances are unloaded (their memory, their adapters' included,
    leaves the budget)."""
    freed = sum(i.model.weight_bytes + i.kv_bytes + sum(i.adapters.values())
                for i in node.instances if i.instance_id in instance_ids)
    kept = [i for i in node.instances if i.instance_id not in instance_ids]
    return replace(node, instances=kept, budget_bytes=node.budget_bytes - freed)


def handing_over(node: NodeView, instance_ids: set[str], leaves_at: float) -> NodeView:
    """The node once these instances hand their requests over by live migration: their memory
    leaves the optimistic budget now (it is promised to the newcomer; pessimistic tracking keeps
    it until they are really unloaded), their requests run on until `leaves_at`."""
    freed = sum(i.model.weight_bytes + i.kv_bytes for i in node.instances if i.instance_id in instance_ids)
    instances = [replace(i, status=InstanceStatus.HANDOVER, leaves_at=leaves_at)
                 if i.instance_id in instance_ids else i for i in node.instances]
    return replace(node, instances=instances, budget_bytes=node.budget_bytes - freed)
