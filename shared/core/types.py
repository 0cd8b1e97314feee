"""Plain data the policy core reasons about. Also the cluster view's wire format: node workers
publish `NodeView` snapshots to Redis (and in command replies) with their times relative to the
snapshot, and every reader rebases them onto its own clock (`shared.core.snapshot`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.core.busy import BusyMeter


class Hardware(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # time to first token allowed, from arrival (ST) to the first token
    tpot_s: float  # time per output token allowed after the first


def slo_for_input(input_len: int, tpot_s: float = 0.25) -> SLO:
    """SLINFER §IX-A (after DistServe): TTFT = min(max(0.5, L/512), 8) s, TPOT = 0.25 s."""
    return SLO(ttft_s=min(max(0.5, input_len / 512.0), 8.0), tpot_s=tpot_s)


# SLO classes a model is registered with. "standard" is the paper's setting; the others scale
# it for chat-like (tighter) and batch-like (looser) tenants.
SLO_CLASSES: dict[str, tuple[float, float]] = {
    # class: (TTFT multiplier, TPOT seconds)
    "interactive": (0.5, 0.1),
    "standard": (1.0, 0.25),
    "relaxed": (2.0, 0.5),
    # Best effort: offline work (evaluations, batch jobs) that needs answers, not latency. A
    # deadline still exists, so an overloaded cluster drops rather than queues without end.
    "batch": (20.0, 2.0),
}


def slo_for_class(slo_class: str, input_len: int) -> SLO:
    if slo_class not in SLO_CLASSES:
        raise ValueError(f"unknown SLO class {slo_class!r}; one of {sorted(SLO_CLASSES)}")
    ttft_mult, tpot = SLO_CLASSES[slo_class]
    base = slo_for_input(input_len)
    return SLO(ttft_s=base.ttft_s * ttft_mult, tpot_s=tpot)


@dataclass(frozen=True)
class ModelSpec:
    """What the core needs to know about a model to place it and size its memory."""

    name: str
    weight_bytes: int  # resident parameter bytes of one instance
    kv_bytes_per_token: int  # C in SLINFER eq. 2 (all layers, K and V)
    max_context: int  # longest sequence; also L_min, the floor of eq. 2 (§VII-A)
    avg_output_len: float = 128.0  # Ō of eq. 2, from historical logs
    # A paged engine gives each request whole blocks of this many tokens; counting KV in the
    # same blocks keeps the core's accounting equal to what the engine really allocates.
    kv_block_tokens: int = 1
    # Loaded through the node's checkpoint tiers (the torch engine's loader): its cold start is
    # q + n/b from the fastest tier holding it. False (OpenVINO, vLLM read their own files): the
    # load time its profile measured.
    tiered: bool = True
    # Its engine can take a running request's tokens so far (extend) and continue exactly: live
    # migration moves its requests. False (OpenVINO, vLLM): a preemption moves them
    # stop-and-resume (shared/core/migration.py says why).
    live_migration: bool = True
    # Its engine runs a prefill in chunks against the K/V earlier chunks wrote (the node's
    # engines declare it: `ChunksPrefill`): with `CoreConfig.prefill_chunk_tokens` on, its
    # prefills are chunked. False (OpenVINO, vLLM): whole prefills, setting or not.
    chunked_prefill: bool = True
    # Module-level scaling (CoCoServe, shared/core/modules.py): decoder layers, the bytes of
    # what is not a decoder layer (embeddings, final norm, head) and one token's hidden state
    # (an activation hop); 0 layers: its layers cannot be moved or replicated.
    layers: int = 0
    head_bytes: int = 0
    token_bytes: int = 0
    # Its registered keep-alive (None: the core's default; negative: never unload) and minimum
    # of warm instances (> 0: pinned, its instances are never reclaimed; `shared.core.keepalive`).
    keep_alive_s: float | None = None
    min_instances: int = 0


def first_token_due(arrival: float, grace_s: float, ttft_s: float) -> float:
    """Eq. 1's base, the deadline of the first token: ST + grace + TTFT_SLO."""
    return arrival + grace_s + ttft_s


def resume_grace(arrival: float, tpot_s: float, generated: int, now: float) -> float:
    """The grace that makes the next token of a request that has produced `generated` tokens
    due one TTFT_SLO after `now` (Eq. 1 solved for the grace): a request resumed after its node
    was lost is judged like a new arrival for its next token."""
    return now - arrival - tpot_s * generated


