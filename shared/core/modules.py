"""Module-level scaling (CoCoServe §3-4), as plans: replicate some decoder layers of an instance
onto devices with spare room instead of starting a whole new instance, and, under SLO
violations or memory pressure, shed layers in order of rising cost instead of evicting the
instance.

Speedup model (after CoCoServe's Eq. 3-4, homogeneous devices, batch split evenly among a
layer's replicas): with p_i replicas of layer i (p_i = 1: not replicated) and C the cost of one
hop of activations between devices relative to one layer's compute,

    speedup(p) = L / ( sum_i 1/p_i  +  C * hops )

where hops counts the activation transfers a forward pass makes: entering and leaving each
maximal run of consecutive layers that a device holds as replicas. Replicating layers raises
the parallel part; scattering replicas adds hops, so contiguous runs are preferred.

`scale_up` is Algorithm 1: for each device with room, take the layers that extend the longest
contiguous run first and keep a replica only if it raises the modelled speedup.
`module_reduction` is Algorithm 2's order: migrate modules, then evict replicas (the one whose
loss costs the least speedup first), then reduce the batch.

The cost and memory of a split or replicated instance, for shadow validation and the memory
ledger (the core sees such an instance as an ordinary one with its own profile and bytes):

- `HopCost`: one transfer of activations between two processes of the instance (a latency plus
  the tokens' hidden states over the link), as `services/node/stages.py` measures it.
- `pipeline_profile`: an instance whose layers run in a chain of processes (λScale's execution
  pipeline, or CoCoServe after migrating layers): every iteration computes the same layers as the
  local one plus `hops` transfers of its tokens' activations.
- `replicated_profile`: CoCoServe's speedup model on the profile's own tables: a decode step of b
  requests runs each layer with p_i replicas on ceil(b / p_i) rows (the replicas in parallel),
  plus the hops. With decode time linear in b this is exactly `speedup` (tests check it); on a
  real table, where small batches cost nearly as much as large ones, it is smaller, as measured.
- `share_spec` / `plan_layer_move`: the bytes each node holds of a split instance, and what a
  layer migration moves between two nodes' ledgers (the destination's stage is a LOAD parked in
  its reservation station until it fits; the source shrinks once the move is done).

Pure: the node workers carry the plans out, the simulator times them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from shared.core.perf_model import DecodeTable, PerfModel, PrefillTable, Profile
from shared.core.types import Hardware, InstanceLayout, InstanceView, LayerRun, ModelSpec


@dataclass(frozen=True)
class Device:
    name: str
    free_layers: int  # layers' worth of memory (and compute share) it can take


@dataclass
class Replication:
    """Which layers of an instance have replicas where (the original holds every layer)."""

    layers: int
    on: dict[str, set[int]] = field(default_factory=dict)  # device -> layer indices replicated there

    def degrees(self) -> list[int]:
        p = [1] * self.layers
        for held in self.on.values():
            for i in held:
                p[i] += 1
        return p

    def hops(self) -> int:
        return sum(2 * _runs(held) for held in self.on.values())

    def replicas(self) -> int:
        return sum(len(h) for h in self.on.values())


def _runs(layers: set[int]) -> int:
    """Maximal runs of consecutive indices."""
    return sum(1 for i in layers if i - 1 not in layers)


def speedup(rep: Replication, hop_cost: float) -> float:
    p = rep.degrees()
    return rep.layers / (sum(1 / x for x in p) + hop_cost * rep.hops())


def _continuity_order(layers: int, held: set[int]) -> list[int]:
    """Layers not yet on the device, those extending the device's longest run first (then by
    index), so replicas stay contiguous and hops few."""
    if not held:
        return list(range(layers))
    start = min(held)
    best_start, best_len = start, 0
    for i in sorted(held):  # the longest run of what the device holds
        if i - 1 not in held:
            j = i
            while j + 1 in held:
                j += 1
            if j - i + 1 > best_len:
                best_start, best_len = i, j - i + 1
    end = best_start + best_len - 1
    near = [end + 1 + k for k in range(layers) if end + 1 + k < layers]
    near += [best_start - 1 - k for k in range(layers) if best_start - 1 - k >= 0]
    seen: set[int] = set()
    order = [i for i in near + list(range(layers)) if i not in held and not (i in seen or seen.add(i))]
    return order


def scale_up(rep: Replication, devices: list[Device], hop_cost: float) -> Replication:
    """Algorithm 1: add replicas device by device while each one raises the modelled speedup."""
    out = Replication(rep.layers, {d: set(h) for d, h in rep.on.items()})
    current = speedup(out, hop_cost)
    for dev in devices:
        held = out.on.setdefault(dev.name, set())
        budget = dev.free_layers
        while budget > 0:
            for layer in _continuity_order(out.layers, held):
                held.add(layer)
                trial = speedup(out, hop_cost)
                if trial > current:
                    current, budget = trial, budget - 1
                    break
                held.discard(layer)
            else:
                break  # no layer helps on this device
        if not held:
            del out.on[dev.name]
    return out


class Reduction(str, enum.Enum):
    MIGRATE = "migrate"
    EVICT_REPLICA = "evict_replica"
    REDUCE_BATCH = "reduce_batch"


@dataclass(frozen=True)
class ReductionStep:
    action: Reduction
    device: str = ""  # the device a replica is evicted from / a module migrates to
    layer: int = -1


def eviction_order(rep: Replication, hop_cost: float) -> list[tuple[str, int]]:
    """Replicas to drop, the one whose loss costs the least modelled speedup first."""
    trial = Replication(rep.layers, {d: set(h) for d, h in rep.on.items()})
    order: list[tuple[str, int]] = []
    while trial.replicas():
        def loss(item: tuple[str, int]) -> tuple[float, str, int]:
            dev, layer = item
            trial.on[dev].discard(layer)
            after = speedup(trial, hop_cost)
            trial.on[dev].add(layer)
            return (-after, dev, layer)
        pick = min(((d, i) for d, h in trial.on.items() for i in h), key=loss)
        order.append(pick)
        trial.on[pick[0]].discard(pick[1])
    return order


def module_reduction(rep: Replication, hop_cost: float, migrate_to: list[str]) -> list[ReductionStep]:
    """Algorithm 2's escalation, cheapest first: migrate modules off the pressured device (to
    each of `migrate_to`), then evict replicas in `eviction_order`, then reduce the batch. The
    caller applies steps until the violation is gone."""
    steps = [ReductionStep(Reduction.MIGRATE, device=d) for d in migrate_to]
    steps += [ReductionStep(Reduction.EVICT_REPLICA, d, i) for d, i in eviction_order(rep, hop_cost)]
    steps.append(ReductionStep(Reduction.REDUCE_BATCH))
    return steps


# -- cost and memory of a split / replicated instance ------------------------------------------


@dataclass(frozen=True)
class HopCost:
    """One transfer of activations between two processes of an instance."""

    latency_s: float  # per transfer, whatever its size (framing, a round trip, scheduling)
    bytes_per_s: float  # the link's bandwidth
    token_bytes: int  # one token's hidden state: hidden_size x the dtype's bytes

    def seconds(self, tokens: float) -> float:
        return self.latency_s + tokens * self.token_bytes / self.bytes_per_s


def pipeline_profile(profile: Profile, hops: int, hop: HopCost) -> Profile:
    """The instance's profile when each iteration crosses `hops` links with all its tokens'
    activations (a stage that ends the chain sends back only the last position; counting every
    token keeps the estimate on the safe side)."""
    if hops < 0:
        raise ValueError("hops must be >= 0")
    if hops == 0:
        return profile
    pre = profile.prefill
    dec = profile.decode
    prefill = PrefillTable(list(pre.lengths),
                           [s + hops * hop.seconds(n) for n, s in zip(pre.lengths, pre.seconds)])
    decode = DecodeTable(list(dec.batch_sizes), list(dec.lengths),
                         [[s + hops * hop.seconds(b) for s in row]
                          for b, row in zip(dec.batch_sizes, dec.seconds)])
    return replace(profile, prefill=prefill, decode=decode,
                   source=f"{profile.source} + pipeline ({hops} hops)")


def replicated_profile(profile: Profile, rep: Replication, hop: HopCost) -> Profile:
    """The instance's profile with `rep`'s layer replicas: decode as the module docstring says;
    a prefill runs one request on one executor, so it gains nothing and may pay the hops."""
    hops = rep.hops()
    if not rep.replicas():
        return profile
    degrees = rep.degrees()
    dec = profile.decode

    def step(b: int, length: int) -> float:
        per_layer = sum(profile.decode_s(math.ceil(b / p), length) for p in degrees)
        return per_layer / rep.layers + hops * hop.seconds(math.ceil(b / max(degrees)))

    decode = DecodeTable(list(dec.batch_sizes), list(dec.lengths),
                         [[step(b, n) for n in dec.lengths] for b in dec.batch_sizes])
    pre = profile.prefill
    prefill = PrefillTable(list(pre.lengths),
                           [s + hops * hop.seconds(n) for n, s in zip(pre.lengths, pre.seconds)])
    return replace(profile, prefill=prefill, decode=decode,
                   source=f"{profile.source} + {rep.replicas()} layer replicas")


@dataclass(frozen=True)
class LayerMove:
    source_bytes_after: int  # the instance's bytes left on the source node
    dest_bytes: int  # the stage's bytes on the destination node (weights + its K/V pool)
    moved_bytes: int  # what crosses the link: the layers' weights (or their reads) + live K/V


def layer_weight_bytes(spec: ModelSpec, layers: int, head_bytes: int) -> int:
    """One decoder layer's weights (the instance's weights less embeddings, norm and head)."""
    if not 0 <= head_bytes <= spec.weight_bytes or layers <= 0:
        raise ValueError("need layers > 0 and 0 <= head_bytes <= weight_bytes")
    return (spec.weight_bytes - head_bytes) // layers


def share_spec(spec: ModelSpec, layers_here: int, layers: int, head_bytes: int,
               head: bool) -> ModelSpec:
    """The part of a split instance one process holds, as the node's ledger sees it: its
    layers' weights (plus the head where it runs) and K/V of its layers only."""
    if not 0 <= layers_here <= layers:
        raise ValueError("layers_here must be within the model's layers")
    weights = layers_here * layer_weight_bytes(spec, layers, head_bytes) + \
        (head_bytes if head else 0)
    return replace(spec, weight_bytes=weights,
                   kv_bytes_per_token=spec.kv_bytes_per_token * layers_here // layers)


def plan_layer_move(spec: ModelSpec, kv_bytes: int, kv_used_bytes: int, layers: int,
                    layers_here: int, moved: int, head_bytes: int) -> LayerMove:
    """Migrating `moved` of the `layers_here` layers an instance runs on its node to a stage on
    another node: its K/V pool is per layer, so the moved layers' share of `kv_bytes` (the pool)
    goes with them and their share of `kv_used_bytes` (live tokens) crosses the link."""
    if not 0 < moved < layers_here <= layers:
        raise ValueError("move at least one layer and keep at least one")
    layer = layer_weight_bytes(spec, layers, head_bytes)
    per_layer_kv = kv_bytes // layers_here
    here = share_spec(spec, layers_here, layers, head_bytes, head=True).weight_bytes + kv_bytes
    dest = moved * (layer + per_layer_kv)
    return LayerMove(here - dest, dest, moved * layer + kv_used_bytes * moved // layers_here)


def stage_key(instance_id: str, start: int, end: int) -> str:
    """The ledger entry of an instance's stage on another node."""
    return f"{instance_id}/layers/{start}:{end}"


def relative_hop_cost(profile: Profile, hop: HopCost, layers: int, batch: int,
                      avg_len: float) -> float:
    """The speedup model's C for this instance now: one hop of the batch's activations over one
    layer's share of a decode step (`scale_up` and `eviction_order` take it)."""
    layer_s = profile.decode_s(batch, avg_len) / layers
    return hop.seconds(batch) / layer_s if layer_s > 0 else math.inf


def layers_to_shed(spec: ModelSpec, kv_bytes: int, layers: int, layers_here: int,
                   head_bytes: int, deficit_bytes: int) -> int | None:
    """Module reduction's first action under memory pressure: the fewest layers whose migration
    frees `deficit_bytes` on the node (their weights and their share of the K/V pool); None
    when even shedding all but one layer would not (the next action: evict replicas, then the
    batch, then the instance)."""
    if deficit_bytes <= 0:
        return 0
    for moved in range(1, layers_here):
        if plan_layer_move(spec, kv_bytes, 0, layers, layers_here, moved,
                           head_bytes).dest_bytes >= deficit_bytes:
            return moved
    return None


# -- an instance's layout (InstanceView.layout) -------------------------------------------------


def layout_hop(layout: InstanceLayout) -> HopCost:
    return HopCost(layout.hop_latency_s, layout.hop_bytes_per_s, layout.model.token_bytes)


def layout_replication(layout: InstanceLayout) -> Replication:
    """The layout's replicas as the speedup model sees them (one device per replica stage)."""
    rep = Replication(layout.model.layers)
    for run in layout.runs:
        if run.replica:
            rep.on.setdefault(f"{run.node_id}/{run.address}", set()).update(range(run.start, run.end))
    return rep


def layout_hops(layout: InstanceLayout) -> int:
    """Activation transfers an iteration makes to and from the moved (not replicated) runs:
    two each (a run that ends the chain sends back only the last position; counted in full)."""
    return 2 * sum(1 for r in layout.runs if not r.replica)


def layout_profile(profile: Profile, layout: InstanceLayout | None) -> Profile:
    """The instance's cost with its layout: `replicated_profile` for its replicas, then
    `pipeline_profile` for the hops to its moved layers."""
    if layout is None or not layout.runs:
        return profile
    hop = layout_hop(layout)
    rep = layout_replication(layout)
    if rep.replicas():
        profile = replicated_profile(profile, rep, hop)
    return pipeline_profile(profile, layout_hops(layout), hop)


def stage_load(profile: Profile, layout: InstanceLayout, run: LayerRun) -> float:
    """The share of its host's compute a stage of the instance (`run`, in `layout`) may take
    while the instance runs iterations back to back: the stage's layers' work in one decode step
    (each on its rows: the batch, or its share of it on a replica) over the step with the
    layout (`layout_profile`), the largest over the profile's decode table; and at least the
    run's share of the step's layers (each over its replicas), which is what a step's time gives
    the stage where compute is proportional (the simulator's host model). Hosts are of the
    owner's hardware kind, so one profile prices both."""
    layers = layout.model.layers
    degrees = layout_replication(layout).degrees()
    share = sum(1 / degrees[i] if run.replica else 1 for i in range(run.start, run.end)) / layers
    step = layout_profile(profile, layout)
    dec = profile.decode
    worst = 0.0
    for b in dec.batch_sizes:
        for n in dec.lengths:
            total = step.decode_s(b, n)
            if total <= 0:
                continue
            work = sum(profile.decode_s(math.ceil(b / degrees[i]) if run.replica else b, n)
                       for i in range(run.start, run.end)) / layers
            worst = max(worst, work / total)
    return max(share, worst)


def layout_spec(layout: InstanceLayout) -> ModelSpec:
    """What the instance's own node holds of it: its local layers' weights and K/V, the head."""
    spec = layout.model
    return share_spec(spec, layout.local_layers(), spec.layers, spec.head_bytes, head=True)


def instance_profile(perf: PerfModel, inst: InstanceView, hardware: Hardware) -> Profile | None:
    """The profile an instance's iterations are predicted with (its layout's, if split; with
    the pipeline's hops while it serves through one, λScale's execute-while-load)."""
    profile = perf.get(inst.model.name, hardware)
    if profile is None:
        return None
    mode = inst.pipeline
    if mode is not None:
        profile = pipeline_profile(profile, mode.hops, HopCost(
            mode.hop_latency_s, mode.hop_bytes_per_s, mode.token_bytes))
    return layout_profile(profile, inst.layout)
