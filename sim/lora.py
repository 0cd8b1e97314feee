"""LoRA functions in the simulator (ServerlessLoRA): many adapters over a few backbones.

In a LoRA run (`SimConfig.lora_adapters` > 0) every function of the trace is a LoRA adapter of
rank `lora_rank` over one of `lora_backbones` backbones (function i over backbone i mod B; the
backbones take `model_size`, or the `model_mix` split). Two ways to serve them:

- "shared" (SLINFER with backbone sharing, ServerlessLoRA §4.4): the core places a request on its
  backbone's instances (`place()` routes to an existing instance of the backbone first, so a node
  that holds the backbone is preferred); the node scheduler admits it with its `AdapterSpec`, so
  an adapter new to the instance costs its bytes plus its KV, not a model, and loads as its own
  memory op; idle adapters are offloaded under memory pressure (§4.3). A batch mixes adapters,
  computed unmerged: its iterations cost what `lora_cost()` adds (the core's `LoraCost`).
  Adapters and backbone checkpoints are pre-loaded as the services do (§4.1, sim/preload.py:
  every `lora_preload_s`, the placer's cluster plan carried out by the nodes).
- "merged" (one full model per function, ServerlessLLM-style): function i is its own model of
  its backbone's size (the adapter merged into a copy of the weights). Any system runs it:
  SLINFER's core, or the sllm baselines (`sim/baselines.py`), which cannot share a backbone.

Function names are the default run's (`m000-7b`, ...), so with one size a merged run is the same
run as `--models N` without LoRA (the same arrivals, the same report figures).

Numbers (from `bench/lora.py`, bench/results/lora_*.json, rank 8 on all seven projections):
- Adapter bytes: rank x (d_in + d_out) summed over q, k, v, o, gate, up, down, x layers x dtype
  bytes. This formula gives exactly the adapter bytes the torch engine held in memory for the
  `small` shape (3,735,552 B in f32) and for llama-3.2-1b (11,272,192 B in bf16); for the
  simulator's 16-bit shapes it gives 24.3 MB (3B), 40.0 MB (7B) and 62.6 MB (13B) at rank 8.
- An adapter loads at the DRAM-to-device rate of the profiles' backbone loads (13.48 GB/s, the
  paper's 1 s per 7B), or from the node's tiers when the run has them; no engine start-up (the
  backbone's engine is running).
- Unmerged LoRA cost: the core's `Profile.lora` (a `LoraCost`) on every backbone profile, and
  `RequestView.lora_rank` on every adapter request, so the core plans with it and the simulated
  engines take that long (`predict_seconds`). Decode: +18.5% / +28.4% / +9.1% per step at batch
  1 / 8 / 32 with four adapters mixed (`small` shape, CPU, one thread, rank 8), linear between
  those points and flat beyond; a batch over more than four distinct adapters costs
  proportionally more (`LoraCost.decode_factor`: one segment per adapter in the engine).
  Prefill: not measured; ASSUMPTION: the batch-32 figure (+9.1%), the measured regime nearest
  a prefill's large matmuls. ASSUMPTION: the same relative cost on
  the simulated Xeon and A100 (no GPU figure is measured) and at every rank (one rank measured).
  `lora_decode_overhead` replaces the curve with one constant (for batches over up to four
  adapters, as the curve).

Memory (this module's report section): the bytes of weights resident (backbones, merged models
and adapters) and the bytes the nodes hold for instances (SLINFER: the memory ledger's budget,
weights + KV + adapters; the baselines: the whole node or half-node slot an instance occupies),
time-averaged and at their peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shared.core.lora import NodePreload
from shared.core.memory import MemOp, MemOpKind
from shared.core.perf_model import LoraCost, PerfModel
from shared.core.preload import Preloadable
from shared.core.types import (AdapterSpec, InstanceStatus, ModelSpec, NodeView, RequestView,
                               adapter_key, adapter_owner, slo_for_input)
from sim import profiles as prof
from sim.baselines import BaselineSystem
from sim.build import DRAIN_S, Cluster, SimOutcome
from sim.build import build_system as build_plain
from sim.config import SimConfig, model_sizes, params_of
from sim.engine import EventLoop, Recorder, RunResult, SimRequest, Usage, run
from sim.metrics import Metrics
from sim.preload import Preloading
from sim.report import build_report
from sim.slinfer_system import SimNode, SlinferSystem
from sim.workload import LengthSampler, build_workload



# Feed-forward width of each simulated shape (the Hugging Face config.json `intermediate_size`);
# ModelShape does not carry it because nothing but the adapter's size depends on it.
INTERMEDIATE = {"llama-3.2-3b": 8192, "llama-2-7b": 11008, "llama-2-13b": 13824}

# bench/results/lora_small.json "decode": the relative cost of a decode step with four adapters
# mixed unmerged over the same step on the bare backbone, by batch size.
MEASURED_DECODE_OVERHEAD = ((1, 0.1848), (8, 0.2837), (32, 0.0913))


def adapter_bytes(hidden: int, intermediate: int, layers: int, kv_width: int, rank: int,
                  dtype_bytes: int) -> int:
    """A rank-r LoRA adapter on all seven projections of a Llama layer: A (r x d_in) and
    B (d_out x r) per projection; q and o are hidden -> hidden, k and v hidden -> kv_width,
    gate and up hidden -> intermediate, down intermediate -> hidden."""
    per_layer = (2 * (hidden + hidden) + 2 * (hidden + kv_width)
                 + 3 * (hidden + intermediate))
    return rank * per_layer * layers * dtype_bytes


def shape_adapter_bytes(shape: prof.ModelShape, rank: int) -> int:
    return adapter_bytes(shape.hidden, INTERMEDIATE[shape.name], shape.layers,
                         shape.kv_heads * shape.head_dim, rank, shape.dtype_bytes)


def lora_cost(rank: int, constant: float | None = None) -> LoraCost:
    """What unmerged LoRA adds to a backbone's iterations (see the module docstring)."""
    if constant is not None:  # in place of the curve, so over as many adapters as it was
        return LoraCost.flat(constant, rank, adapters=4)
    batches = [b for b, _ in MEASURED_DECODE_OVERHEAD]
    decode = [o for _, o in MEASURED_DECODE_OVERHEAD]
    return LoraCost([rank], batches, [decode], [MEASURED_DECODE_OVERHEAD[-1][1]], adapters=4)