def token_deadline(base: float, tpot_s: float, generated: int) -> float:
    """Eq. 1 (SLINFER §VI-A), the one definition every caller uses: the next token of a request
    that has produced `generated` tokens is due at ST + grace + TTFT_SLO + TPOT_SLO * O, where
    `base` = ST + grace + TTFT_SLO. Headroom is this minus the current time."""
    return base + tpot_s * generated


@dataclass
class RequestView:
    """One request as the scheduler sees it (SLINFER §VI-A)."""

    request_id: str
    model: str
    input_len: int  # I_r: prompt tokens only; tokens produced before a migration are in `generated`
    arrival: float  # ST: when the request entered the system
    slo: SLO
    generated: int = 0  # O_r: output tokens produced so far, including before a migration
    max_tokens: int = 256  # hard cap on output tokens (total, including `generated`)
    grace_s: float = 0.0  # extra TTFT allowed for a cold start (§IX-A)
    # False until this instance has run the request's prefill. A migrated request arrives with
    # generated > 0 and prefilled False: it keeps its headroom but must recompute its KV cache.
    prefilled: bool = False
    # The rank of the LoRA adapter it runs through (0: the plain backbone). Its iterations cost
    # what the profile measured for that rank (`Profile.lora_decode_factor`).
    lora_rank: int = 0
    # The adapter's name (None: none, or not known to the caller): a batch's LoRA cost grows
    # with the distinct adapters it holds, and offloading spares the adapters requests run through.
    adapter: str | None = None
    # The request's own keep-alive (Ollama's `keep_alive`, seconds; negative: never; None: its
    # model's): its instance's idle window from its admission on (`shared.core.keepalive`).
    keep_alive_s: float | None = None

    def deadline_base(self) -> float:
        """The deadline of the first token: ST + grace + TTFT_SLO."""
        return first_token_due(self.arrival, self.grace_s, self.slo.ttft_s)

    def deadline(self) -> float:
        """When the next token is due (Eq. 1 without CT)."""
        return token_deadline(self.deadline_base(), self.slo.tpot_s, self.generated)

    def headroom(self, now: float) -> float:
        """Eq. 1: ST + TTFT_SLO + TPOT_SLO * O - CT (plus a cold start's grace)."""
        return self.deadline() - now

    def context_len(self) -> int:
        """Tokens in the KV cache once prefilled; also what a (re-)prefill computes."""
        return self.input_len + self.generated


class InstanceStatus(str, enum.Enum):
    LOADING = "loading"  # weights being loaded; can hold requests, cannot run iterations
    READY = "ready"
    UNLOADING = "unloading"  # preempted or reclaimed; accepts nothing
    # Preempted by live migration: its requests run on here while they move to their destinations
    # (ServerlessLLM §5); it accepts nothing and unloads once they are gone (`leaves_at`, estimated).
    HANDOVER = "handover"


@dataclass(frozen=True)
class LayerRun:
    """Decoder layers [start, end) of an instance that run on another node (CoCoServe): moved
    there (the instance's node runs them no more), or a replica of layers it also runs."""

    start: int
    end: int
    node_id: str
    address: str = ""  # the stage's host:port on that node
    replica: bool = False
    # The K/V pool its host reserved for these layers (their share of the instance's pool when
    # the plan was made, `cost.stage_share_bytes`); 0: not known (the instance then keeps the
    # pool it had when its layout was set: `cost.kv_ceiling`).
    kv_bytes: int = 0


@dataclass(frozen=True)
class InstanceLayout:
    """Where a split or replicated instance's layers run. Its `InstanceView.model` is then its
    node's share (`modules.share_spec`); `model` here is the whole instance's spec. An iteration
    pays activation hops to the other nodes over a link of `hop_latency_s` per transfer plus
    `hop_bytes_per_s` (`modules.layout_profile`)."""

    model: ModelSpec
    runs: tuple[LayerRun, ...] = ()
    hop_latency_s: float = 0.0
    hop_bytes_per_s: float = 1e9

    def local_layers(self) -> int:
        return self.model.layers - sum(r.end - r.start for r in self.runs if not r.replica)


@dataclass(frozen=True)
class HostedRange:
    """Layers [start, end) of a pipelined instance, run on `helper`."""

    helper: str
    start: int
    end: int


