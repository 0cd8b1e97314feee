"""LoRA functions over shared backbones (ServerlessLoRA §4), the decisions as data.

- Memory: an adapter's instance on a node that already holds its backbone costs the adapter and
  its KV; elsewhere it costs the backbone too (`adapter_load_bytes`).
- Artifact pre-loading (§4.1): which backbones and adapters to keep resident on which node, a
  knapsack over node memory whose items are worth (load time saved x invocation rate); the
  paper's greedy by value density, with the precedence that an adapter goes only where its
  backbone is (`preload_plan`). Re-planned as rates change.
- On one node (`plan_node_preload`): the node worker re-plans every few seconds from the rates
  its own admissions show: which backbones' checkpoints to keep in its DRAM tier (a knapsack over
  the tier's bytes, a backbone worth the calls of its adapters too) and which adapters to attach
  to a backbone instance it holds before any request asks for them (a knapsack over the node's
  free memory beside its instances' next KV scale-ups, `preload_room`).
- Across the cluster (`plan_cluster_preload`): the paper's Pre-Loading Scheduler in the controller.
  The placer sees every request, so it plans from cluster-wide rates which node's DRAM tier keeps
  each backbone's checkpoint and which node attaches each adapter; a node carries out the plan it
  was sent while it is fresh, and plans from its own rates when none is (services/node/preload.py).
- Admission through an adapter (§4.4), the one answer the node's admission, its preemption
  trials and the placer all use (`admission_through`): the adapter's bytes where the instance
  lacks it, its load (`adapter_load_s`, at the core's one adapter rate) holding the instance
  up in the shadow validation, and the idle adapters offloading would free. Pre-loading onto a
  serving instance only where its requests can wait for the load (`evaluate.may_hold`).
- Dynamic offloading (§4.3): under memory pressure, the least valuable resident artifacts go
  first, never an adapter with requests in flight nor a backbone an active adapter uses
  (`offload_order`).

Pure: rates and sizes come in, plans go out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from shared.core.admission import Admission, AdmitReason
from shared.core.config import CoreConfig
from shared.core.cost import request_tokens
from shared.core.evaluate import evaluate
from shared.core.perf_model import PerfModel
from shared.core.readiness import cold_start_ready_at
from shared.core.types import AdapterSpec, InstanceStatus, ModelSpec, NodeView, RequestView


@dataclass(frozen=True)
class Artifact:
    name: str  # a backbone's or an adapter's model name
    bytes: int
    load_s: float  # what a cold load of it takes (the time pre-loading saves)
    rate: float  # invocations per second (for a backbone: of all its adapters)
    backbone: str | None = None  # an adapter's backbone; None: this is a backbone

    @property
    def value(self) -> float:
        """Seconds of cold start saved per second (Eq. 1's v = loading delay x arrival rate)."""
        return self.load_s * self.rate

    @property
    def density(self) -> float:
        return self.value / max(1, self.bytes)


# What an adapter's load reads per second (ASSUMPTION: about what the torch engine measured
# reading one from the page cache). The one rate the core prices an adapter's load at: its op in
# the node's timeline, the admission that waits for it, and its value when offloading weighs it.
ADAPTER_LOAD_BYTES_PER_S = 0.5e9


def adapter_load_s(nbytes: int) -> float:
    """How long loading `nbytes` of adapter weights onto a running backbone instance takes (no
    engine start-up: the backbone's engine runs already)."""
    return max(0, nbytes) / ADAPTER_LOAD_BYTES_PER_S


def adapter_ready_at(node: NodeView, nbytes: int, now: float) -> float:
    """When an adapter load of `nbytes` issued now on `node` ends: like a cold start's load
    (`cold_start_ready_at`: after the loads ahead of it on the node's I/O, and after the memory
    ops under way if pessimistic tracking would park it), then `adapter_load_s`. The node's
    timeline prices the op the same way."""
    return cold_start_ready_at(node, nbytes, adapter_load_s(nbytes), now)


# --- an admission through an adapter (ServerlessLoRA §4.4), for the node and the placer -------
def adapter_need(node: NodeView, instance_id: str | None, adapter: AdapterSpec | None) -> int:
    """Bytes an admission through `adapter` adds besides its KV: none where the instance holds
    the adapter already (a new instance never does)."""
    if adapter is None:
        return 0
    inst = node.instance(instance_id) if instance_id is not None else None
    return 0 if inst is not None and adapter.name in inst.adapters else adapter.bytes


def idle_adapter_bytes(node: NodeView, keep: str | None = None) -> int:
    """The bytes of the adapters attached on `node` that no request there runs through (and
    that are not `keep`): what offloading may free for an admission (§4.3)."""
    total = 0
    for inst in node.instances:
        running = {r.adapter for r in inst.requests}
        total += sum(b for name, b in inst.adapters.items() if name not in running and name != keep)
    return total


def evaluate_through(node: NodeView, instance_id: str | None, request: RequestView,
                     model: ModelSpec, adapter: AdapterSpec | None, perf: PerfModel, now: float,
                     config: CoreConfig, not_before: float | None = None,
                     freed: int = 0) -> Admission:
    """`evaluate` for a request that runs through `adapter` (None: the plain backbone), with
    `freed` bytes of idle adapters offloaded first. Where the instance lacks the adapter, its
    bytes must fit beside the admission's KV, and its load holds the instance up: nothing runs
    there, the newcomer's first token included, before the load ends (`adapter_ready_at`)."""
    need = adapter_need(node, instance_id, adapter)
    view = replace(node, budget_bytes=node.budget_bytes - freed) if freed else node
    if not need:
        return evaluate(view, instance_id, request, model, perf, now, config, not_before)
    ready = adapter_ready_at(view, need, now)
    not_before = ready if not_before is None else max(not_before, ready)
    # The KV check (where the admission grows it) sees the adapter's bytes as taken already.
    admission = evaluate(replace(view, memory_bytes=view.memory_bytes - need), instance_id,
                         request, model, perf, now, config, not_before)
    if admission.ok and not _adapter_fits(view, instance_id, model, admission, need):
        return Admission(AdmitReason.MEMORY)
    return admission


def admission_through(node: NodeView, instance_id: str | None, request: RequestView,
                      model: ModelSpec, adapter: AdapterSpec | None, perf: PerfModel,
                      now: float, config: CoreConfig,
                      not_before: float | None = None) -> Admission:
    """The answer the node's admission gives (`NodeScheduler.admit`), on any view of the node:
    `evaluate_through`, and on a memory refusal, again with the idle adapters offloaded first
    (§4.3: the node offloads them before it refuses). The placer plans with it, and the node's
    preemption trial."""
    admission = evaluate_through(node, instance_id, request, model, adapter, perf, now, config,
                                 not_before)
    if admission.reason is not AdmitReason.MEMORY:
        return admission
    spare = idle_adapter_bytes(node, keep=adapter.name if adapter is not None else None)
    if not spare:
        return admission
    return evaluate_through(node, instance_id, request, model, adapter, perf, now, config,
                            not_before, spare)


def _adapter_fits(node: NodeView, instance_id: str | None, model: ModelSpec,
                  admission: Admission, need: int) -> bool:
    """The budget after the admission's KV change still has room for the adapter (evaluate does
    not check memory for an admission that needs no KV growth)."""
    budget = node.budget_bytes
    kv = admission.kv_target_bytes
    if instance_id is None:
        budget += model.weight_bytes + (kv or 0)
    elif kv is not None:
        budget += kv - node.instance(instance_id).kv_bytes
    return budget + need <= node.memory_bytes


RATE_USES = 32  # calls a model's or an adapter's invocation rate is taken over
RATE_MIN_SPAN_S = 1.0  # a rate is never taken over less than this (one burst)


class CallRates:
    """Invocations per second of models and adapters, from their recent calls: the last
    `RATE_USES` calls over the time they span up to now, so a rate falls while nothing calls.
    A call through an adapter counts for the adapter and for its backbone."""

    def __init__(self) -> None:
        self._calls: dict[str, list[float]] = {}

    def note(self, model: str, adapter: str | None, now: float) -> None:
        for name in (model, *([adapter] if adapter else [])):
            calls = self._calls.setdefault(name, [])
            calls.append(now)
            del calls[:-RATE_USES]

    def rate(self, name: str, now: float) -> float:
        calls = self._calls.get(name)
        if not calls:
            return 0.0
        return len(calls) / max(now - calls[0], RATE_MIN_SPAN_S)

    def called(self) -> list[str]:
        return sorted(self._calls)


def adapter_load_bytes(adapter: Artifact, backbone: Artifact, resident: set[str]) -> int:
    """What placing an instance of `adapter` on a node that holds `resident` artifacts loads."""
    return adapter.bytes + (0 if backbone.name in resident else backbone.bytes)


def preload_plan(artifacts: Iterable[Artifact], free_bytes: dict[str, int],
                 resident: dict[str, set[str]] | None = None) -> dict[str, list[str]]:
    """Greedy knapsack by value density: node -> artifacts to pre-load there, in load order.

    An adapter is placed only on a node that holds (or is being given) its backbone; a backbone
    is worth its own value plus the adapters it enables, so it is considered with its best
    adapter's density when that is higher (a backbone nobody calls is worth nothing alone)."""
    resident = {n: set(r) for n, r in (resident or {}).items()}
    items = list(artifacts)
    by_name = {a.name: a for a in items}
    adapters_of: dict[str, list[Artifact]] = {}
    for a in items:
        if a.backbone is not None:
            adapters_of.setdefault(a.backbone, []).append(a)

    def density(a: Artifact) -> float:
        if a.backbone is not None:
            return a.density
        best = max((x.density for x in adapters_of.get(a.name, [])), default=0.0)
        return max(a.density, best)

    plan: dict[str, list[str]] = {n: [] for n in free_bytes}
    room = dict(free_bytes)
    for art in sorted(items, key=lambda a: (-density(a), a.backbone is not None, a.name)):
        if art.value <= 0 and art.backbone is not None:
            continue
        for node in sorted(room, key=lambda n: (-room[n], n)):
            held = resident.setdefault(node, set())
            if art.name in held:
                break  # already there
            if art.backbone is not None and art.backbone not in held:
                continue  # precedence: the backbone first
            if art.bytes <= room[node]:
                room[node] -= art.bytes
                held.add(art.name)
                plan[node].append(art.name)
                break
    # A backbone pre-loaded for adapters that then did not fit anywhere is dead weight: drop it.
    for node, names in plan.items():
        kept = [n for n in names if by_name[n].backbone is not None or by_name[n].value > 0
                or any(by_name[x].backbone == n for x in resident[node] if x in by_name)]
        plan[node] = kept
    return plan


@dataclass(frozen=True)
class NodePreload:
    """What one node pre-loads now (`plan_node_preload`)."""

    # Backbones whose checkpoints the DRAM tier should hold, least valuable first: touching them
    # in this order leaves the most valuable the most recently used, and what the plan left out
    # is what the tier's LRU gives up first.
    checkpoints: tuple[str, ...] = ()
    adapters: tuple[tuple[str, str], ...] = ()  # (backbone instance id, adapter) to attach


def _called_checkpoints(backbones: list[Artifact], adapters: list[Artifact]) -> list[Artifact]:
    """The backbones worth a checkpoint in DRAM. A backbone's checkpoint serves its adapters'
    calls too (a caller that counts them in its rate already loses nothing: the larger of the
    two is taken); one nobody called, directly or through an adapter, is worth nothing."""
    through: dict[str, float] = {}
    for a in adapters:
        through[a.backbone] = through.get(a.backbone, 0.0) + a.rate
    checkpoints = [replace(b, rate=max(b.rate, through.get(b.name, 0.0))) for b in backbones]
    return [b for b in checkpoints if b.value > 0]


def plan_node_preload(backbones: Iterable[Artifact], adapters: Iterable[Artifact],
                      dram_bytes: int, instances: dict[str, str],
                      attached: dict[str, set[str]], free_bytes: int) -> NodePreload:
    """One node's pre-loading (§4.1) from the rates it sees.

    `backbones`: their rate counts the calls through their adapters too; `adapters`: each with
    its backbone. `dram_bytes`: the DRAM tier's capacity (checkpoints are planned from scratch
    over all of it, so a backbone that became hot displaces one that cooled). `instances`:
    backbone -> a ready instance of it on the node, which adapters can be attached to;
    `attached`: instance id -> adapters on it; `free_bytes`: the node's memory budget left,
    which attached adapters take (and give back first under pressure, §4.3). Only artifacts
    with calls are planned: a backbone or adapter nobody called is worth nothing."""
    backbones, adapters = list(backbones), list(adapters)
    dram = preload_plan(_called_checkpoints(backbones, adapters), {"dram": dram_bytes})["dram"]
    # Adapters: only onto a backbone instance the node holds; held backbones and the adapters
    # attached to any of their instances are resident already.
    resident = set(instances) | {a for iid in instances.values() for a in attached.get(iid, set())}
    wanted = {a.name: a for a in adapters if a.backbone in instances and a.value > 0}
    held = [b for b in backbones if b.name in instances]
    attach = preload_plan([*held, *wanted.values()], {"memory": free_bytes},
                          {"memory": resident})["memory"]
    return NodePreload(tuple(reversed(dram)),
                       tuple((instances[wanted[n].backbone], n) for n in attach if n in wanted))


def preload_room(node: NodeView, watermark: float) -> int:
    """The memory a node may pre-load adapters into: its free budget less the next KV scale-up of
    each instance. A join that outgrows an instance's cache scales it to (1 + w) x (the cache + the
    newcomer) (§VII-B); the room for that with a newcomer like the instance's average request stays
    free. Pre-loaded adapters do give way under pressure (§4.3), but their offload holds up the
    admission that needed the bytes, a KV growth in the token loop that finds no room evicts
    instead, and the next turn pre-loaded them again: they take only memory no admitted demand
    is about to want."""
    reserve = 0
    for inst in node.instances:
        if inst.status is InstanceStatus.UNLOADING:
            continue
        spec = inst.model
        average = (spec.kv_bytes_per_token * sum(request_tokens(r, spec.avg_output_len,
                                                                spec.kv_block_tokens)
                                                 for r in inst.requests) / len(inst.requests)
                   if inst.requests else 0)
        reserve += int(watermark * inst.kv_bytes + (1 + watermark) * average)
    used = max(node.budget_bytes, node.pessimistic_bytes)
    return max(0, node.memory_bytes - used - reserve)


def plan_cluster_preload(nodes: Iterable[NodeView], backbones: Iterable[Artifact],
                         adapters: Iterable[Artifact],
                         watermark: float) -> dict[str, NodePreload]:
    """The Pre-Loading Scheduler's decision (§3, §4.1) for the whole cluster, from the rates the
    placer sees (every request passes through it): node -> what that node pre-loads.

    Checkpoints: each called backbone's checkpoint in one node's DRAM tier (`StorageView.dram_bytes`),
    the most valuable per byte first, on a node whose tier already holds it when one has room (no
    read), else on the node with the most room left. Planned from scratch over the tiers' whole
    capacity, so a backbone that became hot displaces one that cooled. Adapters: attached to a
    ready instance of their backbone on the node with the most room (`preload_room`, with the
    core's KV `watermark`), by the same greedy (`preload_plan`, precedence: the backbone held
    there). A node whose view lacks a DRAM tier gets no checkpoints."""
    nodes = sorted(nodes, key=lambda n: n.node_id)
    backbones, adapters = list(backbones), list(adapters)
    dram = _place_checkpoints(_called_checkpoints(backbones, adapters), nodes)
    ready: dict[str, dict[str, str]] = {}  # node -> backbone -> a ready instance of it there
    resident: dict[str, set[str]] = {}
    for node in nodes:
        for inst in sorted(node.instances, key=lambda i: i.instance_id):
            if inst.status is InstanceStatus.READY:
                ready.setdefault(node.node_id, {}).setdefault(inst.model.name, inst.instance_id)
                resident.setdefault(node.node_id, set()).update({inst.model.name, *inst.adapters})
    held_anywhere = {b for by in ready.values() for b in by}
    wanted = [a for a in adapters if a.backbone in held_anywhere and a.value > 0]
    free = {n.node_id: preload_room(n, watermark) for n in nodes if n.node_id in ready}
    # Adapters only: a backbone among the items would be placed on paper on a node that does not
    # run it (the one with the most room), and its adapters after it, with no instance there.
    attach = preload_plan(wanted, free, resident)
    by_name = {a.name: a for a in wanted}
    return {n.node_id: NodePreload(
        tuple(reversed(dram.get(n.node_id, []))),
        tuple((ready[n.node_id][by_name[x].backbone], x)
              for x in attach.get(n.node_id, []) if x in by_name))
        for n in nodes}


def _place_checkpoints(backbones: list[Artifact], nodes: list[NodeView]) -> dict[str, list[str]]:
    """One DRAM-tier copy per backbone, by value density (`plan_cluster_preload`)."""
    room = {n.node_id: n.storage.dram_bytes for n in nodes if n.storage is not None}
    holds = {n.node_id: {m for m, tier in n.storage.holds.items() if tier == "dram"}
             for n in nodes if n.storage is not None}
    plan: dict[str, list[str]] = {node: [] for node in room}
    for art in sorted(backbones, key=lambda a: (-a.density, a.name)):
        fits = [node for node in room if art.bytes <= room[node]]
        if not fits:
            continue
        node = min(fits, key=lambda n: (art.name not in holds[n], -room[n], n))
        room[node] -= art.bytes
        plan[node].append(art.name)
    return plan


def offload_order(resident: Iterable[Artifact], in_flight: set[str]) -> list[str]:
    """Resident artifacts to offload under memory pressure, the least valuable (per byte) first.
    Never an adapter with requests in flight, nor a backbone such an adapter runs on."""
    resident = list(resident)
    busy_backbones = {a.backbone for a in resident if a.name in in_flight and a.backbone}
    candidates = [a for a in resident if a.name not in in_flight and a.name not in busy_backbones]
    # Adapters before their backbone: a backbone goes only after every adapter on it.
    order = sorted(candidates, key=lambda a: (a.density, a.backbone is None, a.name))
    out: list[str] = []
    gone: set[str] = set()
    pending = list(order)
    while pending:
        for a in pending:
            users = [x for x in resident if x.backbone == a.name and x.name not in gone]
            if a.backbone is None and users:
                continue
            out.append(a.name)
            gone.add(a.name)
            pending.remove(a)
            break
        else:
            break  # the rest are backbones with adapters that must stay
    return out
