"""The node's request book and its pure rules (services/node/book.py), without servers: the
redelivery gate an admission passes, the finish reason of a new token, the deadline rule, and
what STATUS answers."""

from __future__ import annotations

from services.node.book import (RECENT_LEN, Incoming, Live, RequestBook, finish_reason,
                                past_deadline, sampling_params)
from shared.cluster import request_view
from shared.schemas import FinishReason, InferenceRequest, RequestState, TokenMessage


def _req(rid: str = "r", attempt: int = 0, resumed: int = 0, **kw) -> InferenceRequest:
    return InferenceRequest(rid, "t", "m", [1, 2, 3], kw.pop("max_tokens", 10), 0.0, 1.0, 0.25,
                            attempt=attempt, resumed_token_ids=list(range(resumed)), **kw)


def test_a_redelivered_admission_of_a_live_request_is_answered_with_its_instance():
    book = RequestBook()
    book.live["r"] = Live(_req(), "i1")
    gate = book.gate(_req())
    assert gate.reply is not None and gate.reply.accepted and gate.reply.instance_id == "i1"
    assert gate.stale is None


def test_a_later_attempt_drops_the_stale_one_and_is_admitted():
    book = RequestBook()
    stale = Live(_req(attempt=0), "i1")
    book.live["r"] = stale
    gate = book.gate(_req(attempt=1))
    assert gate.stale is stale and gate.reply is None


def test_a_request_migrating_either_way_is_not_admitted_twice():
    book = RequestBook()
    book.incoming["r"] = Incoming(_req(), "i1", request_view(_req()), [])
    assert book.gate(_req()).reply.reason == "migrating"
    book = RequestBook()
    book.migrating.add("r")
    assert book.gate(_req()).reply.reason == "migrating"


def test_a_finished_request_resends_its_final_and_a_moved_one_runs_only_as_its_requeued_copy():
    book = RequestBook()
    live = Live(_req(), "i1", output=[7, 8])
    final = TokenMessage("r", 1, [8], finished=True)
    book.remember(live, RequestState.FINISHED, final)
    gate = book.gate(_req())
    assert gate.reply.reason == "already_finished" and gate.resend is final
    assert book.gate(_req(attempt=1)).reply is None  # a resumed attempt runs

    book = RequestBook()
    book.remember(Live(_req(), "i1", output=[7, 8]), RequestState.MOVED)
    assert book.gate(_req(resumed=1)).reply.reason == "already_moved"
    assert book.gate(_req(resumed=2)).reply is None  # its requeued copy, with every token


def test_finish_reason_cancel_then_eos_then_length_or_context():
    live = Live(_req(max_tokens=3, eos_token_ids=[0]), "i1", output=[5])
    assert finish_reason(live, 5, max_context=100) is None
    live.output.append(0)
    assert finish_reason(live, 0, max_context=100) is FinishReason.STOP
    live.cancelled = True
    assert finish_reason(live, 0, max_context=100) is FinishReason.CANCELLED
    live = Live(_req(max_tokens=3), "i1", output=[5, 6, 7])
    assert finish_reason(live, 7, max_context=100) is FinishReason.LENGTH
    live = Live(_req(max_tokens=30), "i1", output=[5])  # 3 prompt + 1 output tokens fill it
    assert finish_reason(live, 5, max_context=4) is FinishReason.LENGTH


def test_the_deadline_rule_and_overdue_requests():
    assert not past_deadline(Live(_req(), "i1"), now=1e12)  # 0: no deadline
    late = Live(_req(deadline=100.0), "i1")
    assert past_deadline(late, now=101.0) and not past_deadline(late, now=99.0)
    book = RequestBook()
    book.live["r"] = late
    book.live["s"] = Live(_req("s"), "i1")
    assert book.overdue(101.0) == [late]


def test_status_and_a_bounded_memory_of_past_requests():
    book = RequestBook()
    book.live["r"] = Live(_req(attempt=1), "i1", output=[4, 5])
    assert book.status("r").reason == RequestState.RUNNING.value
    assert book.status("r").generated == 2
    assert book.status("r", attempt=2).reason == RequestState.UNKNOWN.value
    for k in range(RECENT_LEN + 1):
        book.remember(Live(_req(f"p{k}"), "i1"), RequestState.MOVED)
    assert len(book.recent) == RECENT_LEN and "p0" not in book.recent
    assert book.status(f"p{RECENT_LEN}").reason == RequestState.MOVED.value


def test_prompt_logprobs_are_asked_of_the_first_prefill_only():
    """echo's prompt logprobs ride the first output token: a request resumed or migrated with
    output already had them sent, and its re-prefill does not compute them again."""
    req = _req(prompt_logprobs=3)
    assert sampling_params(req, 0).prompt_logprobs == 3
    assert sampling_params(req, 2).prompt_logprobs is None
    assert sampling_params(_req(), 0).prompt_logprobs is None