@dataclass(frozen=True)
class PipelineMode:
    """An instance serving through an execution pipeline while its weights arrive by multicast
    (λScale §4.3): its node runs the head and the layers it holds, `helpers` run the others.
    Every iteration pays `hops` transfers of its tokens' activations (`shared.core.modules.
    pipeline_profile`) until the node holds the whole model and switches to local execution."""

    hops: int
    hop_latency_s: float  # per transfer (framing, a round trip)
    hop_bytes_per_s: float  # the link the activations cross
    token_bytes: int  # one token's activations (ModelSpec.token_bytes)
    # InstanceView: when the switch to local execution is expected (node clock); StorageView's
    # `pipelines` (a startup not begun): seconds from the snapshot until the pipeline serves.
    until: float
    helpers: tuple[str, ...] = ()  # the nodes hosting the layers this node lacks
    stages: tuple[str, ...] = ()  # once it serves: its stages' addresses (host:port) on them
    # Receivers hosting for each other (λScale Algorithm 2, `shared.core.pipeline.receiver_plan`):
    # every range a helper runs, in layer order; () for a DRAM holder's stage, which runs every
    # layer the head lacks.
    ranges: tuple[HostedRange, ...] = ()


@dataclass
class InstanceView:
    instance_id: str
    model: ModelSpec
    node_id: str
    status: InstanceStatus = InstanceStatus.READY
    kv_bytes: int = 0  # M_cur: KV-cache bytes allocated (or being scaled to)
    # The earliest time the instance can run an iteration: the end (estimated) of its load, or of
    # a KV resize that is running or parked in the reservation station (nothing runs meanwhile).
    ready_at: float = 0.0
    last_active: float = 0.0  # last time it held a request (for keep-alive)
    requests: list[RequestView] = field(default_factory=list)
    # LoRA adapters attached to this backbone instance (loaded or loading), name -> bytes. Each
    # is held in the node's memory ledger on its own (`adapter_key`), beside the instance.
    adapters: dict[str, int] = field(default_factory=dict)
    # HANDOVER only: when its requests should all have moved (the plan's estimate). Its memory is
    # held (pessimistic tracking) until it is really unloaded, its compute is used until then.
    leaves_at: float = 0.0
    # Layers run on other nodes (CoCoServe's module scaling); None: all of them here.
    layout: InstanceLayout | None = None
    # Serving through an execution pipeline while its weights arrive (None: runs alone). Its
    # node's ledger holds the whole instance (weights + KV: what it holds after the switch);
    # each helper holds its stage (`shared.core.modules.stage_key`).
    pipeline: PipelineMode | None = None
    # The share of recent wall time its iterations ran, measured by its node (None: none yet);
    # module scaling predicts a stage of its layers' load from it.
    busy: BusyMeter | None = None
    # Keep-alive (`shared.core.keepalive`): its idle window in seconds, set by the last request
    # admitted (else its model's registered one; None: the core's default; negative: never),
    # and whether its model is pinned (min_instances > 0: never reclaimed as idle).
    keep_alive_s: float | None = None
    pinned: bool = False
    # Chunked prefill (`CoreConfig.prefill_chunk_tokens`): request id -> tokens of its context
    # whose K/V earlier chunks wrote into this instance's cache, for requests not prefilled yet.
    # On the instance, not the request: the K/V is this instance's, and a request that moves
    # starts its prefill again wherever it lands.
    prefill_progress: dict[str, int] = field(default_factory=dict)

    @property
    def accepts(self) -> bool:
        """May a request join it (neither unloading nor handing its requests over)?"""
        return self.status is not InstanceStatus.UNLOADING and self.status is not InstanceStatus.HANDOVER

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter a request runs through, on an instance of its backbone (ServerlessLoRA)."""

    name: str  # the adapter's model name (registry id)
    bytes: int  # its A/B matrices: all it adds to a node that holds its backbone


ADAPTER_SEPARATOR = "/lora/"


def adapter_key(instance_id: str, adapter: str) -> str:
    """The memory ledger's (and memory ops') name for `adapter` attached to an instance."""
    return f"{instance_id}{ADAPTER_SEPARATOR}{adapter}"


def adapter_owner(key: str) -> tuple[str, str] | None:
    """(instance id, adapter) of an `adapter_key`; None for an instance's own key."""
    iid, sep, adapter = key.partition(ADAPTER_SEPARATOR)
    return (iid, adapter) if sep else None


