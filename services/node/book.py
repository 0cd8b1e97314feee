"""The node's request book: the requests it owns (`live`), those migrating to it (`incoming`)
or away from it (`migrating`, `held`), and what became of those that left (`recent`), with the
pure rules over them: the redelivery gate, the finish reason and the deadline rule.

Nothing here does I/O or reads a clock: the parts that act on a request (admission, the token
loop, the migrations) ask the book and carry out its answer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.node.engines import SamplingParams
from services.node.engines.base import TokenLogprobs
from shared.core.types import RequestView
from shared.schemas import (FinishReason, InferenceRequest, NodeReply, RequestState, TokenLogprob,
                            TokenMessage)

RECENT_LEN = 4096  # finished or handed-back requests remembered for STATUS and redeliveries


@dataclass
class Live:
    """A request this node owns."""

    request: InferenceRequest
    instance_id: str
    output: list[int] = field(default_factory=list)  # resumed tokens + tokens generated here
    cancelled: bool = False
    in_engine: bool = False  # added to its engine (once the instance's load completed)
    # The engine refused it (add_request raised): the token loop fails it with this error. It
    # was admitted, so it ends with an error final, never also a refusal; others are unharmed.
    error: str | None = None
    # The last output token's logprobs (a request that asked): its final message carries them.
    last_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def all_tokens(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output]

    @property
    def generated_here(self) -> int:
        """Output tokens produced on this node (resumed ones excluded)."""
        return len(self.output) - len(self.request.resumed_token_ids)


@dataclass
class Incoming:
    """A request migrating here (live migration, destination side) before its commit."""

    request: InferenceRequest
    instance_id: str
    # Its place in the core, parked out of the instance's batches until the commit (the core
    # admitted it, so its memory stays counted, but nothing here may decode it yet).
    view: RequestView
    known: list[int]  # output tokens whose KV this node has computed
    pending: int | None = None  # the token the last prefill/extend sampled (next after `known`)
    pending_logprobs: TokenLogprobs | None = None  # its logprobs, where the request asked
    cancelled: bool = False

    @property
    def all_tokens(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.known]


@dataclass(frozen=True)
class Past:
    """A request that was live here and is not any more."""

    attempt: int
    state: RequestState  # FINISHED or MOVED
    tokens: int  # its output length when it left (resumed tokens included)
    final: TokenMessage | None = None  # FINISHED: the final message sent


@dataclass(frozen=True)
class Gate:
    """The redelivery gate's answer for an admission (`RequestBook.gate`)."""

    stale: Live | None = None  # an older attempt still here: drop it, then admit this one
    reply: NodeReply | None = None  # answer this without admitting (None: admit)
    resend: TokenMessage | None = None  # the final message to publish again first


def sampling_params(req: InferenceRequest, output_len: int) -> SamplingParams:
    """The engine's parameters for a request that already has `output_len` output tokens
    (resumed or migrated: they count toward min_tokens)."""
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                          seed=req.seed, eos_token_ids=tuple(req.eos_token_ids), top_k=req.top_k,
                          repetition_penalty=req.repetition_penalty,
                          min_tokens=max(0, req.min_tokens - output_len), ignore_eos=req.ignore_eos,
                          adapter=req.adapter, logprobs=req.logprobs,
                          presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty,
                          logit_bias=tuple((b.token, b.bias) for b in req.logit_bias),
                          min_p=req.min_p, prior_output=output_len, grammar=req.grammar,
                          # Sent with the first output token: a request resumed or migrated
                          # with output already had them sent by its first node.
                          prompt_logprobs=req.prompt_logprobs if output_len == 0 else None,
                          embedding=req.embedding)


def wire_logprobs(logprobs: TokenLogprobs | None) -> list[TokenLogprob]:
    """An engine's logprobs of one token as a token message carries them ([] when none)."""
    if logprobs is None:
        return []
    return [TokenLogprob(logprobs.logprob, [t for t, _ in logprobs.top],
                         [lp for _, lp in logprobs.top])]