# --- the functions, their adapters and backbones ----------------------------------------------
@dataclass(frozen=True)
class LoraLayout:
    functions: list[str]  # the trace's functions (one adapter each), in name order
    size_of: dict[str, str]  # function or backbone -> "3b" | "7b" | "13b"
    backbone_of: dict[str, str]  # function -> its backbone's model name
    adapters: dict[str, AdapterSpec]  # function -> its adapter
    backbones: dict[str, ModelSpec]


def layout(cfg: SimConfig) -> LoraLayout:
    sizes = model_sizes(replace(cfg, lora_adapters=0, models=cfg.lora_backbones))
    backbones = {f"bb{j}-{size}": size for j, size in enumerate(sizes)}
    names = list(backbones)
    size_of: dict[str, str] = dict(backbones)
    backbone_of, adapters = {}, {}
    for i in range(cfg.lora_adapters):
        bb = names[i % len(names)]
        fn = f"m{i:03d}-{backbones[bb]}"
        size_of[fn] = backbones[bb]
        backbone_of[fn] = bb
        adapters[fn] = AdapterSpec(fn, shape_adapter_bytes(prof.SHAPES[backbones[bb]], cfg.lora_rank))
    return LoraLayout(sorted(backbone_of), size_of, backbone_of, adapters,
                      {bb: prof.model_spec(prof.SHAPES[s], bb) for bb, s in backbones.items()})


