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
ledger (the core sees such an instance as an ordinary one with its own profile and bytes), are
in `shared.core.cost` (re-exported here):

- `HopCost`: one transfer of activations between two processes of the instance (a latency plus
  the tokens' hidden states over the link), as `services/node/engines/split.py` measures it.
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
from dataclasses import dataclass

from shared.core.cost import HopCost, Replication, plan_layer_move
from shared.core.perf_model import Profile
from shared.core.types import ModelSpec


@dataclass(frozen=True)
class Device:
    name: str
    free_layers: int  # layers' worth of memory (and compute share) it can take


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


# -- stages and module reduction under memory pressure -------------------------------------------


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
