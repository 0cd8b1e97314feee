"""Wire messages between services. Each is a dataclass encoded with `shared.wire` (msgpack).

Subjects and streams they travel on are in `shared.subjects`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.core.memory import MemOpKind
from shared.core.types import NodeView, PipelineMode


@dataclass(frozen=True)
class ModelRecord:
    """A registered model (admin API) as stored in Redis."""

    name: str
    path: str  # Hugging Face directory on the nodes' filesystem
    engine: str = "torch"  # torch | openvino | vllm
    slo_class: str = "standard"
    owner: str | None = None  # tenant that owns a private model; None = public
    base_model: str | None = None  # set for a LoRA adapter
    max_context: int = 2048
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    created_at: float = 0.0
    lora_rank: int = 0  # a LoRA adapter's rank (adapter_config.json's r; 0: not known)
    # Module-level scaling (CoCoServe): decoder layers, the bytes that are not a decoder
    # layer's (embeddings, final norm, head), one token's hidden state; 0: not known (its
    # layers are never moved or replicated).
    layers: int = 0
    head_bytes: int = 0
    token_bytes: int = 0
    # What POST /v1/embeddings answers for this model: its last hidden states pooled over the
    # input ("mean", "last": the last token's, "cls": the first token's), L2-normalised or not;
    # `matryoshka`: a prefix of the vector is an embedding too, so a request may ask `dimensions`.
    pooling: str = "mean"
    normalize: bool = True
    matryoshka: bool = False
    # Keep-alive (`shared.core.keepalive`): how long an idle instance stays loaded (seconds;
    # None: the cluster's SLINFER_KEEP_ALIVE_S; negative: never unloaded), and how many warm
    # instances the cluster keeps of it (> 0: pinned, its instances are never reclaimed idle).
    keep_alive_s: float | None = None
    min_instances: int = 0


POOLINGS = ("mean", "last", "cls")


@dataclass(frozen=True)
class Embedding:
    """An embedding request: a prefill with no decode whose answer is the prompt's last hidden
    states pooled (`ModelRecord.pooling`), L2-normalised where `normalize`."""

    pooling: str = "mean"
    normalize: bool = True


@dataclass(frozen=True)
class TokenBias:
    """One entry of OpenAI's `logit_bias`: added to that token's logit before sampling."""

    token: int
    bias: float


@dataclass(frozen=True)
class OutputGrammar:
    """A constraint on a request's output, enforced token by token (constrained decoding): at
    each step the engine masks every token the grammar does not allow next (shared/grammar.py)."""

    kind: str  # "json_schema": `text` is a JSON Schema; "lark": an llguidance Lark grammar
    text: str
    # The request parameter that asked for it (response_format, tool_choice): an engine that
    # cannot mask logits refuses the request by that name.
    param: str = "response_format"


@dataclass(frozen=True)
class InferenceRequest:
    """One generation request: gateway -> request stream -> placer -> node."""

    request_id: str
    tenant: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float  # unix seconds at the gateway; ST of the headroom formula
    ttft_slo_s: float
    tpot_slo_s: float
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # The tokens that end this request: the model's EOS ids, none when the client asked ignore_eos.
    eos_token_ids: list[int] = field(default_factory=list)
    top_k: int = 0  # 0 = no limit
    repetition_penalty: float = 1.0  # 1 = off
    min_tokens: int = 0  # output tokens before an EOS may be produced (counting resumed ones)
    ignore_eos: bool = False  # the client's ignore_eos (the gateway then sends no eos_token_ids)
    # Tokens already generated before a migration (evict/resume); the node re-prefills
    # prompt + resumed tokens and continues the sequence numbering after them.
    resumed_token_ids: list[int] = field(default_factory=list)
    trace_context: dict[str, str] = field(default_factory=dict)
    # TTFT grace a cold start gave it (§IX-A); a moved request keeps it, so every node and
    # placer judges it as the one that admitted it did.
    grace_s: float = 0.0
    # A request displaced by a preemption: the node and instance the plan validated for it. The
    # placer offers it there first, and places it afresh only if that node refuses.
    target_node: str | None = None
    target_instance: str | None = None
    # `attempt` counts the gateway's resumes of this request after a
    # node it ran on was lost: every token message carries the attempt it belongs to, and the
    # gateway reads only its current one (a stale attempt that still runs cannot interleave).
    attempt: int = 0
    # Unix seconds after which nobody waits for the output any more (the gateway's timeout);
    # 0 = none. Placers do not place, and nodes stop, a request past its deadline.
    deadline: float = 0.0
    # A LoRA adapter's registry id: the request runs through that adapter on an instance of its
    # backbone, which `model` then names (the gateway resolves an adapter's name to both).
    adapter: str | None = None
    # That adapter's rank: its iterations cost what the backbone's profile measured for it.
    adapter_rank: int = 0
    # OpenAI's logprobs: None = none; k = each output token's log-probability and the k most
    # likely alternatives' (`TokenMessage.logprobs`).
    logprobs: int | None = None
    # OpenAI's penalties on the output so far (0 = off), logit_bias, and vLLM's min_p (0 = off).
    # Only some engines honour them (shared/engine_features.py); the gateway refuses the rest.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[TokenBias] = field(default_factory=list)
    min_p: float = 0.0
    # response_format json_object/json_schema, or a required or named tool_choice: the output
    # must match this grammar (only engines that mask logits honour it).
    grammar: OutputGrammar | None = None
    # The completions API's echo with logprobs: None = none; k = each prompt token's
    # log-probability after the first (given the tokens before it) and the k most likely
    # alternatives' (`TokenMessage.prompt_logprobs`; only engines with the "echo" feature).
    prompt_logprobs: int | None = None
    # Not a generation: the prompt's embedding (max_tokens is 0). The node runs its prefill,
    # answers the vector in the final message (`TokenMessage.embedding`) and frees its K/V.
    embedding: Embedding | None = None
    # Ollama's keep_alive: how long its instance stays loaded once idle after it (seconds;
    # negative: never; None: the model's registered keep-alive). The last request's wins.
    keep_alive_s: float | None = None
    # The warm fast path (services/gateway/direct.py): the node the gateway sent this request to
    # directly, which did not answer. It may be running it, so the placer asks it first.
    asked_node: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token or a stop sequence
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # client went away
    ERROR = "error"  # the system failed the request (see `error`)
    DROPPED = "dropped"  # queueing alone would have broken the TTFT SLO


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the model, and its most likely alternatives
    (ids and log-probabilities, likeliest first; as many as the request's `logprobs`)."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TokenMessage:
    """Node -> gateway on `token_subject(request_id)`.

    `seq` is the index in the output of `token_ids[0]`; a gateway that sees a gap waits for the
    final message, which carries the whole output in `output_token_ids`.
    """

    request_id: str
    seq: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)  # final message only
    prompt_tokens: int = 0
    error: str | None = None
    node_id: str | None = None
    # On the message carrying a request's first token from a node: how long the engine's
    # prefill iteration took there (for overhead accounting and traces).
    prefill_s: float | None = None
    attempt: int = 0  # the request's attempt this message belongs to (InferenceRequest.attempt)
    # A request that asked for logprobs: one entry per `token_ids` entry. The final message's
    # `output_token_ids` carry none (a whole output's alternatives can outgrow a NATS message),
    # so a gateway that lost a token message loses those tokens' logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # A request that asked for prompt logprobs, on the message of its first output token (the
    # final one too if that token ends it): one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # An embedding request's final message: the vector, float32 little-endian (OpenAI's base64
    # encoding_format is these bytes), pooled and normalised as the request asked.
    embedding: bytes = b""


class CommandKind(str, enum.Enum):
    ADMIT = "admit"  # add a request to an instance (creating it first if needed)
    # Re-check the admission without the victims; only if it holds, unload them, admit the
    # request, and hand the victims' requests to the request stream, each with its destination.
    PREEMPT_ADMIT = "preempt_admit"
    # What the node knows of `request_id`: the reply's `reason` is a RequestState value; a
    # finished request's final message is in `final` (the gateway may have missed it).
    STATUS = "status"
    # Live migration (token-based, multi-round; shared/core/migration.py). To the source:
    # move `migrations[*].request_id` live to that node/instance (it keeps the request if that fails).
    MIGRATE = "migrate"
    # Source -> destination: `request` carries the tokens so far (resumed_token_ids); the
    # destination admits it (loading the model if needed) and computes their KV, without streaming.
    MIGRATE_BEGIN = "migrate_begin"
    # Source -> destination: `tokens` (output index `seq` onwards) the source produced since.
    MIGRATE_EXTEND = "migrate_extend"
    # Source -> destination: the source has stopped the request; `tokens` is the last delta. The
    # destination takes the request over and streams from output index seq + len(tokens).
    MIGRATE_COMMIT = "migrate_commit"
    MIGRATE_ABORT = "migrate_abort"  # source -> destination: forget it, the source keeps it
    # Operator -> node: migrate every request off and take no new work (the view says draining).
    DRAIN = "drain"
    # CoCoServe module scaling (services/node/layer_moves.py). To a host: serve decoder layers
    # [layer_start, layer_end) of `model` for instance `instance_id` of node `stage_node`,
    # holding `stage_bytes` in its memory ledger first; the reply's stage_address is the stage.
    HOST_LAYERS = "host_layers"
    RELEASE_LAYERS = "release_layers"  # to a host: stop serving them and free their bytes
    # To the owner, between two iterations: move those layers (with their K/V) to the stage at
    # `stage_address` on `stage_node` / replicate them there / take them back / stop using the
    # replica at `stage_address`. A failure leaves the instance as it was.
    SHED_LAYERS = "shed_layers"
    REPLICATE_LAYERS = "replicate_layers"
    TAKE_LAYERS = "take_layers"
    DROP_REPLICA = "drop_replica"
    # Burst scale-out (λScale §3, shared/core/burst.py): start a new instance of `model` with no
    # request yet (`NodeScheduler.start_instance`), checked and sized as one for `request` (a
    # stand-in: it stays where it was placed); `multicast_s`/`pipeline` as for ADMIT. Later
    # ADMITs join it by its id (the reply's instance_id).
    START_INSTANCE = "start_instance"
    # Operator -> node (the admin's unload-now): unload every instance of `model` here, the
    # idle ones at once, the busy ones once their requests end (`NodeScheduler.unload_model`).
    UNLOAD_MODEL = "unload_model"


class RequestState(str, enum.Enum):
    """A node's answer to STATUS."""

    RUNNING = "running"  # admitted here and not finished (it may be waiting for its instance)
    FINISHED = "finished"  # ended here recently: `NodeReply.final` is its final message
    MOVED = "moved"  # handed back to the request stream (preempted or evicted) from here
    UNKNOWN = "unknown"  # never here, or so long ago the node forgot it


