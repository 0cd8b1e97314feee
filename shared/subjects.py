"""Every NATS subject, JetStream stream and Redis key that slinfer uses, in one place.

Services never spell a subject or key inline: they call these helpers, so a rename is one edit
and a reader can see the whole wire surface on one screen.
"""

from __future__ import annotations

# --- JetStream: the request stream -------------------------------------------------------------
# The gateway publishes every accepted request here with Nats-Msg-Id = request_id, so a retried
# publish is deduplicated by the server. Placers consume it through one durable pull consumer:
# a placer restart resumes where it left off and loses nothing.
REQUEST_STREAM = "SLINFER_REQUESTS"
REQUEST_SUBJECT = "slinfer.requests"
PLACER_DURABLE = "placer"
REQUEST_DEDUP_WINDOW_S = 120.0

# --- JetStream: the reservation-station stream ------------------------------------------------
# Node workers publish each completed memory operation (load, unload, KV scale) here; the node's
# reservation station consumes its own subject to release parked scale-ups.
MEMOP_STREAM = "SLINFER_MEMOPS"
MEMOP_SUBJECT_PREFIX = "slinfer.memops"


def memop_subject(node_id: str) -> str:
    return f"{MEMOP_SUBJECT_PREFIX}.{node_id}"


# --- core NATS ----------------------------------------------------------------------------------
def node_command_subject(node_id: str) -> str:
    """Request-reply subject on which a node worker takes admissions and preemptions."""
    return f"slinfer.node.{node_id}.cmd"


def token_subject(request_id: str) -> str:
    """Per-request subject on which the owning node streams tokens back to the gateway."""
    return f"slinfer.tokens.{request_id}"


# Broadcast: a cancelled request (client gone) is dropped wherever it is, placer queue or node.
# The stream below keeps every cancel too, so a placer that was down when it was sent replays it
# at start and never places a request its client gave up on.
CANCEL_SUBJECT = "slinfer.cancel"
CANCEL_STREAM = "SLINFER_CANCELS"

# The warm fast path: a gateway sends a request for a warm instance straight to its node, which
# tells the placers what it admitted here (`DirectAdmission`). One placer of the queue group takes
# each note, as one placer takes each request of the stream.
DIRECT_ADMITTED_SUBJECT = "slinfer.admitted.direct"
PLACER_QUEUE_GROUP = "placers"

# Broadcast, empty: a gateway's admin API changed the registry; every gateway forgets the records
# it kept for requests (services/gateway/record_cache.py).
REGISTRY_CHANGED_SUBJECT = "slinfer.registry.changed"

# --- Redis ----------------------------------------------------------------------------------------
NODES_SET = "slinfer:nodes"
MODELS_HASH = "slinfer:models"  # field = model name, value = msgpack ModelRecord
# Model aliases: field = the alias's id (`registry.model_id(alias, owner)`, the owner being its
# model's), value = the registry id of the model it serves
ALIASES_HASH = "slinfer:aliases"
PROFILES_HASH = "slinfer:profiles"  # field = "<model>|<hardware kind>", value = JSON profile
# Online calibration: field = "<model>|<hardware kind>|<node id>", value = JSON
# {"prefill": factor, "decode": factor, "updated": unix seconds}
CALIBRATION_HASH = "slinfer:calibration"
# A random value written once into a Redis that holds slinfer's durable state (first start, or
# after a restore). Nothing deletes it: if it is missing or changed, Redis lost its data (restarted
# without its append-only file), and a placer that remembers the registry and the profiles
# writes them back (services/placer/keeper.py).
STATE_EPOCH_KEY = "slinfer:epoch"
# A placer's terminal answer to a request (dropped, failed), kept for a while beside the
# core-NATS message that may be lost (a NATS restart): value = msgpack TokenMessage, with a TTL.
OUTCOME_KEY_PREFIX = "slinfer:outcome"
# A request-stream message a placer answered (placed, failed, given up): value = the request id,
# with a TTL. A redelivery of it (its ack was lost) is acked, not placed a second time.
ANSWERED_KEY_PREFIX = "slinfer:answered"


def outcome_key(request_id: str, attempt: int) -> str:
    return f"{OUTCOME_KEY_PREFIX}:{request_id}:{attempt}"


def answered_key(stream_seq: int) -> str:
    return f"{ANSWERED_KEY_PREFIX}:{stream_seq}"


def node_key(node_id: str) -> str:
    """msgpack NodeSnapshot of one node worker; expires unless the heartbeat refreshes it."""
    return f"slinfer:node:{node_id}"


def profile_field(model: str, hardware: str) -> str:
    return f"{model}|{hardware}"


def pin_lease_key(model: str) -> str:
    """Held (SET NX with a TTL) by the placer that starts a pinned model's missing instance, so
    placers sharing the cluster do not each start one (services/placer/pinning.py)."""
    return f"slinfer:pin:{model}"


def calibration_field(model: str, hardware: str, node_id: str) -> str:
    return f"{model}|{hardware}|{node_id}"


# --- model lifecycle: profiling jobs and states ---------------------------------------------------
# Registration publishes one job per hardware kind; profiler services of that kind take them
# (work queue). Each model's lifecycle state is a JSON in MODEL_STATE_HASH (shared.model_state).
JOB_STREAM = "SLINFER_JOBS"
MODEL_STATE_HASH = "slinfer:model_state"


def job_subject(hardware: str) -> str:
    return f"slinfer.jobs.profile.{hardware}"


# --- model multicast (λScale §4, services/node/multicast.py) -----------------------------------
# NATS carries only the control of a multicast (offer, prepare, plan, go, abort, finish: request-
# reply to each node's endpoint; progress and failures: events to the coordinator); the weights
# travel over direct TCP connections between the nodes.
def multicast_node_subject(node_id: str) -> str:
    """Request-reply subject of a node's multicast endpoint."""
    return f"slinfer.multicast.node.{node_id}"


def multicast_events_subject(transfer_id: str) -> str:
    """Where the nodes of one multicast report block arrivals, completion and lost peers."""
    return f"slinfer.multicast.events.{transfer_id}"


# --- artifact pre-loading (ServerlessLoRA §4.1) --------------------------------------------------
def preload_subject(node_id: str) -> str:
    """Where the placer sends a node the cluster's pre-loading plan for it (fire and forget: a
    node that misses one plans from its own rates until the next arrives)."""
    return f"slinfer.preload.node.{node_id}"