# --- SLINFER with backbone sharing ------------------------------------------------------------
class LoraSlinferSystem(SlinferSystem):
    """SLINFER whose models are backbones: each request runs through its function's adapter."""

    name = "slinfer"

    def use_layout(self, lay: LoraLayout, rank: int, preload_s: float = 0.0) -> None:
        """`preload_s`: re-plan pre-loading this often (0: none)."""
        self.layout = lay
        self.rank = rank  # every adapter's: its requests' iterations cost what the profile says
        self._function: dict[str, str] = {}  # request id -> its function (adapter)
        self.waited_for_adapter: set[str] = set()  # requests whose first token waited for one
        self.preloading = (Preloading(preloadables(lay), self.perf, self.config.watermark,
                                      preload_s) if preload_s else None)

    def bind(self, loop: EventLoop, rec: Recorder) -> None:
        super().bind(loop, rec)
        if self.preloading is not None:
            loop.schedule(self.preloading.interval_s, "preload")

    def on_arrival(self, req: SimRequest) -> None:
        self.reqs[req.rid] = req
        self._function[req.rid] = req.model
        backbone = self.models[self.layout.backbone_of[req.model]]
        if self.preloading is not None:
            self.preloading.note(backbone.name, req.model, req.arrival)
        view = RequestView(req.rid, backbone.name, req.input_len, req.arrival, req.slo,
                           max_tokens=max(1, backbone.max_context - req.input_len),
                           lora_rank=self.rank, adapter=req.model)
        self._place(view)

    def _adapter(self, view: RequestView) -> AdapterSpec | None:
        return self.layout.adapters[self._function[view.request_id]]

    # --- pre-loading (ServerlessLoRA §4.1, sim/preload.py) ----------------------------------
    def placer_views(self) -> list[NodeView]:
        """The nodes' views as the placer reads them for its pre-loading plan."""
        return self._views()

    def preload_turn(self, now: float) -> dict[str, NodePreload]:
        """The placer plans and sends; each node then carries out what it chose: adapter loads
        run as its memory ops, checkpoint reads end in its DRAM tier (`_on_preload_read`)."""
        plans = self.preloading.placer_turn(self.placer_views(), now)
        for sn in self.nodes.values():
            turn = self.preloading.node_turn(sn, now)
            self._start_ops(sn, turn.ops)
            self.rec.count("adapter_preloads", len(turn.attached))
            for name, nbytes, seconds in turn.reads:
                self.rec.count("checkpoint_preloads")
                self.loop.schedule(now + seconds, "preload_read", (sn.node_id, name, nbytes))
        return plans

    def _on_preload(self, _: None) -> None:
        self.preload_turn(self.loop.now)
        self.loop.schedule(self.loop.now + self.preloading.interval_s, "preload")

    def _on_preload_read(self, data: tuple[str, str, int]) -> None:
        node_id, name, nbytes = data
        self.nodes[node_id].storage.cache(name, nbytes)

    def _admitted(self, sn: SimNode, view: RequestView, cold: bool, result) -> bool:
        placed = super()._admitted(sn, view, cold, result)
        if result.admission.ok and result.instance_id is not None:
            key = adapter_key(result.instance_id, self._function[view.request_id])
            if sn.sched.ledger.busy(key) and self.reqs[view.request_id].first_token_at is None:
                self.waited_for_adapter.add(view.request_id)  # its adapter is (still) loading
        return placed

    def _op_seconds(self, sn: SimNode, op: MemOp) -> float:
        owner = adapter_owner(op.instance_id)
        if owner is not None and op.kind is MemOpKind.UNLOAD:
            inst = sn.sched.node.instance(owner[0])
            if inst is not None and inst.status is not InstanceStatus.UNLOADING:
                self.rec.count("adapter_offloads")  # §4.3: dropped to make room, not with its backbone
        if owner is None or op.kind is not MemOpKind.LOAD:
            return super()._op_seconds(sn, op)
        nbytes = op.bytes_after - op.bytes_before
        self.rec.count("adapter_loads")
        if sn.storage is None:
            return nbytes / prof.LOAD_BYTES_PER_S
        tier, seconds = sn.storage.load(owner[1], nbytes, self.loop.now)
        self.rec.count(f"adapter_loads:{tier}")
        return seconds