@dataclass(frozen=True)
class MigrationTarget:
    """Where the preemption plan validated one displaced request."""

    request_id: str
    node_id: str
    instance_id: str


@dataclass(frozen=True)
class NodeCommand:
    """Placer -> node, request-reply on `node_command_subject(node_id)`."""

    kind: CommandKind
    request: InferenceRequest | None = None  # ADMIT
    instance_id: str | None = None  # ADMIT: target; a new id means "create this instance"
    model: ModelRecord | None = None  # ADMIT into a new instance: what to load
    preempt_instance_ids: list[str] = field(default_factory=list)  # PREEMPT_ADMIT: the victims
    migrations: list[MigrationTarget] = field(default_factory=list)  # PREEMPT_ADMIT
    request_id: str | None = None  # STATUS
    attempt: int = 0  # STATUS: the attempt the asker reads
    tokens: list[int] = field(default_factory=list)  # MIGRATE_EXTEND / MIGRATE_COMMIT: the delta
    seq: int = 0  # MIGRATE_EXTEND / MIGRATE_COMMIT: output index of tokens[0]
    # ADMIT into a new instance (λScale §5): the placer multicasts the model to this node, into
    # its DRAM tier, in about this many seconds; the load waits for it (None: load from the tiers).
    multicast_s: float | None = None
    # ... and the instance serves through this execution pipeline meanwhile (λScale §4.3: its
    # helpers run the layers it has not received yet; `until`: seconds until it can serve).
    pipeline: PipelineMode | None = None
    # PREEMPT_ADMIT by live migration: the plan's handover estimate (seconds). The victims keep
    # running while their requests move live to `migrations`; None: stop-and-resume.
    handover_s: float | None = None
    # Layer commands (HOST_LAYERS ... DROP_REPLICA): the range, the stage, the other node (the
    # owner for HOST_LAYERS, the host otherwise), the bytes the host holds, and the link the
    # placer planned the hops with (the instance's layout carries it into shadow validation).
    layer_start: int = 0
    layer_end: int = 0
    stage_address: str | None = None
    stage_node: str | None = None
    stage_bytes: int = 0
    hop_latency_s: float = 0.0
    hop_bytes_per_s: float = 0.0
    # HOST_LAYERS of moved layers: the share of the host's compute the stage takes (the core's
    # `modules.stage_load`), which the host reports in its view (`NodeView.stage_load`).
    stage_load: float = 0.0
    # ADMIT sent by a gateway on the warm fast path, not by a placer: once admitted, the node
    # tells the placers (`DirectAdmission`), whose arrival histories count it.
    direct: bool = False


