"""The narrow engine protocol every engine (torch, openvino, vllm) implements.

The node worker's scheduler (shared.core) decides *what* runs each cycle: exactly one prefill of
one request, or one decode step of an instance's batch. The engine only executes it. That split is
what lets several models share one node at token granularity.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from shared import engine_features
from shared.schemas import POOLINGS, Embedding, OutputGrammar


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # keep the k most likely tokens before sampling; 0 = all
    # Hugging Face's (CTRL) penalty on every token already in the sequence, prompt included:
    # a positive logit is divided by it, a negative one multiplied; 1 = off. Applies to greedy too.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS tokens cannot be produced before this many were generated
    ignore_eos: bool = False  # an EOS token does not end the request (max_tokens does)
    # The LoRA adapter (its name on the engine, see load_adapter) the request runs through;
    # None = the plain base model. Only engines that serve adapters (torch) accept one.
    adapter: str | None = None
    # OpenAI's logprobs / top_logprobs: None = none; k = each new token's log-probability and
    # the k most likely tokens' (0..MAX_TOP_LOGPROBS).
    logprobs: int | None = None
    # OpenAI's penalties, subtracted from the logit of each token already in the output (the
    # prompt does not count): presence once, frequency per occurrence; 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # Keep only tokens at least min_p times as likely as the likeliest one (after temperature,
    # before top-k/top-p, as vLLM); 0 = off. Greedy rows are unchanged by it.
    min_p: float = 0.0
    # The last `prior_output` of the tokens given to add_request are output already (resumed
    # or migrated): the penalties count them as output, not prompt.
    prior_output: int = 0
    # The output must match this grammar (constrained decoding); None = free. It ends with one
    # of eos_token_ids, so it needs some and neither ignore_eos nor min_tokens.
    grammar: OutputGrammar | None = None
    # The prompt's logprobs (echo): None = none; k = the prefill also gives each prompt token
    # after the first its log-probability and the k most likely (StepResult.prompt_logprobs).
    prompt_logprobs: int | None = None
    # An embedding request (max_tokens 0): the prefill returns the prompt's pooled last hidden
    # states (StepResult.embeddings) instead of a token. Only engines with the "embeddings"
    # feature compute them.
    embedding: Embedding | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One new token's log-probabilities, from the model's own next-token distribution (before
    the request's penalties, temperature and top-k/top-p: vLLM's default, raw log-probs)."""

    logprob: float  # the chosen token's
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (id, logprob), likeliest first


@dataclass(frozen=True)
class MemoryReport:
    weight_bytes: int  # parameters resident on the device
    kv_capacity_bytes: int  # KV pool allocated
    kv_used_bytes: int  # KV blocks holding live tokens
    kv_bytes_per_token: int
    adapter_bytes: int = 0  # LoRA adapters loaded beside the weights (not in weight_bytes)


@dataclass(frozen=True)
class StepResult:
    """Tokens produced by one iteration, by request id (one token per request)."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked
    # A prefill of a request that asked for prompt logprobs: one per prompt token after the first.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # A prefill of an embedding request: its vector (float32 little-endian bytes), and no token.
    embeddings: dict[str, bytes] = field(default_factory=dict)


class KVCacheFull(RuntimeError):
    """The KV pool cannot hold the next token of a request; the node must scale up or evict."""


@runtime_checkable
class Engine(Protocol):
    name: str  # "torch" | "openvino" | "vllm"

    def load(self) -> None: ...

    def unload(self) -> None: ...

    def memory(self) -> MemoryReport: ...

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; `token_ids` is the prompt (plus resumed tokens after a migration)."""

    def prefill(self, request_id: str) -> StepResult:
        """Run the prefill of one added request, alone; returns its first generated token."""

    def decode(self, request_ids: list[str]) -> StepResult:
        """One decode step for these prefilled requests, batched; one new token each."""

    def release(self, request_id: str) -> None:
        """Finished or cancelled: drop the request and free its KV blocks."""

    def evict(self, request_id: str) -> list[int]:
        """Drop the request and return all its tokens (prompt + generated) so it can be
        re-added on any instance, which recomputes the KV cache (token-based migration)."""

    def resize_kv(self, capacity_bytes: int) -> None:
        """Grow or shrink the KV pool while requests are in flight (copies used blocks)."""


