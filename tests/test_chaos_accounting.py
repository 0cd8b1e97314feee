"""The chaos soak's judge (bench/chaos.py): each answer a client can get maps to one outcome, and
the must-be-zero ones (lost, answered twice, hung, wrong) are told apart from what a fault
legitimately causes (a clear error, a request cut by a gateway kill)."""

from __future__ import annotations

from bench.chaos import Spec, generating, judge
from bench.traffic import DONE, Answer

REF = ["a", "b", "c", "d", "e", "f"]
REFS = {("m", False, 0): REF, ("m", True, 0): REF}
GATEWAY_DOWN = [(100.0, 110.0)]


def spec(stream: bool = True, chat: bool = False, n: int = 4) -> Spec:
    return generating("stream" if stream else "plain", "m", "hello", 0, n, chat, stream)


def chunk(tokens: list[str], finish: str | None = None) -> dict:
    return {"choices": [{"text": "".join(tokens), "finish_reason": finish,
                         "logprobs": {"tokens": tokens}}]}


def usage(n: int) -> dict:
    return {"choices": [], "usage": {"completion_tokens": n}}


def streamed(*events, started: float = 10.0, ended: float = 12.0, **kw) -> Answer:
    return Answer("stream", True, started, ended, status=200, events=list(events), **kw)


def test_a_whole_stream_is_completed():
    a = streamed(chunk(["a", "b"]), chunk(["c"]), chunk(["d"], "length"), usage(4), DONE)
    assert judge(spec(), a, REFS, []) == ("completed", "")


def test_two_terminal_events_or_anything_after_done_is_answered_twice():
    twice = [streamed(chunk(["a", "b", "c", "d"], "length"), chunk([], "length"), usage(4), DONE),
             streamed(chunk(["a", "b", "c", "d"], "length"), {"error": {"code": "x"}}, DONE),
             streamed(chunk(["a", "b", "c", "d"], "length"), usage(4), DONE, DONE),
             streamed(chunk(["a", "b", "c", "d"], "length"), usage(4), DONE, chunk(["e"]))]
    for a in twice:
        assert judge(spec(), a, REFS, [])[0] == "answered_twice", a.events


def test_a_duplicated_token_is_answered_twice_and_a_gap_is_wrong():
    dup = streamed(chunk(["a", "b"]), chunk(["b", "c", "d"], "length"), usage(4), DONE)
    assert judge(spec(), dup, REFS, [])[0] == "answered_twice"
    gap = streamed(chunk(["a", "c"]), chunk(["d", "e"], "length"), usage(4), DONE)
    assert judge(spec(), gap, REFS, [])[0] == "wrong"
    short = streamed(chunk(["a", "b", "c"], "length"), usage(3), DONE)
    assert judge(spec(), short, REFS, [])[0] == "wrong"


def test_a_stream_cut_short_is_lost_unless_the_gateway_was_killed_meanwhile():
    cut = streamed(chunk(["a", "b"]), started=95.0, ended=101.0)
    assert judge(spec(), cut, REFS, [])[0] == "lost"
    assert judge(spec(), cut, REFS, GATEWAY_DOWN)[0] == "cut_by_gateway_kill"
    broken = streamed(chunk(["a"]), started=50.0, ended=51.0, error="ReadError: reset")
    assert judge(spec(), broken, REFS, GATEWAY_DOWN)[0] == "lost"


def test_no_connection_is_refused_while_the_gateway_is_down_and_lost_otherwise():
    refused = Answer("plain", False, 105.0, 105.1, error="ConnectError: refused")
    assert judge(spec(stream=False), refused, REFS, GATEWAY_DOWN)[0] == "refused_gateway_down"
    assert judge(spec(stream=False), refused, REFS, [])[0] == "lost"


def test_an_error_event_or_status_is_a_clear_error_and_a_timeout_is_hung():
    event = streamed(chunk(["a"]), {"error": {"code": "node_lost", "message": "m"}}, DONE)
    assert judge(spec(), event, REFS, []) == ("clear_error", "event node_lost")
    status = Answer("plain", False, 1.0, 2.0, status=503, body={"error": {"code": "overloaded"}})
    assert judge(spec(stream=False), status, REFS, []) == ("clear_error", "503 overloaded")
    hung = Answer("plain", False, 1.0, 91.0, error="TimeoutError: no end", timed_out=True)
    assert judge(spec(stream=False), hung, REFS, GATEWAY_DOWN)[0] == "hung"


def test_bad_bodies_are_rejected_and_accepting_one_is_wrong():
    bad = Spec("bad", "/v1/completions", b"{", stream=False)
    rejected = Answer("bad", False, 1.0, 1.1, status=400, body={"error": {"type": "invalid"}})
    assert judge(bad, rejected, REFS, []) == ("rejected", "400 invalid")
    accepted = Answer("bad", False, 1.0, 1.1, status=200, body={"choices": []})
    assert judge(bad, accepted, REFS, [])[0] == "wrong"


def test_a_whole_chat_answer_is_checked_against_the_reference():
    body = {"choices": [{"message": {"content": "abcd"}, "finish_reason": "length",
                         "logprobs": {"content": [{"token": t} for t in "abcd"]}}],
            "usage": {"completion_tokens": 4}}
    whole = Answer("chat", False, 1.0, 2.0, status=200, body=body)
    assert judge(spec(stream=False, chat=True), whole, REFS, []) == ("completed", "")
    body["choices"][0]["logprobs"]["content"][1]["token"] = "x"
    assert judge(spec(stream=False, chat=True), whole, REFS, [])[0] == "wrong"