@dataclass(frozen=True)
class DirectAdmission:
    """Node -> placers: a request the gateway sent straight to this node was admitted (the warm
    fast path). `request` comes without its prompt: the placers note its arrival and where it
    runs, as if they had placed it."""

    request: InferenceRequest
    node_id: str
    instance_id: str


@dataclass(frozen=True)
class NodeReply:
    accepted: bool
    reason: str  # the core's AdmitReason value ("admitted", "no_headroom", ...)
    instance_id: str | None = None
    # PREEMPT_ADMIT: requests the node stopped (each with its tokens so far and its destination),
    # already published to the request stream.
    evicted: list[InferenceRequest] = field(default_factory=list)
    # PREEMPT_ADMIT by live migration: the requests now migrating live to their destinations.
    migrating: list[str] = field(default_factory=list)
    node: NodeView | None = None  # the node's fresh view, so the placer's next try is current
    final: TokenMessage | None = None  # STATUS of a finished request: its final message
    generated: int = 0  # STATUS of a running request: output tokens so far (resumed included)
    stage_address: str | None = None  # HOST_LAYERS: the stage's host:port
    stage_bytes: int = 0  # HOST_LAYERS: what the host holds for it


@dataclass(frozen=True)
class MemOpCompletion:
    """Node -> reservation-station stream when a memory operation finishes."""

    node_id: str
    op_id: int
    instance_id: str
    kind: MemOpKind
    bytes_before: int
    bytes_after: int
    started: float
    finished: float
    parked_s: float = 0.0  # time the op waited in the reservation station
    ok: bool = True
    error: str | None = None


@dataclass(frozen=True)
class CancelNotice:
    request_id: str
    reason: str = "client disconnected"
    # None: every attempt of the request. N: only attempts below N (the gateway resumed the
    # request as attempt N; an older attempt that still runs somewhere is an orphan).
    below_attempt: int | None = None


@dataclass(frozen=True)
class PreloadPlan:
    """The placer's pre-loading decision for one node (ServerlessLoRA §4.1, the Pre-Loading
    Scheduler's command to the node's agent; `shared.core.lora.plan_cluster_preload`)."""

    node_id: str
    at: float  # when the placer planned it (its clock)
    valid_s: float  # the node follows it this long after receiving it, then its own rates
    checkpoints: list[str] = field(default_factory=list)  # backbones for the DRAM tier, least valuable first
    adapters: list[list[str]] = field(default_factory=list)  # [instance id, adapter id] to attach
