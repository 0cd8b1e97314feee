"""The watchdog's rules (services/gateway/watchdog.py), as a pure function of what it is told:
no clock, no NATS. The real thing is exercised in tests/faults."""

from __future__ import annotations

from services.gateway.watchdog import Probe, Verdict, Watch, WatchdogConfig
from shared.schemas import RequestState, TokenMessage

CFG = WatchdogConfig(quiet_s=5.0, max_resumes=2)


def _watch(node: str | None = "node-0") -> Watch:
    w = Watch(CFG, last_heard=100.0)
    w.heard(100.0, node)
    return w


def test_due_only_after_a_quiet_period_and_every_message_restarts_it():
    w = _watch()
    assert w.due_in(101.0) == 4.0
    w.heard(103.0, None)  # a message without a node id keeps the node known
    assert w.due_in(104.0) == 4.0 and w.node_id == "node-0"
    assert w.due_in(108.0) == 0.0


def test_no_node_known_means_the_placers_have_it_wait():
    w = _watch(node=None)
    assert not w.needs_probe()
    assert w.judge(105.0, None) is Verdict.WAIT
    assert w.due_in(105.0) == CFG.quiet_s  # the check restarted the quiet clock


def test_node_answers_running_finished_moved():
    w = _watch()
    assert w.judge(105.0, Probe(RequestState.RUNNING)) is Verdict.WAIT
    final = TokenMessage("r", 3, [], finished=True, output_token_ids=[1, 2, 3])
    assert w.judge(110.0, Probe(RequestState.FINISHED, final=final)) is Verdict.FINISH
    assert w.judge(115.0, Probe(RequestState.MOVED)) is Verdict.WAIT
    assert w.node_id is None  # handed back: the next node announces itself
    assert w.resumes == 0


def test_unknown_to_its_node_is_resumed():
    w = _watch()
    assert w.judge(105.0, Probe(RequestState.UNKNOWN)) is Verdict.RESUME


def test_no_answer_resumes_only_when_the_node_left_the_cluster_view():
    w = _watch()
    assert w.judge(105.0, Probe(None, in_view=True)) is Verdict.WAIT  # alive by its heartbeat
    assert w.judge(110.0, Probe(None, in_view=None)) is Verdict.WAIT  # Redis cannot say
    assert w.judge(115.0, Probe(None, in_view=False)) is Verdict.RESUME
    w.resumed(115.0)
    assert w.node_id is None and w.resumes == 1 and w.due_in(115.0) == CFG.quiet_s


def test_resumes_are_bounded_then_it_fails():
    w = _watch()
    for k in range(CFG.max_resumes):
        assert w.judge(100.0 + 10 * k, Probe(None, in_view=False)) is Verdict.RESUME
        w.resumed(100.0 + 10 * k)
        w.heard(101.0 + 10 * k, f"node-{k + 1}")
    assert w.judge(200.0, Probe(None, in_view=False)) is Verdict.FAIL


def test_no_node_known_but_the_placer_kept_its_answer_finishes_with_it():
    """A placer dropped the request and its message was lost (NATS restarting): its answer,
    kept in Redis, ends the stream instead of a wait until the deadline."""
    w = _watch(node=None)
    final = TokenMessage("r", 0, [], finished=True, error="no node can meet the TTFT")
    assert w.judge(105.0, Probe(RequestState.FINISHED, final=final)) is Verdict.FINISH
    assert w.judge(110.0, Probe(RequestState.FINISHED)) is Verdict.WAIT  # an answer carries the message
