"""What an instance costs: the one place the core answers it (every decision asks here).

- **Compute per iteration**: its profile with its layout (`layout_profile`: layer replicas,
  activation hops to moved layers) and, while it serves through an execution pipeline, the
  pipeline's hops (`own_profile`, `instance_profile`); on a node whose hosted stages take a
  share of its compute, that contention (`contention`, `contended`); an instance's decode step
  and a node's decode round (`decode_step_s`, `decode_round_s`, `round_fits`); what a stage of
  another node's instance takes of its host (`run_layer_work`, `stage_load`,
  `pipeline_helper_loads`). Online calibration judges an iteration against the same cost
  (`calibration.baseline_s`).
- **Memory**: K/V demand (`m_require`, `kv_demand`), a layer's weights (`layer_weight_bytes`),
  the share of a split instance a node holds (`share_spec`, `layout_spec`, `kv_for_layers`), a
  stage's bytes (`stage_share_bytes`; a λScale helper's `stage_bytes`, `hosted_layer_bytes`,
  `helper_bytes`), a layer move (`plan_layer_move`), the K/V a split instance may hold without
  outgrowing what its stages' hosts reserved (`kv_ceiling`), and a node's free memory
  (`budget_room`, `free_bytes`).
- **Transfers**: one activation hop (`HopCost`), one multicast step (`multicast_step_s`).

Pure: numbers and views in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shared.core.config import CoreConfig
from shared.core.perf_model import ChunkTable, DecodeTable, PerfModel, PrefillTable, Profile
from shared.core.types import (Hardware, InstanceLayout, InstanceStatus, InstanceView, LayerRun,
                               ModelSpec, NodeView, PipelineMode, RequestView)


# -- K/V demand (SLINFER §VII, eq. 2) -------------------------------------------------------------


def in_blocks(tokens: float, block: int) -> int:
    """Tokens rounded up to whole KV blocks."""
    return -(-int(tokens + 0.999999) // block) * block


def request_tokens(r: RequestView, avg_output_len: float, block: int = 1) -> int:
    """I_r + max(O_r, Ō), capped by what the request may ever hold (input + max_tokens)."""
    expected_out = max(r.generated, avg_output_len)
    return in_blocks(min(r.input_len + expected_out, r.input_len + r.max_tokens), block)


def m_require(requests: list[RequestView], kv_bytes_per_token: int, avg_output_len: float,
              floor_tokens: int, block: int = 1) -> int:
    """Eq. 2: C * max(sum_r (I_r + max(O_r, Ō)), L_min), each request in whole blocks."""
    tokens = sum(request_tokens(r, avg_output_len, block) for r in requests)
    return int(kv_bytes_per_token * max(tokens, floor_tokens))


def kv_demand(spec: ModelSpec, requests: list[RequestView]) -> int:
    """M_require of an instance of `spec` holding `requests`."""
    return m_require(requests, spec.kv_bytes_per_token, spec.avg_output_len, spec.max_context,
                     spec.kv_block_tokens)


# -- compute: hops, replicas, layouts, contention --------------------------------------------------


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
    return replace(profile, prefill=prefill, decode=decode, chunks=_hopped(profile, hops, hop),
                   source=f"{profile.source} + pipeline ({hops} hops)")


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
    return replace(profile, prefill=prefill, decode=decode, chunks=_hopped(profile, hops, hop),
                   source=f"{profile.source} + {rep.replicas()} layer replicas")


def _hopped(profile: Profile, hops: int, hop: HopCost) -> ChunkTable | None:
    """The measured chunk table with each chunk's activations crossing `hops` links, as the
    prefill table's prompts do (None where none was measured)."""
    if profile.chunks is None:
        return None
    return profile.chunks.scaled(1.0, lambda n: hops * hop.seconds(n))


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


def instance_profile(perf: PerfModel, inst: InstanceView, hardware: Hardware) -> Profile | None:
    """The profile an instance's iterations are predicted with (its layout's, if split; with
    the pipeline's hops while it serves through one, λScale's execute-while-load)."""
    profile = perf.get(inst.model.name, hardware)
    return None if profile is None else own_profile(profile, inst)


def own_profile(profile: Profile, inst: InstanceView) -> Profile:
    """`profile` (of the instance's model on its node's hardware) with what the instance adds to
    each iteration: the pipeline's hops while it serves through one, its layout's replicas and
    hops (`instance_profile` on a given profile)."""
    mode = inst.pipeline
    if mode is not None:
        profile = pipeline_profile(profile, mode.hops, HopCost(
            mode.hop_latency_s, mode.hop_bytes_per_s, mode.token_bytes))
    return layout_profile(profile, inst.layout)