@dataclass
class PipelinedRequest:
    """A request in an engine whose own scheduler may compute tokens ahead of ours (OpenVINO's
    continuous-batching pipeline, vLLM): tokens it computed wait in `ahead` until our scheduler
    runs the iteration that hands them out."""

    tokens: list[int]  # prompt (+ resumed tokens) + tokens handed out; the last one has no KV yet
    params: SamplingParams
    seed: int
    ahead: deque = field(default_factory=deque)  # computed by the engine, not yet handed out
    prefilled: bool = False
    generated: int = 0  # tokens handed out since add_request

    @property
    def pipe_tokens(self) -> int:
        """Tokens of this sequence inside the engine (the last one has no KV yet)."""
        return len(self.tokens) + len(self.ahead)

    def hand_out(self, token: int) -> None:
        self.tokens.append(token)
        self.generated += 1


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks that hold `tokens` tokens."""
    return -(-max(tokens, 0) // block_size)


def asked_features(params: SamplingParams) -> list[str]:
    """The features of shared/engine_features.py that `params` asks for."""
    return engine_features.asked_features(params.logprobs, params.presence_penalty,
                                          params.frequency_penalty, params.logit_bias,
                                          params.min_p,
                                          params.grammar.param if params.grammar else None,
                                          params.prompt_logprobs, params.embedding is not None)


class RequestBook:
    """Per-request bookkeeping the engines share. An engine keeps `self.requests[id]` with
    `.tokens` (prompt + generated), `.params` and `.generated`, and implements `release`."""

    requests: dict
    # What the engine honours beyond plain sampling (shared/engine_features.py ENGINE_FEATURES)
    features: frozenset[str] = frozenset()

    def _request(self, request_id: str):
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def check_new(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  max_context: int, vocab_size: int) -> None:
        """Refuse, with a clear ValueError, a request the engine could not run."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not token_ids:
            raise ValueError("a request needs at least one token")
        if len(token_ids) >= max_context:
            raise ValueError(f"{len(token_ids)} tokens do not fit the model's context of "
                             f"{max_context}")
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if params.top_k < 0 or params.min_tokens < 0 or not params.repetition_penalty > 0:
            raise ValueError("top_k and min_tokens must be >= 0 and repetition_penalty > 0")
        if missing := [f for f in asked_features(params) if f not in self.features]:
            raise ValueError(f"{', '.join(missing)} not served by the "
                             f"{getattr(self, 'name', '')} engine")
        self._check_features(params, len(token_ids), vocab_size)
        if params.adapter is not None and params.adapter not in getattr(self, "adapters", {}):
            raise ValueError(f"LoRA adapter {params.adapter!r} is not loaded on this "
                             f"{getattr(self, 'name', '')} engine")

    @staticmethod
    def _check_features(params: SamplingParams, tokens: int, vocab_size: int) -> None:
        for name, k in (("logprobs (top_logprobs)", params.logprobs),
                        ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_TOP_LOGPROBS}, got {k}")
        if not 0 <= params.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
        if not all(0 <= t < vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        if not 0 <= params.prior_output <= tokens:
            raise ValueError(f"prior_output must be in 0..{tokens}, got {params.prior_output}")
        embedding = params.embedding
        if embedding is not None and (embedding.pooling not in POOLINGS or params.max_tokens
                                      or params.grammar is not None or params.prompt_logprobs
                                      is not None or params.logprobs is not None):
            raise ValueError(f"an embedding request pools with one of {POOLINGS} and asks for "
                             "no output (max_tokens 0, no grammar, no logprobs)")
        if params.grammar is not None and (params.ignore_eos or params.min_tokens
                                           or not params.eos_token_ids):
            # A complete output ends with an end token, the only one its grammar then allows.
            raise ValueError("an output grammar needs end tokens, and neither ignore_eos nor "
                             "min_tokens")

    def evict(self, request_id: str) -> list[int]:
        """Drop the request, free its KV, and return prompt + generated tokens (to resume)."""
        request = self._request(request_id)
        self.release(request_id)
        return list(request.tokens)

    def is_finished(self, request_id: str) -> bool:
        """max_tokens reached or the last token is an EOS (a helper; the scheduler decides)."""
        request = self._request(request_id)
        if request.generated >= request.params.max_tokens:
            return True
        if request.params.ignore_eos:
            return False
        return request.generated > 0 and request.tokens[-1] in request.params.eos_token_ids

    def num_tokens(self, request_id: str) -> int:
        return len(self._request(request_id).tokens)


# -- capabilities beyond the protocol: an engine declares them by implementing these ------------
# The node asks `isinstance(engine, ServesAdapters)` (and so on) instead of probing for methods,
# so what an engine can do is written in one place and a type checker sees it.


@runtime_checkable
class ServesAdapters(Protocol):
    """Runs requests through LoRA adapters loaded beside the base weights (torch)."""

    adapters: dict  # the adapters loaded now, by name

    def load_adapter(self, name: str, path) -> int:
        """Load the adapter at `path` under `name`; its bytes."""

    def unload_adapter(self, name: str) -> None: ...


@runtime_checkable
class MovesLayers(Protocol):
    """Its decoder layers can run on a stage elsewhere and come back with their K/V (CoCoServe's
    module scaling, λScale's execution pipelines: torch)."""

    def shed_layers(self, address: str) -> None: ...

    def replicate_layers(self, address: str) -> None: ...

    def drop_replica(self, address: str) -> None: ...

    def take_layers(self, start: int, end: int, tensors=None) -> None: ...


@runtime_checkable
class ChunksPrefill(Protocol):
    """Runs a prefill in chunks, each against the K/V the earlier ones wrote (chunked prefill,
    `CoreConfig.prefill_chunk_tokens`: torch). The others prefill a request whole: OpenVINO's
    and vLLM's own schedulers take a whole prompt at once."""

    def prefill_chunk(self, request_id: str, tokens: int) -> StepResult:
        """The next `tokens` of the request's prefill; the chunk that ends it returns its first
        token, as `Engine.prefill` does (an empty StepResult before it). `Engine.prefill` after
        some chunks runs all the rest as the last one."""


@runtime_checkable
class ReportsLoad(Protocol):
    """Says how its last load went: tier, seconds, bytes (the node's load records)."""

    load_info: dict


def has_adapter(engine: Engine | None, adapter: str | None) -> bool:
    """The request's adapter (None: the base model) is loaded on `engine`."""
    return adapter is None or (isinstance(engine, ServesAdapters) and adapter in engine.adapters)


def chunks_prefill(engine: Engine | None) -> bool:
    """`engine` may run the core's prefill chunks (else its prefills stay whole)."""
    return isinstance(engine, ChunksPrefill)


def load_info(engine: Engine) -> dict:
    """What the engine reported of its load ({}: it reports nothing)."""
    return (engine.load_info or {}) if isinstance(engine, ReportsLoad) else {}
