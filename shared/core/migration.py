"""Token-based multi-round live migration (after ServerlessLLM §5), as pure decisions.

A request R moves from a source node A to a destination B while A keeps decoding it:

- BEGIN: A sends B the prompt and the tokens R produced so far; B admits R (loading the model if
  it must), computes their KV cache with one prefill and streams nothing.
- rounds: A sends the tokens it produced meanwhile; B computes their KV in one pass (a chunk far
  shorter than the first, so each round is shorter than the one before).
- COMMIT: once B lacks only a few tokens (or the rounds are used up), A stops R between two
  iterations and sends the last delta; B computes it, streams the next token with the next
  sequence number and decodes on. The client sees no gap and no duplicate.

Any refusal or failure before B accepts the commit leaves R where it was: A keeps decoding it
(before the commit) or puts it back in its batch (a refused commit). Time is passed in; the
node's migration parts (services/node/migration_source.py, migration_destination.py) only
carry out these decisions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.core.types import InstanceStatus, NodeView


# Engines a running request can move live on: the destination must take the tokens so far in
# one pass over the new ones (`extend`) and continue exactly where the source was. The torch
# engine does. OpenVINO GenAI's pipeline cannot extend a request: each catch-up round would
# recompute the whole context, and at the engine's default precision on CPU (bf16 compute, a
# compressed KV cache) a recomputed KV cache is not the one decoding wrote: greedy output
# recomputed after 20 tokens diverged from the unmigrated output 11 tokens later (identical in
# float32). The vLLM adapter has no extend either. Their requests are refused (they stay where
# they run; a preemption moves them stop-and-resume).
LIVE_ENGINES = frozenset({"torch"})


def engine_refusal(engine: str) -> str | None:
    """Why a request on `engine` cannot migrate live (None: it can)."""
    if engine in LIVE_ENGINES:
        return None
    return (f"the {engine} engine cannot take a running request's tokens so far (no extend; a "
            "recompute at its precision does not continue the same output)")


class Next(str, enum.Enum):
    ROUND = "round"  # send B the tokens produced since the last round; A keeps decoding
    COMMIT = "commit"  # stop R on A, send the last delta; B takes over
    ABORT = "abort"  # R ended (or was cancelled) on A meanwhile: B forgets it


@dataclass(frozen=True)
class MigrationPolicy:
    # A stops R once B lacks at most this many tokens: the pause is then one short extend.
    commit_delta: int = 2
    max_rounds: int = 4  # catch-up rounds after BEGIN; then commit whatever is left
    begin_timeout_s: float = 120.0  # B may load the model and prefill a long context
    round_timeout_s: float = 30.0
    # A drain tries again this often while a request it could not move runs on: no other node
    # may be in the view yet (one just healed from a network cut) or have room right now.
    drain_retry_s: float = 1.0


def next_step(policy: MigrationPolicy, rounds: int, lacking: int, ended: bool) -> Next:
    """What A does after B confirmed a round: `lacking` tokens A produced that B has not seen."""
    if ended:
        return Next.ABORT
    if lacking <= policy.commit_delta or rounds >= policy.max_rounds:
        return Next.COMMIT
    return Next.ROUND


@dataclass
class MigrationLog:
    """One migration as it happened (source side): for metrics, tests and the benchmark."""

    request_id: str
    source: str
    destination: str
    started: float
    context_tokens: int = 0  # prompt + output B prefilled at BEGIN
    rounds: list[tuple[int, float]] = field(default_factory=list)  # (tokens sent, seconds)
    begin_s: float = 0.0  # BEGIN's round trip: B's admission, load if any, and first prefill
    stopped_at: float = 0.0  # A stopped R (its last token was already out)
    committed_at: float = 0.0  # B accepted the commit (its first token is out)
    ok: bool = False
    reason: str = ""  # why it ended this way (B's refusal, an abort, "moved")
    unmovable: bool = False  # A refused it itself (its engine, an embedding): no try would do

    @property
    def total_s(self) -> float:
        end = self.committed_at or self.stopped_at or self.started
        return max(0.0, end - self.started)

    @property
    def commit_s(self) -> float:
        """How long R was stopped on A before B took it (the pause, minus message delivery)."""
        return max(0.0, self.committed_at - self.stopped_at) if self.committed_at else 0.0


def choose_destination(nodes: list[NodeView], model: str, source: str) -> tuple[str, str | None] | None:
    """Where to move a request of `model` off `source`: a node (not the source, not draining)
    with a ready instance of the model, the one with the most free memory first; else the node
    with the most free memory (it loads the model). B's own admission check has the last word."""
    others = [n for n in nodes if n.node_id != source and not n.draining]
    warm = [(n, i) for n in others for i in n.instances
            if i.model.name == model and i.status is InstanceStatus.READY]
    if warm:
        node, inst = max(warm, key=lambda ni: (_free(ni[0]), ni[0].node_id))
        return node.node_id, inst.instance_id
    if not others:
        return None
    node = max(others, key=lambda n: (_free(n), n.node_id))
    return node.node_id, None


def _free(node: NodeView) -> int:
    return node.memory_bytes - max(node.budget_bytes, node.pessimistic_bytes)
