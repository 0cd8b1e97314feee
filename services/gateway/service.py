"""What a completion request does between validation and the response: find the model the tenant
may use, tokenize, check lengths against the model, build the `InferenceRequest`, submit it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import anyio
from redis.asyncio import Redis
from transformers import PreTrainedTokenizerBase

from services.gateway import errors, lifecycle
from services.gateway.admission import Admission, Slot
from services.gateway.backend import BackendUnavailable, InferenceBackend, TokenStream
from services.gateway.choices import Choices
from services.gateway.files_check import FilesCheck
from services.gateway.generation import Generation
from services.gateway.observe import RequestObserver
from services.gateway.record_cache import RecordCache
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import (
    IncrementalDetokenizer,
    TokenizerCache,
    TokenizerLoadError,
    encode_chat,
    encode_text,
    tokenizer_eos_ids,
    vocab_size,
)
from services.gateway.validation import (ChatInput, CompletionInput, SamplingParams,
                                         check_grammar_fits)
from shared.core.types import slo_for_class
from shared.engine_features import unsupported
from shared.model_state import failed_locally, failed_message, files_failure
from shared.registry import ModelRegistry, display_name, files_problem
from shared.schemas import InferenceRequest, ModelRecord, TokenBias
from shared.telemetry import GenAIMetrics

log = logging.getLogger("slinfer.gateway")
# A prompt shorter than this is tokenized on the event loop: ~1-3 ms for ordinary text, ~15 ms at
# worst (random code points, each several tokens; SmolLM2's and the demo model's tokenizers).
INLINE_TOKENIZE_CHARS = 8192


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check and is ready to submit."""

    record: ModelRecord
    tokenizer: PreTrainedTokenizerBase
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the request's, or the default capped by the context left


