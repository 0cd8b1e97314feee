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

Pure: the node workers carry the plans out, the simulator times them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