def wire_prompt_logprobs(logprobs: list[TokenLogprobs] | None) -> list[TokenLogprob]:
    """An engine's prompt logprobs as a token message carries them ([] when none)."""
    return [entry for lp in logprobs or () for entry in wire_logprobs(lp)]


def finish_reason(live: Live, token: int, max_context: int) -> FinishReason | None:
    """Why the request ends with `token` (already appended to its output); None: it goes on."""
    if live.cancelled:
        return FinishReason.CANCELLED
    if token in live.request.eos_token_ids:
        return FinishReason.STOP
    if len(live.output) >= live.request.max_tokens or len(live.all_tokens) >= max_context:
        return FinishReason.LENGTH
    return None


def past_deadline(live: Live, now: float) -> bool:
    """The gateway stopped waiting for it (it timed out, or died with the client's connection):
    an orphan must not run on to max_tokens. A deadline of 0 means none."""
    return 0 < live.request.deadline < now


class RequestBook:
    """Every request record of the node, by request id (module doc)."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}
        self.incoming: dict[str, Incoming] = {}  # live migrations to this node, before commit
        self.migrating: set[str] = set()  # requests this node is migrating away now
        self.held: dict[str, RequestView | None] = {}  # stopped for a commit, not yet answered
        self.recent: OrderedDict[str, Past] = OrderedDict()  # request id -> what became of it

    def status(self, request_id: str, attempt: int = 0) -> NodeReply:
        """STATUS: what this node knows of the request (its attempt `attempt` or a later one)."""
        live = self.live.get(request_id)
        if live is not None and live.request.attempt >= attempt:
            return NodeReply(True, RequestState.RUNNING.value, live.instance_id,
                             generated=len(live.output))
        past = self.recent.get(request_id)
        if past is not None and past.attempt >= attempt:
            return NodeReply(True, past.state.value, final=past.final, generated=past.tokens)
        return NodeReply(True, RequestState.UNKNOWN.value)

    def remember(self, live: Live, state: RequestState, final: TokenMessage | None = None) -> None:
        request = live.request
        self.recent[request.request_id] = Past(request.attempt, state, len(live.output), final)
        self.recent.move_to_end(request.request_id)
        while len(self.recent) > RECENT_LEN:
            self.recent.popitem(last=False)

    def gate(self, req: InferenceRequest) -> Gate:
        """The redelivery gate: whether an admission of `req` runs, or what answers it. The
        request stream redelivers an admission whose ack was lost; a request must never run
        twice, nor a stale attempt beside the current one."""
        live = self.live.get(req.request_id)
        stale = None
        if live is not None and live.request.attempt < req.attempt:
            stale = live  # the gateway resumed it elsewhere meanwhile: an orphan
        elif live is not None:  # a redelivered admission: already ours
            return Gate(reply=NodeReply(True, "admitted", live.instance_id))
        moving = self.incoming.get(req.request_id)
        if (moving is not None and moving.request.attempt >= req.attempt) or (
                live is None and req.request_id in self.migrating):
            # A redelivered admission of a request migrating to or from here: the migration owns
            # it (it commits here, or stays where it runs); a second copy must not start.
            return Gate(stale, NodeReply(True, "migrating"))
        past = self.recent.get(req.request_id)
        if past is not None and past.attempt >= req.attempt:
            # Finished or handed back from here, and the placer's ack was lost so the stream
            # redelivered the admission: do not run it twice. (A handed-back request that comes
            # back with at least the tokens it left with is its requeued copy: that one runs.)
            if past.state is RequestState.FINISHED:
                return Gate(stale, NodeReply(True, "already_finished"), past.final)
            if len(req.resumed_token_ids) < past.tokens:
                return Gate(stale, NodeReply(True, "already_moved"))
        return Gate(stale)

    def overdue(self, now: float) -> list[Live]:
        """The live requests whose deadline passed (`past_deadline`)."""
        return [lv for lv in self.live.values() if past_deadline(lv, now)]