class GatewayService:
    def __init__(self, settings: GatewaySettings, registry: ModelRegistry, backend: InferenceBackend,
                 tokenizers: TokenizerCache, metrics: GenAIMetrics,
                 redis: Redis | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.redis = redis  # model lifecycles (None: a failure found here is only answered)
        self.backend = backend
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.admission = Admission(settings)
        self.files = FilesCheck(registry, redis)
        self.records = RecordCache(settings.registry_cache_s)

    async def visible_model(self, name: str, tenant: str) -> ModelRecord:
        """The model a request for `name` by `tenant` is served by (kept a moment: a request
        for a model used a moment ago skips the registry read), or 404 (503 while the registry
        is being restored)."""
        record = self.records.get(name, tenant)
        if record is not None:
            return record
        generation = self.records.generation
        record = await self._read_visible(name, tenant)
        self.records.put(name, tenant, record, generation)
        return record

    async def _read_visible(self, name: str, tenant: str) -> ModelRecord:
        record = await self.registry.resolve_served(name, tenant)
        if record is None:
            if not await self.registry.intact():  # Redis lost its data; a placer restores it
                raise errors.registry_unavailable()
            # A placer writes the registry back before the epoch: intact now, so a model missing
            # a moment ago may have been restored in between (a 404 there: make test run 69).
            record = await self.registry.resolve_served(name, tenant)
            if record is None:
                raise errors.model_not_found(name)
        return record

    async def tokenizer_for(self, record: ModelRecord) -> PreTrainedTokenizerBase:
        # A LoRA adapter uses its base model's tokenizer unless it ships its own.
        source = record
        if record.base_model is not None:
            base = await self.registry.get(record.base_model)  # the base's registry id
            if base is not None:
                source = base
        try:
            return await self.tokenizers.get(source.path)
        except TokenizerLoadError as exc:
            problem = await asyncio.to_thread(files_problem, source.path)
            if problem is not None:  # the model's files are broken: one answer for that cause
                raise await self._files_broken(source, problem) from exc
            raise errors.APIError(500, f"The tokenizer of model {record.name!r} cannot be loaded.",
                                  type="server_error", code="tokenizer_unavailable") from exc

    async def _files_broken(self, record: ModelRecord, problem: str) -> errors.APIError:
        """`record`'s lifecycle fails with the problem (services/gateway/lifecycle.py), and the
        request gets the answer a node or the placer would give for it."""
        kinds, status = list(self.settings.profile_hardware), None
        if self.redis is not None:
            try:
                status, kinds = await lifecycle.files_broken(self.redis, record, problem,
                                                             tuple(kinds))
            except Exception as exc:  # Redis down: the answer says so all the same
                log.warning("could not mark %s failed in its lifecycle: %r", record.name, exc)
        if status is None:
            status = failed_locally(kinds, files_failure(problem, "the gateway"))
        return errors.model_failed(failed_message(display_name(record), status, kinds,
                                                  hide=(record.path,)))

    async def files_cause(self, record: ModelRecord) -> errors.APIError | None:
        """The `model_failed` answer for a request for `record` that was dropped or failed before
        any node loaded its files, when they are broken (services/gateway/files_check.py)."""
        found = await self.files.broken(record)
        if found is None:
            return None
        return await self._files_broken(*found)

    async def prepare(self, model: str, tenant: str, params: SamplingParams,
                      prompt: CompletionInput | ChatInput) -> Prepared:
        if params.n > self.settings.max_choices:
            raise errors.invalid_request(
                f"n must be at most {self.settings.max_choices} at this gateway, got {params.n}.",
                param="n", code="invalid_value")
        self.admission.check_rate(tenant)  # before any work is spent on the request
        record = await self.visible_model(model, tenant)
        tokenizer = await self.tokenizer_for(record)
        if isinstance(prompt, ChatInput):
            prompt_ids = await _tokenize(_chat_chars(prompt), encode_chat, tokenizer,
                                         prompt.messages, prompt.tools)
            param = "messages"
        elif prompt.text is not None:
            prompt_ids = await _tokenize(len(prompt.text), encode_text, tokenizer, prompt.text)
            param = "prompt"
        else:
            prompt_ids = list(prompt.token_ids or [])
            param = "prompt"
            limit = vocab_size(tokenizer)
            if any(t >= limit for t in prompt_ids):
                raise errors.invalid_request(f"Prompt token ids must be below the vocabulary size {limit}.",
                                             param="prompt", code="invalid_value")
        if not prompt_ids:
            raise errors.invalid_request("The prompt is empty after tokenization.", param=param,
                                         code="empty_prompt")
        await self.check_engine(record, params.features())
        check_grammar_fits(params)
        self._check_token_ids(params, vocab_size(tokenizer))
        # Echo only (max_tokens 0): the engine makes one token, which brings the prompt's
        # logprobs back and is dropped (SamplingParams.echo_only); the context must hold it.
        max_tokens = self._max_tokens(record, len(prompt_ids),
                                      1 if params.echo_only else params.max_tokens, param)
        shown = 0 if params.echo_only else max_tokens
        if params.min_tokens > shown:
            raise errors.invalid_request(
                f"min_tokens ({params.min_tokens}) must not exceed the completion's max_tokens "
                f"({shown}).", param="min_tokens", code="invalid_value")
        return Prepared(record=record, tokenizer=tokenizer, prompt_ids=prompt_ids, params=params,
                        max_tokens=max_tokens)

    async def check_engine(self, record: ModelRecord, asked: list[str]) -> None:
        """Refuse by name what the model's engine would not honour (shared/engine_features.py):
        a 400 now, rather than a request that runs without it. A LoRA adapter runs on its
        backbone's engine."""
        if not asked:
            return
        engine = record.engine
        if record.base_model is not None:
            base = await self.registry.get(record.base_model)
            engine = base.engine if base is not None else engine
        missing = unsupported(engine, asked)
        if missing:
            names = ", ".join(repr(m) for m in missing)
            raise errors.invalid_request(
                f"Unsupported parameter: {names} {'is' if len(missing) == 1 else 'are'} not "
                f"supported by the {engine} engine that serves model {record.name!r}.",
                param=missing[0], code="unsupported_parameter")

    @staticmethod
    def _check_token_ids(params: SamplingParams, limit: int) -> None:
        """Token ids the request names must be in the model's vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            if any(t >= limit for t in ids):
                raise errors.invalid_request(f"{name} token ids must be below the vocabulary "
                                             f"size {limit}.", param=name, code="invalid_value")

    def _max_tokens(self, record: ModelRecord, prompt_len: int, requested: int | None, param: str) -> int:
        context = record.max_context
        if requested is not None and requested > context:
            raise errors.invalid_request(
                f"max_tokens is too large: {requested}. This model supports at most {context} "
                "completion tokens.", param="max_tokens", code="invalid_value")
        if prompt_len >= context:
            raise errors.invalid_request(
                f"This model's maximum context length is {context} tokens; your prompt has "
                f"{prompt_len} tokens, leaving no room for a completion.", param=param,
                code="context_length_exceeded")
        if requested is None:  # the rest of the context, or less where the operator says so
            cap = self.settings.default_max_tokens
            return context - prompt_len if cap is None else min(cap, context - prompt_len)
        if prompt_len + requested > context:
            raise errors.invalid_request(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                "completion). Please reduce the prompt or max_tokens.", param=param,
                code="context_length_exceeded")
        return requested

    def build_request(self, prepared: Prepared, request_id: str, tenant: str,
                      choice: int = 0) -> InferenceRequest:
        record, params = prepared.record, prepared.params
        slo = slo_for_class(record.slo_class, len(prepared.prompt_ids))
        # With ignore_eos no EOS ends the request, only the client's stop_token_ids (vLLM's
        # meaning): the node ends it at those as at an EOS, and min_tokens holds them back.
        eos = [] if params.ignore_eos else (list(record.eos_token_ids)
                                            or tokenizer_eos_ids(prepared.tokenizer))
        eos += [t for t in params.stop_token_ids if t not in eos]
        arrival = time.time()
        # A LoRA adapter runs on an instance of its backbone (ServerlessLoRA): the placer places
        # the backbone; the node attaches the adapter.
        adapter = record.name if record.base_model is not None else None
        return InferenceRequest(
            request_id=request_id, tenant=tenant, model=record.base_model or record.name,
            adapter=adapter,
            # A record without its rank (registered before ranks were read) counts as the
            # smallest rank the profile measured (1 is below every measured rank).
            adapter_rank=max(1, record.lora_rank) if adapter else 0,
            prompt_token_ids=prepared.prompt_ids, max_tokens=prepared.max_tokens,
            arrival=arrival, ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
            # After this nobody waits: placers do not place it, nodes stop it (an orphan of a
            # gateway that died with the client's connection ends by itself).
            deadline=arrival + self.settings.request_timeout_s,
            temperature=params.temperature, top_p=params.top_p,
            seed=choice_seed(params.seed, choice),
            eos_token_ids=eos, top_k=params.top_k, repetition_penalty=params.repetition_penalty,
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos,
            logprobs=params.logprobs, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, min_p=params.min_p,
            logit_bias=[TokenBias(t, b) for t, b in params.logit_bias], grammar=params.grammar,
            prompt_logprobs=params.prompt_logprobs, keep_alive_s=params.keep_alive_s,
        )

    async def start(self, prepared: Prepared, response_id: str, tenant: str,
                    operation: str = "text_completion") -> Choices:
        """Submit the request's choices, each a request of its own (`choice_id`, `choice_seed`)
        that the cluster places and schedules like any. `operation` is its GenAI operation name
        (chat, text_completion)."""
        n = prepared.params.n
        requests = [self.build_request(prepared, choice_id(response_id, i, n), tenant, i)
                    for i in range(n)]
        # Each choice's prompt is the same one: its usage counts once.
        launched = await self.launch(requests, prepared.record, tenant, operation,
                                     counts_prompt=[i == 0 for i in range(n)])
        return Choices([self._generation(prepared, stream, observer, slot)
                        for stream, observer, slot in launched])

    async def launch(self, requests: list[InferenceRequest], record: ModelRecord, tenant: str,
                     operation: str, counts_prompt: list[bool], param: str = "n",
                     each: str = "choice") -> list[tuple[TokenStream, RequestObserver, Slot]]:
        """Submit requests for `record` together (all or none), each holding an admission slot
        and observed as `operation`, whose prompt counts in the token usage where
        `counts_prompt` says. Each is a request's `each`, counted by its parameter `param`."""
        # 429 here, before the request is queued anywhere (after `prepare`, so a model the
        # tenant may not see is a 404, never a "queue full" that would tell it exists). Each
        # request holds a slot: it is a generation in flight like any request.
        slots = self.admission.acquire_many(tenant, record.name, len(requests), param, each)
        observers = [RequestObserver(self.metrics, r, operation, counts_prompt=counts)
                     for r, counts in zip(requests, counts_prompt)]
        try:
            # The request span's context rides the NATS headers.
            streams = await self._submit(requests, observers)
        except BaseException as exc:
            for slot in slots:
                slot.release()
            if not isinstance(exc, BackendUnavailable):
                raise
            for observer in observers:
                observer.failed_to_submit(exc)
            raise errors.backend_unavailable(str(exc)) from exc
        return list(zip(streams, observers, slots))

    async def _submit(self, requests: list[InferenceRequest],
                      observers: list[RequestObserver]) -> list[TokenStream]:
        """Publish every choice's request at once. All or none: when one is not taken, those
        that were are cancelled and the first failure is raised."""
        timeout = self.settings.request_timeout_s
        if len(requests) == 1:
            return [await self.backend.submit(requests[0], timeout, observers[0].headers)]
        tasks = [asyncio.ensure_future(self.backend.submit(r, timeout, o.headers))
                 for r, o in zip(requests, observers)]
        failure: BaseException | None = None
        try:
            await asyncio.wait(tasks)
        except BaseException as exc:  # cancelled while publishing
            failure = exc
            for task in tasks:
                task.cancel()
        ended = [t for t in tasks if t.done() and not t.cancelled()]
        taken = [t.result() for t in ended if t.exception() is None]
        if failure is None:
            failure = next((t.exception() for t in ended if t.exception() is not None), None)
        if failure is None:
            return taken
        with anyio.CancelScope(shield=True):
            for stream in taken:
                await self.backend.cancel(stream.request_id, "another choice was not accepted")
                await stream.close()
        raise failure

    def _generation(self, prepared: Prepared, stream: TokenStream, observer: RequestObserver,
                    slot: Slot) -> Generation:
        detok = IncrementalDetokenizer(prepared.tokenizer, prepared.prompt_ids)
        return Generation(self.backend, stream, detok, prepared.params.stop,
                          self.settings.request_timeout_s, observer, on_close=slot.release,
                          logprobs=prepared.params.logprobs is not None,
                          prompt_logprobs=(prepared.params.prompt_logprobs is not None
                                           and len(prepared.prompt_ids) > 1),
                          hidden_ids=frozenset(prepared.params.stop_token_ids),
                          echo_only=prepared.params.echo_only,
                          cause=lambda: self.files_cause(prepared.record))


async def _tokenize(chars: int | None, encode, *args) -> list[int]:
    """`encode(*args)` on the event loop for a prompt of fewer than INLINE_TOKENIZE_CHARS
    characters (None: of unknown size), else in a worker thread. Handing a short prompt to a
    thread and back costs more than tokenizing it (a fraction of a millisecond on a busy box);
    a long one would hold up every other stream on this gateway meanwhile."""
    if chars is not None and chars < INLINE_TOKENIZE_CHARS:
        return encode(*args)
    return await asyncio.to_thread(encode, *args)


def _chat_chars(chat: ChatInput) -> int | None:
    """The characters of a chat's messages; None with tools (their schemas are rendered too)."""
    if chat.tools:
        return None
    return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
               for m in chat.messages)


def choice_id(response_id: str, index: int, n: int) -> str:
    """The request id of choice `index`: the response's own id when it is the only choice."""
    return response_id if n == 1 else f"{response_id}-{index}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i samples with seed + i, so that seeded choices differ from each other and the
    same request again gives the same choices. It wraps within the 64 bits a seed may have."""
    if seed is None:
        return None
    seed += index
    return seed - 2**64 if seed >= 2**64 else seed
