"""The gateway's watchdog over one request's token stream: what to do when the stream goes quiet.

The gateway holds every token it streamed, so when the node serving a request is lost it can put
the request back on the request stream with those tokens (`resumed_token_ids`) and keep
streaming from the next one: the client sees no gap and no duplicate. This module is the pure
decision (no I/O, time passed in); `backend.TokenStream` does the asking and the acting.

Rules, checked when no token message of the current attempt arrived for `quiet_s`:

- The node is not known (nothing announced it since the request was submitted or resumed, or its
  node said it handed the request back): the request is with the placers, in a durable stream
  that a restarted placer replays. A placer that ended it (dropped, failed) kept its answer in
  Redis (`shared.outcomes`), since its message may have been lost: FINISH with it. Else WAIT.
- Ask the node (a STATUS request-reply on its command subject):
  - RUNNING: it has the request (waiting for an instance, or its messages were lost while NATS
    restarted: its final message carries the whole output). WAIT.
  - FINISHED: its final message was lost (a NATS restart); the answer carries it. FINISH.
  - MOVED: it handed the request back to the placers. Forget the node, WAIT.
  - UNKNOWN: the node restarted (same id) and lost it. RESUME.
  - No answer: the cluster view decides. The node's snapshot expired (no heartbeat for its TTL,
    12 heartbeats = 3 s by default, shorter than `quiet_s`): it is dead. RESUME. The snapshot is
    still there (alive by its heartbeats, e.g. reconnecting to NATS) or Redis cannot say: WAIT.
- A request resumed `max_resumes` times already: FAIL with a clear error instead.

Every check restarts the quiet clock, so a node is asked at most once per `quiet_s`. The request's
deadline (the gateway's timeout) bounds all of it: a request that keeps waiting ends with 504.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.schemas import RequestState, TokenMessage


@dataclass(frozen=True)
class WatchdogConfig:
    # No token message for this long: look at the node. Above the node heartbeat TTL (3 s by
    # default) so that a dead node is already out of the cluster view when it is looked at.
    quiet_s: float = 5.0
    probe_timeout_s: float = 2.0  # a STATUS request unanswered this long counts as no answer
    max_resumes: int = 3  # resumes of one request; then it fails


class Verdict(enum.Enum):
    WAIT = "wait"
    FINISH = "finish"  # feed the node's final message (it was lost on the way)
    RESUME = "resume"  # republish with the tokens streamed so far, as the next attempt
    FAIL = "fail"  # give up with an error


@dataclass(frozen=True)
class Probe:
    """What the stream learned about its node: the node's STATUS answer (None: no answer), and,
    without one, whether its snapshot is in the cluster view (None: Redis cannot say)."""

    state: RequestState | None
    in_view: bool | None = None
    final: TokenMessage | None = None  # FINISHED: the node's final message


@dataclass
class Watch:
    """One request's watchdog state. Times are monotonic seconds."""

    config: WatchdogConfig
    last_heard: float  # last token message of the current attempt (or submission, or last check)
    node_id: str | None = None  # the node that last announced or streamed the current attempt
    resumes: int = 0

    def heard(self, now: float, node_id: str | None) -> None:
        self.last_heard = now
        if node_id is not None:
            self.node_id = node_id

    def due_in(self, now: float) -> float:
        """Seconds until the next check (0: due now)."""
        return max(0.0, self.last_heard + self.config.quiet_s - now)

    def needs_probe(self) -> bool:
        """A check asks the node only when there is one to ask."""
        return self.node_id is not None

    def judge(self, now: float, probe: Probe | None) -> Verdict:
        """The verdict of a due check (`probe` None: there was no node to ask and no placer's
        answer; with no node, a probe is the placer's kept answer)."""
        self.last_heard = now
        if probe is not None and probe.state is RequestState.FINISHED and probe.final is not None:
            return Verdict.FINISH
        if probe is None or self.node_id is None:
            return Verdict.WAIT
        if probe.state is RequestState.RUNNING:
            return Verdict.WAIT
        if probe.state is RequestState.FINISHED:
            return Verdict.FINISH
        if probe.state is RequestState.MOVED:
            self.node_id = None  # back with the placers; the next node announces itself
            return Verdict.WAIT
        lost = probe.state is RequestState.UNKNOWN or probe.in_view is False
        if not lost:
            return Verdict.WAIT
        return Verdict.RESUME if self.resumes < self.config.max_resumes else Verdict.FAIL

    def resumed(self, now: float) -> None:
        """The request is back on the request stream as the next attempt."""
        self.resumes += 1
        self.node_id = None
        self.last_heard = now