def run_layer_work(run: LayerRun, degrees: list[int]) -> float:
    """Layers' worth of one step a run computes on its host: each of its layers, over its
    replica count where the run is a replica (the batch is split among a layer's replicas);
    `degrees` is `layout_replication(layout).degrees()`."""
    return sum(1 / degrees[i] if run.replica else 1 for i in range(run.start, run.end))


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
    share = run_layer_work(run, degrees) / layers
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


def contended(config: CoreConfig, stage_load: float) -> CoreConfig:
    """The validation of a node whose hosted layer stages take `stage_load` of its compute
    (`NodeView.stage_load`): each of its own iterations gets the rest, so it takes
    1 / (1 - load) as long as its profile says, on top of the overestimate. A node whose
    stages may take all of it can promise nothing (every step infinitely long)."""
    if stage_load <= 0:
        return config
    if stage_load >= 1:
        return replace(config, overestimate=math.inf)
    return replace(config, overestimate=(1 + config.overestimate) / (1 - stage_load) - 1)


def contention(stage_load: float) -> float:
    """How much longer an iteration takes on a node whose hosted stages take `stage_load` of its
    compute: 1 / (1 - load), what `contended` applies to its validation (infinite at 1)."""
    if stage_load <= 0:
        return 1.0
    return math.inf if stage_load >= 1 else 1 / (1 - stage_load)


def decode_step_s(inst: InstanceView, layout: InstanceLayout | None, profile: Profile,
                  config: CoreConfig) -> float:
    """The instance's decode step with its batch under `layout`, as the shadow validation
    predicts it (with the overestimate)."""
    batch = max(1, inst.batch_size)
    length = avg_context(inst)
    return layout_profile(profile, layout).decode_s(batch, length) * (1 + config.overestimate)


def decode_round_s(node: NodeView, serving: list[InstanceView], perf: PerfModel,
                   config: CoreConfig) -> float:
    """One decode step of each instance with requests on the node, with the overestimate."""
    total = 0.0
    for inst in serving:
        profile = instance_profile(perf, inst, node.hardware)
        if profile is None:
            return math.inf
        total += profile.decode_s(inst.batch_size, avg_context(inst))
    return total * (1 + config.overestimate)


def serves(inst: InstanceView) -> bool:
    """Does the instance take part in its node's decode rounds (requests it keeps)?"""
    return bool(inst.requests) and inst.status is not InstanceStatus.HANDOVER


def round_fits(node: NodeView, load: float, perf: PerfModel | None, config: CoreConfig) -> bool:
    """Would the node's busy instances still fit one decode round each within their tightest
    TPOT SLO (SLINFER's case 3) while stages it hosts take `load` of its compute (all of them:
    what it hosts already and what it would take on)? Without profiles (`perf` None) only a
    node with nothing to serve can say yes."""
    busy = [i for i in node.instances if serves(i)]
    if not busy:
        return True
    if perf is None or load >= 1:
        return False
    return decode_round_s(node, busy, perf, contended(config, load)) <= \
        min(tightest_tpot(i) for i in busy)


def pipeline_helper_loads(model: ModelSpec, mode: PipelineMode) -> dict[str, float]:
    """The share of each helper's compute a pipelined instance's stage on it takes while the
    instance steps back to back: the layers it runs over the model's (a DRAM holder every layer
    but the one the head node starts with, `stage_bytes`; a receiver its ranges). The hops make
    each step longer than the layers' compute, so this is the ceiling (`stage_load`'s share)."""
    layers = max(1, model.layers)
    if not mode.ranges:
        return {h: (layers - 1) / layers for h in mode.helpers}
    out: dict[str, float] = {}
    for r in mode.ranges:
        out[r.helper] = out.get(r.helper, 0.0) + (r.end - r.start) / layers
    return out


def avg_context(inst: InstanceView) -> float:
    """The average context of the instance's requests (1 with none: a decode step's length)."""
    if not inst.requests:
        return 1.0
    return sum(r.context_len() for r in inst.requests) / len(inst.requests)


def tightest_tpot(inst: InstanceView) -> float:
    """The tightest TPOT SLO among the instance's requests (infinite with none)."""
    return min((r.slo.tpot_s for r in inst.requests), default=math.inf)


# -- memory of a split instance, its stages and a pipeline's helpers -------------------------------


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