@dataclass(frozen=True)
class RunningIteration:
    """The iteration a node is executing now; it ends at `NodeView.busy_until`."""

    instance_id: str
    request_ids: tuple[str, ...]  # the requests that get a token when it ends
    prefill: bool  # a prefill (one request, which is then prefilled) or a decode step
    # A chunk of a prefill that is not its last (`request_ids` then empty: nobody gets a token):
    # its request ("": none such) and the tokens of its context in the cache once it ends.
    chunk_of: str = ""
    chunk_to: int = 0


# Checkpoint tiers of a node, fastest first (ServerlessLLM §4.2).
TIERS = ("dram", "disk", "registry")


@dataclass(frozen=True)
class StorageView:
    """A node's checkpoint tiers as its loader reports them (ServerlessLLM §4, §6): which model
    each tier holds, the bandwidth each tier measured, and the loads ahead of a new one."""

    bytes_per_s: dict[str, float]  # tier -> read bandwidth measured on real loads
    holds: dict[str, str] = field(default_factory=dict)  # model -> the fastest tier holding it
    pending_s: float = 0.0  # q of §6: seconds of loads queued or running on the node's I/O
    # λScale multicast (shared/core/startup.py): model -> seconds until a multicast under way
    # puts it in this node's DRAM tier (relative to the snapshot, like pending_s).
    arriving: dict[str, float] = field(default_factory=dict)
    # The node's multicast link (bytes/s per connection, measured on received blocks, else
    # declared); 0: the node runs no multicast endpoint (it neither sends nor receives).
    multicast_bytes_per_s: float = 0.0
    # λScale execute-while-load: model -> a new instance here serves through this pipeline
    # while the model arrives (`until`: seconds until the pipeline serves); the startup the
    # placer chose (`shared.core.startup.with_pipeline`), on its view and on the node's re-check.
    pipelines: dict[str, PipelineMode] = field(default_factory=dict)
    # The DRAM tier's capacity (0: the node has none): what the cluster's pre-loading plan
    # (`shared.core.lora.plan_cluster_preload`) may fill with checkpoints.
    dram_bytes: int = 0


@dataclass
class NodeView:
    node_id: str
    hardware: Hardware
    memory_bytes: int  # capacity the memory subsystem may hand out (weights + KV)
    matrix_accel: bool = False  # CPU has AMX (or similar); GPUs: True
    instances: list[InstanceView] = field(default_factory=list)
    hardware_name: str = ""  # CPU model or GPU name (NVML), as the node detected it
    cores: int = 0  # CPU cores (0 for a GPU node)
    accel_flags: list[str] = field(default_factory=list)  # e.g. amx_tile, amx_bf16 from cpuid
    busy_until: float = 0.0  # predicted end of the iteration running now (shadow starts there)
    running: RunningIteration | None = None  # that iteration: its tokens are credited at its end
    # When every memory op running or parked now should have ended (estimated): a load that the
    # reservation station would park cannot start before this.
    memops_until: float = 0.0
    # When an op the reservation station parked now could start: the running ops and held
    # unloads have ended (ops of different instances then run side by side).
    parked_start: float = 0.0
    storage: StorageView | None = None  # None: cold starts take the profile's measured load_s
    budget_bytes: int = 0  # optimistic budget in use (§VII-C)
    pessimistic_bytes: int = 0  # pessimistic usage (§VII-C)
    heartbeat: float = 0.0  # when the snapshot was taken (a rebased view: on the reader's clock)
    draining: bool = False  # an operator drains it: placers send it no new work
    # The share of its compute that decoder layers it hosts for other nodes' instances take
    # (CoCoServe): each stage's measured busy fraction once measured for a window, the planner's
    # prediction before (`NodeScheduler.hold`, `stage_measured`). Its own iterations are
    # validated as 1 / (1 - load) longer (`evaluate.contended`). 0: it hosts none.
    stage_load: float = 0.0
    # Tokens its requests got after their Eq. 1 deadline, a running count since it started
    # (`NodeScheduler.finish_iteration`): the module planner's overloaded hosts are those whose
    # count rose (the simulator sees the same late tokens itself).
    late_tokens: int = 0

    def instance(self, instance_id: str) -> InstanceView | None:
        return next((i for i in self.instances if i.instance_id == instance_id), None)
