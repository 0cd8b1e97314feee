"""Hand-made profiles, models and nodes for core tests (no engine, no servers)."""

from __future__ import annotations

from dataclasses import replace

from shared.core.config import CoreConfig
from shared.core.context import DecisionContext
from shared.core.node_scheduler import NodeScheduler, new_node
from shared.core.perf_model import DecodeTable, PerfModel, PrefillTable, Profile
from shared.core.types import SLO, Hardware, ModelSpec, NodeView, RequestView, StorageView

GB = 1024**3


def flat_profile(model: str, hardware: Hardware, prefill_s: float = 0.1, decode_s: float = 0.02,
                 load_s: float = 1.0) -> Profile:
    """Constant-time iterations: makes hand-worked timelines exact."""
    return Profile(model, hardware,
                   PrefillTable([1, 8192], [prefill_s, prefill_s]),
                   DecodeTable([1, 256], [1, 8192], [[decode_s, decode_s], [decode_s, decode_s]]),
                   load_s=load_s)


def linear_profile(model: str, hardware: Hardware, per_token_prefill: float = 1e-4,
                   decode_base: float = 0.02, decode_per_req: float = 0.002, load_s: float = 1.0) -> Profile:
    lengths = [2**k for k in range(4, 14)]
    batches = [2**i for i in range(0, 9)]
    return Profile(model, hardware,
                   PrefillTable(lengths, [per_token_prefill * n for n in lengths]),
                   DecodeTable(batches, lengths,
                               [[decode_base + decode_per_req * b + 1e-6 * n for n in lengths] for b in batches]),
                   load_s=load_s)


def model(name: str = "m", weight_gb: float = 1.0, kv_per_token: int = 1024, max_context: int = 1024,
          avg_out: float = 64.0) -> ModelSpec:
    return ModelSpec(name, int(weight_gb * GB), kv_per_token, max_context, avg_out)


def request(rid: str, model_name: str = "m", input_len: int = 100, arrival: float = 0.0,
            ttft: float = 1.0, tpot: float = 0.25, generated: int = 0, max_tokens: int = 128) -> RequestView:
    return RequestView(rid, model_name, input_len, arrival, SLO(ttft, tpot), generated=generated,
                       max_tokens=max_tokens, prefilled=generated > 0)


def perf_for(*profiles: Profile) -> PerfModel:
    perf = PerfModel()
    for p in profiles:
        perf.add(p)
    return perf


def context(nodes: list[NodeView], config: CoreConfig | None = None,
            perf: PerfModel | None = None, now: float = 0.0) -> DecisionContext:
    """A decision context over `nodes` (no profiles unless given: a startup choice needs none)."""
    return DecisionContext(nodes, perf if perf is not None else PerfModel(), now,
                           config if config is not None else CoreConfig())


def node(node_id: str = "n0", hardware: Hardware = Hardware.GPU, memory_gb: float = 80.0,
         perf: PerfModel | None = None, config: CoreConfig | None = None,
         matrix_accel: bool = True) -> NodeScheduler:
    return new_node(node_id, hardware, int(memory_gb * GB), perf or PerfModel(), config, matrix_accel)


def loaded(sched: NodeScheduler, iid: str | None, req: RequestView, spec: ModelSpec, now: float = 0.0) -> str:
    """Admit and complete every memory op at once (an instance ready to run)."""
    res = sched.admit(req, iid, spec, now)
    assert res.admission.ok, res.admission
    pending = list(res.start_ops)
    while pending:
        pending.extend(sched.memop_done(pending.pop(0), now))
    return res.instance_id


# -- a model that can run split (execute-while-load) and GPU nodes with checkpoint tiers -------

TIERS = {"dram": 20 * GB, "disk": 2 * GB, "registry": 0.5 * GB}
# 8 GB, 32 layers, a 1 GB head: 16 blocks of 0.5 GB in a multicast of 16.
SPLIT_SPEC = replace(model("m", weight_gb=8), layers=32, token_bytes=8192, head_bytes=1 * GB)
SPLIT_PROFILE = replace(flat_profile("m", Hardware.GPU, prefill_s=0.1, decode_s=0.02,
                                     load_s=30.0), engine_init_s=0.5)


def tiered_gpu(node_id: str, link_bytes_per_s: float, holds: dict[str, str] | None = None,
               memory_gb: float = 80, arriving: dict[str, float] | None = None) -> NodeView:
    """A GPU node's view (SPLIT_PROFILE's perf) with TIERS and a multicast link."""
    view = node(node_id, Hardware.GPU, memory_gb, perf_for(SPLIT_PROFILE)).view()
    view.storage = StorageView(TIERS, holds or {}, multicast_bytes_per_s=link_bytes_per_s,
                               arriving=arriving or {})
    return view