def kv_for_layers(kv_bytes: int, layers_before: int, layers_after: int) -> int:
    """A split instance's K/V pool on its node once it runs `layers_after` layers there instead
    of `layers_before`: the pool is per layer with the block count kept, rounded up so the
    engine keeps every block (`NodeScheduler.set_layout`)."""
    return -(-kv_bytes * layers_after // layers_before)


def layout_spec(layout: InstanceLayout) -> ModelSpec:
    """What the instance's own node holds of it: its local layers' weights and K/V, the head."""
    spec = layout.model
    return share_spec(spec, layout.local_layers(), spec.layers, spec.head_bytes, head=True)


def kv_ceiling(inst: InstanceView) -> int | None:
    """The most K/V the instance may hold on its node (None: no ceiling but its node's memory).
    The stages of a split or replicated instance on other nodes mirror its pool's block count,
    and their hosts reserved their share of the pool as it was when they took the layers
    (`LayerRun.kv_bytes`, `stage_share_bytes`, `NodeScheduler.hold`); a larger pool here would
    grow them beyond what their hosts' ledgers approved. So its pool may grow (back) only to
    what each run's reservation covers, per layer, for its local layers; a run whose
    reservation is not known holds it at the pool it has (a request that needs more goes
    elsewhere, or waits until the layers are back).
    The same holds for an instance serving through an execution pipeline (λScale): its helpers'
    stages mirror its block count too, and the placer had them reserve K/V for one full context
    (`stage_bytes`, `hosted_layer_bytes`), so until it runs alone its pool stays within that."""
    ceilings = []
    if inst.pipeline is not None and inst.pipeline.helpers:
        ceilings.append(inst.model.kv_bytes_per_token * inst.model.max_context)
    if inst.layout is not None and inst.layout.runs:
        local = inst.layout.local_layers()
        ceilings += [r.kv_bytes * local // (r.end - r.start) if r.kv_bytes > 0 else inst.kv_bytes
                     for r in inst.layout.runs]
    return min(ceilings, default=None)


def reservations_cover(inst: InstanceView, layout: InstanceLayout) -> bool:
    """Do the hosts of the runs `layout` adds to `inst` hold their layers' share of its K/V pool
    as it is now? A run's reservation (`LayerRun.kv_bytes`) is that share when the move was
    planned (`stage_share_bytes`, `plan_layer_move`); a pool that grew in between (a join
    admitted while the host took the layers) would have the new stage mirror more than its host
    reserved. A run whose reservation is not known is taken as it is (`kv_ceiling`)."""
    here = inst.layout.local_layers() if inst.layout is not None else inst.model.layers
    known = set(inst.layout.runs) if inst.layout is not None else set()
    per_layer = inst.kv_bytes // max(1, here)
    return all(r.kv_bytes <= 0 or (r.end - r.start) * per_layer <= r.kv_bytes
               for r in layout.runs if r not in known)


def stage_share_bytes(inst: InstanceView, layers: int) -> int:
    """A stage of `layers` of the instance on another node: their weights and their share of
    the instance's K/V pool (the stage's pool mirrors the instance's block count)."""
    full = inst.layout.model if inst.layout is not None else inst.model
    here = inst.layout.local_layers() if inst.layout is not None else full.layers
    layer = layer_weight_bytes(full, full.layers, full.head_bytes)
    return layers * (layer + inst.kv_bytes // max(1, here))


def stage_bytes(model: ModelSpec) -> int:
    """What a helper's stage may hold at most: every layer but one with their K/V for a full
    context (the head node holds at least one layer when the pipeline starts)."""
    remote = model.layers - 1
    weights = share_spec(model, remote, model.layers, model.head_bytes, head=False).weight_bytes
    return weights + model.kv_bytes_per_token * remote // model.layers * model.max_context


def hosted_layer_bytes(model: ModelSpec) -> int:
    """What hosting one layer for another receiver's instance adds on a receiver: that layer's
    K/V for a full context (its own instance holds the layer's weights already)."""
    return model.kv_bytes_per_token // max(1, model.layers) * model.max_context


def helper_bytes(model: ModelSpec, mode: PipelineMode) -> dict[str, int]:
    """What each helper of `mode` holds for the instance: a DRAM holder the stage of every layer
    it lacks (`stage_bytes`), a receiver its ranges' K/V (`hosted_layer_bytes`)."""
    if not mode.ranges:
        return {h: stage_bytes(model) for h in mode.helpers}
    out: dict[str, int] = {}
    for r in mode.ranges:
        out[r.helper] = out.get(r.helper, 0) + (r.end - r.start) * hosted_layer_bytes(model)
    return out


def multicast_step_s(model_bytes: int, blocks: int, link_bytes_per_s: float,
                     step_latency_s: float = 0.0) -> float:
    """One step of a multicast of a checkpoint in `blocks` blocks: a block over the link plus
    the step's fixed latency (λScale §4.2)."""
    return model_bytes / blocks / link_bytes_per_s + step_latency_s


def budget_room(node: NodeView) -> int:
    """Memory the node's optimistic budget may still approve (SLINFER §VII-C)."""
    return node.memory_bytes - node.budget_bytes


def free_bytes(node: NodeView) -> int:
    """Memory a new hold can take now: the optimistic budget's room, and pessimistic tracking's
    (a hold beyond that would park in the reservation station until running ops end)."""
    return node.memory_bytes - max(node.budget_bytes, node.pessimistic_bytes)