def preloadables(lay: LoraLayout) -> dict[str, Preloadable]:
    """The run's backbones and adapters, as the registry's records give them to pre-loading."""
    out = {name: Preloadable(name, spec.weight_bytes) for name, spec in lay.backbones.items()}
    out.update({fn: Preloadable(fn, a.bytes, lay.backbone_of[fn]) for fn, a in lay.adapters.items()})
    return out


def lora_perf(perf: PerfModel, cost: LoraCost) -> None:
    """Every backbone profile in `perf`, in place, with the unmerged LoRA cost."""
    for key, p in list(perf.profiles.items()):
        perf.profiles[key] = replace(p, lora=cost, source=p.source + " + unmerged LoRA (sim/lora.py)")


# --- memory accounting -----------------------------------------------------------------------
def slinfer_memory(system: SlinferSystem) -> tuple[int, int]:
    """(weight bytes resident incl. adapters, bytes the nodes' ledgers hold for instances)."""
    weights = held = 0
    for sn in system.nodes.values():
        held += sn.sched.ledger.budget
        for inst in sn.sched.node.instances:
            weights += inst.model.weight_bytes + sum(inst.adapters.values())
    return weights, held


def baseline_memory(system: BaselineSystem) -> tuple[int, int]:
    weights = held = 0
    for node in system.nodes:
        for inst in node.instances:
            weights += inst.dep.weight_bytes
            held += node.memory_bytes * inst.slots // 2
    return weights, held


class MemoryMetrics(Metrics):
    """`Metrics` that also integrates the memory a system holds, sampled when usage is."""

    def __init__(self, memory: Callable[[], tuple[int, int]]) -> None:
        super().__init__()
        self._memory = memory
        self._mem_t = 0.0
        self._mem_last = (0, 0)
        self.weight_byte_s = 0.0
        self.held_byte_s = 0.0
        self.weight_peak = 0
        self.held_peak = 0

    def observe(self, now: float, usage: Usage) -> None:
        if now > self._mem_t:  # the last sample held over (last sample, now]
            dt = now - self._mem_t
            self.weight_byte_s += self._mem_last[0] * dt
            self.held_byte_s += self._mem_last[1] * dt
            self._mem_t = now
        self._mem_last = self._memory()
        self.weight_peak = max(self.weight_peak, self._mem_last[0])
        self.held_peak = max(self.held_peak, self._mem_last[1])
        super().observe(now, usage)


# --- one LoRA run ----------------------------------------------------------------------------
def build_requests(cfg: SimConfig, lay: LoraLayout) -> list[SimRequest]:
    """The functions' arrivals, exactly as a run of that many models draws them."""
    lengths = LengthSampler.from_csv(cfg.lengths)
    ctx = {f: prof.SHAPES[lay.size_of[f]].max_context for f in lay.functions}
    arrivals = build_workload(lay.functions, ctx, cfg.duration, cfg.rps, cfg.seed, lengths,
                              cfg.arrivals, cfg.cv)
    return [SimRequest(f"r{i}", a.model, a.input_len, a.output_len, a.time, slo_for_input(a.input_len))
            for i, a in enumerate(arrivals)]


def build_system(cfg: SimConfig, lay: LoraLayout):
    book = prof.ProfileBook(prof.builtin_profiles())
    if cfg.profiles:
        book.override(prof.load_profiles(cfg.profiles))
    if cfg.lora_serving == "merged":
        specs = {f: prof.model_spec(prof.SHAPES[lay.size_of[f]], f) for f in lay.functions}
        system = build_plain(cfg, Cluster(specs, {f: lay.size_of[f] for f in lay.functions}, book))
        memory = (slinfer_memory if isinstance(system, SlinferSystem) else baseline_memory)
        return system, (lambda: memory(system))
    cluster = Cluster(dict(lay.backbones), {b: lay.size_of[b] for b in lay.backbones}, book)
    system = build_plain(cfg, cluster, slinfer_cls=LoraSlinferSystem)
    assert isinstance(system, LoraSlinferSystem)
    system.use_layout(lay, cfg.lora_rank, cfg.lora_preload_s)
    lora_perf(system.perf, lora_cost(cfg.lora_rank, cfg.lora_decode_overhead))
    return system, (lambda: slinfer_memory(system))


