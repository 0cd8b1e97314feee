"""The metric names that dashboards and load tools already scrape from vLLM, exported beside
slinfer's own, so a Grafana board or an autoscaler written for vLLM reads a slinfer cluster as is.

Each lives where its value does:
  gateway (per finished request)  vllm:prompt_tokens_total, vllm:generation_tokens_total,
                                  vllm:request_success_total{finished_reason},
                                  vllm:time_to_first_token_seconds,
                                  vllm:time_per_output_token_seconds,
                                  vllm:inter_token_latency_seconds,
                                  vllm:e2e_request_latency_seconds
  node (each heartbeat's sample)  vllm:num_requests_running, vllm:num_requests_waiting,
                                  vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc

Every series has vLLM's `model_name` label (the model's registry id, as `gen_ai.request.model`);
the node's also carry `slinfer_node_id`. Histogram buckets are vLLM's, so a query written for
vLLM's percentiles means the same here.

Where the meaning differs from vLLM's, on purpose:
- prompt_tokens counts each of a request's n choices: each is a request of its own with its own
  prefill (the response's usage, and gen_ai.client.token.usage, count the prompt once).
- time_per_output_token is one observation per request, its mean time per token after the
  first (the TPOT the SLOs judge); inter_token_latency is one per token message after the first,
  the gap divided by the tokens it carried. vLLM records both per engine step.
- "waiting" is a request on a node whose prefill has not run (its instance may still be
  loading); requests queued at the placer, on no node yet, are not counted by any node.
- finished_reason is stop | length, or abort for a request the client cancelled; requests that
  failed (dropped, timed out, errors) are not successes and count only in slinfer's own metrics.

OpenTelemetry instrument names may not contain ':'; they are named `vllm.<name>` and
`telemetry.prometheus_name` writes them as `vllm:<name>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.core.cost import in_blocks
from shared.core.types import InstanceStatus, NodeView

PREFIX = "vllm."
PROMPT_TOKENS = "vllm.prompt_tokens"  # counter
GENERATION_TOKENS = "vllm.generation_tokens"  # counter
REQUEST_SUCCESS = "vllm.request_success"  # counter, by finished_reason
TTFT = "vllm.time_to_first_token"  # histogram, s
TPOT = "vllm.time_per_output_token"  # histogram, s
ITL = "vllm.inter_token_latency"  # histogram, s
E2E = "vllm.e2e_request_latency"  # histogram, s
RUNNING = "vllm.num_requests_running"  # gauge
WAITING = "vllm.num_requests_waiting"  # gauge
KV_USAGE = "vllm.kv_cache_usage_perc"  # gauge, 0..1
GPU_CACHE_USAGE = "vllm.gpu_cache_usage_perc"  # gauge: the name before vLLM 0.9, still on boards

MODEL_NAME = "model_name"
FINISHED_REASON = "finished_reason"
NODE_ID = "slinfer.node_id"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def prometheus_base(name: str) -> str | None:
    """`vllm.num_requests_running` -> `vllm:num_requests_running`; None for other names."""
    if not name.startswith(PREFIX):
        return None
    return "vllm:" + name[len(PREFIX):].replace(".", "_")


# --- gateway: per request ---------------------------------------------------------------------
@dataclass(frozen=True)
class RequestRecord:
    """What the gateway knows of one request once it has ended."""

    model: str
    prompt_tokens: int  # counted once its first token came (its prefill ran)
    output_tokens: int
    ttft_s: float | None  # None: no token came
    tpot_s: float | None  # None: fewer than two tokens
    duration_s: float
    finished_reason: str | None  # stop | length | abort; None: it failed
    token_gaps: tuple[float, ...] = ()  # per token message after the first: gap / its tokens


class VllmRequestMetrics:
    def __init__(self, meter) -> None:
        self.prompt_tokens = meter.create_counter(PROMPT_TOKENS, unit="{token}",
                                                  description="Prefill tokens processed")
        self.generation_tokens = meter.create_counter(GENERATION_TOKENS, unit="{token}",
                                                      description="Generation tokens processed")
        self.success = meter.create_counter(REQUEST_SUCCESS, unit="{request}",
                                            description="Requests finished, by finished_reason")
        self.ttft = meter.create_histogram(TTFT, unit="s", description="Time to first token",
                                           explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = meter.create_histogram(TPOT, unit="s", description="A request's mean time "
                                           "per output token after the first",
                                           explicit_bucket_boundaries_advisory=TOKEN_GAP_BUCKETS)
        self.itl = meter.create_histogram(ITL, unit="s", description="Time between token messages, "
                                          "per token", explicit_bucket_boundaries_advisory=TOKEN_GAP_BUCKETS)
        self.e2e = meter.create_histogram(E2E, unit="s", description="End-to-end request latency",
                                          explicit_bucket_boundaries_advisory=E2E_BUCKETS)

    def record(self, r: RequestRecord) -> None:
        attrs = {MODEL_NAME: r.model}
        if r.ttft_s is not None:
            self.prompt_tokens.add(r.prompt_tokens, attrs)
            self.ttft.record(r.ttft_s, attrs)
        if r.output_tokens:
            self.generation_tokens.add(r.output_tokens, attrs)
        if r.tpot_s is not None:
            self.tpot.record(r.tpot_s, attrs)
        for gap in r.token_gaps:
            self.itl.record(gap, attrs)
        if r.finished_reason is not None:
            self.success.add(1, {**attrs, FINISHED_REASON: r.finished_reason})
            self.e2e.record(r.duration_s, attrs)


# --- node: per heartbeat sample ---------------------------------------------------------------
@dataclass(frozen=True)
class ModelLoad:
    """One model's requests and KV cache on a node (all its instances there together)."""

    model: str
    running: int = 0  # prefilled: in the decode batch
    waiting: int = 0  # admitted, prefill not run yet (a loading instance's requests too)
    kv_used_tokens: int = 0  # in whole blocks, as the engine allocates them
    kv_capacity_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        if self.kv_capacity_tokens <= 0:
            return 0.0
        return min(1.0, self.kv_used_tokens / self.kv_capacity_tokens)