def lora_section(cfg: SimConfig, lay: LoraLayout, system: Any, result: RunResult,
                 m: MemoryMetrics) -> dict[str, Any]:
    from sim.report import percentile
    waited = getattr(system, "waited_for_adapter", set())
    cold = [r for r in result.requests if r.grace_s > 0 or r.rid in waited]
    cold_ttft = [r.ttft for r in cold if r.ttft is not None and r.finished_at is not None
                 and not r.dropped]
    served = [r.ttft for r in result.requests
              if r.ttft is not None and r.finished_at is not None and not r.dropped]
    span = max(result.end_time, 1e-9)
    gib = 2**30
    adapter_sizes = {lay.size_of[f]: a.bytes for f, a in lay.adapters.items()}
    out = {
        "serving": cfg.lora_serving,
        "functions": len(lay.functions),
        "backbones": len(lay.backbones),
        "rank": cfg.lora_rank,
        "adapter_bytes": dict(sorted(adapter_sizes.items())),
        "unmerged_cost": ("none (merged weights)" if cfg.lora_serving == "merged"
                          else cfg.lora_decode_overhead if cfg.lora_decode_overhead is not None
                          else "measured decode: " + ", ".join(
                              f"b{b} +{o:.1%}" for b, o in MEASURED_DECODE_OVERHEAD)
                          + f"; prefill +{MEASURED_DECODE_OVERHEAD[-1][1]:.1%} (assumed)"),
        # new instances (a backbone, or a whole merged model) and adapters loaded onto one
        "instance_loads": m.counters.get("cold_starts", 0),
        "adapter_loads": m.counters.get("adapter_loads", 0),
        "adapter_offloads": m.counters.get("adapter_offloads", 0),  # under memory pressure
        # pre-loading (§4.1): adapters attached before a request asked (their loads are in
        # adapter_loads too), and checkpoints read into a node's DRAM tier ahead of a cold start
        "adapter_preloads": m.counters.get("adapter_preloads", 0),
        "checkpoint_preloads": m.counters.get("checkpoint_preloads", 0),
        "adapter_loads_by_tier": {k.removeprefix("adapter_loads:"): v
                                  for k, v in sorted(m.counters.items())
                                  if k.startswith("adapter_loads:")},
        # requests whose first token waited for their function's weights: a backbone or merged
        # model loading (cold-start grace), or their adapter loading onto a resident backbone
        "requests_waiting_for_a_load": len(cold),
        "ttft_waiting_for_a_load_p50": percentile(cold_ttft, 50),
        "ttft_waiting_for_a_load_p99": percentile(cold_ttft, 99),
        "ttft_waiting_for_a_load_mean": (sum(cold_ttft) / len(cold_ttft)) if cold_ttft else None,
        "ttft_mean": (sum(served) / len(served)) if served else None,  # every served request
        "weights_gib_avg": m.weight_byte_s / span / gib,
        "weights_gib_peak": m.weight_peak / gib,
        "memory_held_gib_avg": m.held_byte_s / span / gib,
        "memory_held_gib_peak": m.held_peak / gib,
    }
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def simulate_lora(cfg: SimConfig, on_progress: Callable[[float], None] | None = None) -> SimOutcome:
    lay = layout(cfg)
    system, memory = build_system(cfg, lay)
    requests = build_requests(cfg, lay)
    metrics = MemoryMetrics(memory)
    result = run(system, requests, metrics, horizon=cfg.duration + DRAIN_S, on_progress=on_progress)
    report = build_report(result, metrics, params_of(cfg))
    report["lora"] = lora_section(cfg, lay, system, result, metrics)
    return SimOutcome(report, metrics, result)