def model_loads(node: NodeView, kv_capacity_bytes: Callable[[str], int]) -> tuple[ModelLoad, ...]:
    """Each model with an instance on `node`. `kv_capacity_bytes(instance_id)`: the KV bytes
    the instance holds now (`NodeScheduler.kv_capacity_bytes`)."""
    loads: dict[str, ModelLoad] = {}
    for inst in node.instances:
        spec = inst.model
        block = max(1, spec.kv_block_tokens)
        running = sum(1 for r in inst.requests if r.prefilled)
        used = sum(in_blocks(r.context_len(), block) for r in inst.requests if r.prefilled)
        capacity = 0
        if inst.status is not InstanceStatus.LOADING:
            capacity = kv_capacity_bytes(inst.instance_id) // (max(1, spec.kv_bytes_per_token) * block) * block
        old = loads.get(spec.name, ModelLoad(spec.name))
        loads[spec.name] = ModelLoad(spec.name, old.running + running,
                                     old.waiting + len(inst.requests) - running,
                                     old.kv_used_tokens + used, old.kv_capacity_tokens + capacity)
    return tuple(loads.values())


def register_node_gauges(meter, node_id: str, loads: Callable[[], tuple[ModelLoad, ...]]) -> None:
    from opentelemetry.metrics import Observation

    def gauge(name: str, description: str, read: Callable[[ModelLoad], float]) -> None:
        meter.create_observable_gauge(
            name, [lambda _opts: [Observation(read(m), {MODEL_NAME: m.model, NODE_ID: node_id})
                                  for m in loads()]],
            unit="1" if name in (KV_USAGE, GPU_CACHE_USAGE) else "{request}", description=description)

    gauge(RUNNING, "Requests in a decode batch on the node", lambda m: m.running)
    gauge(WAITING, "Requests on the node waiting for their prefill", lambda m: m.waiting)
    gauge(KV_USAGE, "KV-cache usage, 1 = full", lambda m: m.kv_usage)
    gauge(GPU_CACHE_USAGE, "KV-cache usage, 1 = full (vLLM's name before 0.9: use "
          "vllm:kv_cache_usage_perc)", lambda m: m.kv_usage)
