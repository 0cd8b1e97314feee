"""Carry out one model multicast (λScale §4.2) across node endpoints (`services.node.multicast`),
from any process with a NATS connection (a placer, a test, a benchmark):

    report = await multicast(nc, model_path, source="n0", destinations=["n1", "n2", "n3"])
    report = await multicast(nc, model_path, source=["n0", "n1"], destinations=[...])  # k-way

The steps, all over NATS request-reply to each endpoint:
1. offer: each source puts the model in host memory and answers its manifest (blocks, CRCs);
   a source that cannot, or whose manifest differs from the first one's, is left out.
2. prepare: every destination takes buffers for it and answers its TCP address (a destination
   that cannot is left out, with its reason).
3. plan + go: the binomial pipeline over the source and the prepared destinations
   (`shared.core.multicast.binomial_schedule`: node 0 is the source, b + ceil(log2 n) - 1 steps);
   with k sources, one pipeline per sub-group in Algorithm 1's shifted block order
   (`kway_schedule`). Each node is told its own sends and receives; then everyone starts.
4. events: each node reports every verified block and when it holds the whole model (registered
   in its loader's DRAM tier). A node that reports a peer lost (connection ended early, refused,
   never opened) ends the epoch: every survivor is told to abort (and answers what it holds), the
   lost peer is out, any survivor missing a block that only lost nodes held fails, and the rest
   get a repair plan (`repair_schedule`) as the next epoch.
5. finish: every node that took part forgets the transfer.

Nothing waits without a bound: requests have `control_timeout_s`, the whole multicast `timeout_s`
(its incomplete nodes then fail with that reason). Times in the report are this process's clock
at the event's arrival, from the call's start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from shared.core.multicast import (DEFAULT_BLOCKS, Block, Transfer, kway_schedule,
                                   repair_schedule, steps_of)
from shared.core.multicast import head_first as head_first_blocks
from shared.core.pipeline import layer_index
from shared.subjects import multicast_events_subject, multicast_node_subject

log = logging.getLogger("slinfer.multicast")


class MulticastFailed(RuntimeError):
    """The multicast could not start (no source can offer the model)."""


@dataclass(frozen=True)
class NodeOutcome:
    node: str
    ok: bool  # holds the whole model, every block verified
    seconds: float | None  # from the call's start until it held the model (None: it never did)
    registered: bool  # the checkpoint is in the node's DRAM tier (a load there is a DRAM hit)
    error: str | None  # why it failed (None when ok)
    block_seconds: dict[int, float] = field(default_factory=dict)  # block -> arrival time
    block_sources: dict[int, str] = field(default_factory=dict)  # block -> the node it came from


@dataclass(frozen=True)
class MulticastReport:
    transfer: str
    model_path: str
    source: str  # the first source
    blocks: int
    bytes: int  # the checkpoint's bytes (what each destination receives)
    planned_steps: int  # steps of the first plan (the binomial pipeline)
    epochs: int  # 1 when nothing failed; one more per repair
    prepare_seconds: float  # offer + prepare + first plan, before any byte moved
    seconds: float  # from the call's start until the last destination held the model or failed
    destinations: tuple[NodeOutcome, ...]
    sources: tuple[str, ...] = ()  # the sources that took part (k-way: several)
    epoch_seconds: tuple[float, ...] = ()  # when each epoch's go was answered by every node
    source_errors: dict[str, str] = field(default_factory=dict)  # sources left out, why

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.destinations)

    @property
    def failed(self) -> dict[str, str]:
        return {d.node: d.error or "" for d in self.destinations if not d.ok}

    def to_dict(self) -> dict:
        return {"transfer": self.transfer, "model_path": self.model_path, "source": self.source,
                "sources": list(self.sources), "source_errors": self.source_errors,
                "blocks": self.blocks, "bytes": self.bytes, "planned_steps": self.planned_steps,
                "epochs": self.epochs, "prepare_seconds": round(self.prepare_seconds, 4),
                "epoch_seconds": [round(t, 4) for t in self.epoch_seconds],
                "seconds": round(self.seconds, 4),
                "destinations": [{"node": d.node, "ok": d.ok, "seconds": d.seconds,
                                  "registered": d.registered, "error": d.error,
                                  "block_seconds": d.block_seconds,
                                  "block_sources": d.block_sources}
                                 for d in self.destinations]}


async def multicast(nc, model_path: str, source: str | list[str], destinations: list[str], *,
                    blocks: int = DEFAULT_BLOCKS, timeout_s: float = 600.0,
                    control_timeout_s: float = 30.0,
                    rate_bytes_per_s: float | None = None,
                    head_first: bool = False) -> MulticastReport:
    """Send the model held by `source` (one node, or several for λScale's k-way transfer) to
    every node of `destinations` (see the module doc). `rate_bytes_per_s` caps each sending
    connection (None: the endpoints' own setting, by default unpaced). `head_first`: every
    sub-group receives the blocks of the model's head (embeddings, final norm, LM head) first,
    so a destination can head an execution pipeline early (execute-while-load). Raises
    MulticastFailed only when no source can offer it; a destination's failure is in its
    NodeOutcome."""
    sources = [source] if isinstance(source, str) else list(source)
    nodes = sources + list(destinations)
    if not sources or len(set(nodes)) != len(nodes):
        raise ValueError("need a source, and sources and destinations all distinct")
    run = _Run(nc, str(model_path), sources, list(destinations), blocks, timeout_s,
               control_timeout_s, rate_bytes_per_s)
    run.head_first = head_first
    return await run.execute()


def _head_blocks(manifest: dict) -> tuple[int, ...]:
    """The manifest's blocks holding any byte of a tensor that is not a decoder layer's."""
    from services.node.loader.checkpoint_format import CheckpointIndex

    index = CheckpointIndex.from_json(manifest["index"])
    spans = [(t.file, t.offset, t.offset + t.size) for t in index.tensors
             if layer_index(t.name) is None]
    return head_first_blocks([Block(i, f, a, b) for i, f, a, b, _, _ in manifest["blocks"]], spans)


class _Run:
    def __init__(self, nc, model_path: str, sources: list[str], destinations: list[str],
                 blocks: int,
                 timeout_s: float, control_timeout_s: float, rate_bytes_per_s: float | None
                 ) -> None:
        self.nc = nc
        self.model_path = model_path
        self.sources = sources
        self.source_errors: dict[str, str] = {}
        self.destinations = destinations
        self.requested_blocks = blocks
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.rate_bytes_per_s = rate_bytes_per_s
        # An endpoint forgets the transfer by itself this long after it joined (a coordinator
        # that died never sends finish).
        self.ttl_s = timeout_s + 2 * control_timeout_s
        self.id = uuid.uuid4().hex[:16]
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = 0.0
        self.deadline = 0.0
        self.addresses: dict[str, list] = {}
        self.alive: list[str] = []  # sources first (while they live), then destinations
        self.have: dict[str, set[int]] = {}
        self.failed: dict[str, str] = {}
        self.done_at: dict[str, float] = {}
        self.registered: dict[str, bool] = {}
        self.arrivals: dict[str, dict[int, float]] = {d: {} for d in destinations}
        self.senders: dict[str, dict[int, str]] = {d: {} for d in destinations}
        self.participants: list[str] = []  # everyone told about the transfer (for finish)
        self.nblocks = 0
        self.head_first = False
        self.first: tuple[int, ...] = ()  # blocks every sub-group sends first (the head's)

    def now(self) -> float:
        return time.perf_counter() - self.started

    async def execute(self) -> MulticastReport:
        self.started = time.perf_counter()
        self.deadline = self.started + self.timeout_s
        sub = await self.nc.subscribe(multicast_events_subject(self.id), cb=self._on_event)
        try:
            return await self._execute()
        finally:
            await sub.unsubscribe()
            live = [n for n in self.participants if n not in self.failed]
            await asyncio.gather(*(self._ask(n, {"op": "finish"}, quiet=True) for n in live),
                                 *(self._tell(n, {"op": "finish"}) for n in self.failed))

    async def _on_event(self, msg) -> None:
        try:
            self.events.put_nowait((self.now(), json.loads(msg.data)))
        except ValueError:
            pass

    async def _execute(self) -> MulticastReport:
        self.participants += self.sources
        offers = await asyncio.gather(*(self._ask(
            s, {"op": "offer", "model_path": self.model_path, "blocks": self.requested_blocks,
                "ttl_s": self.ttl_s}, timeout=self.timeout_s) for s in self.sources))
        manifest = None
        for src, offer in zip(self.sources, offers):
            if not offer.get("ok"):
                self.source_errors[src] = f"cannot offer {self.model_path}: {offer.get('error')}"
            elif manifest is not None and offer["manifest"] != manifest:
                self.source_errors[src] = "holds another checkpoint than the first source"
            else:
                manifest = manifest or offer["manifest"]
                self.addresses[src] = offer["address"]
        self.sources = [s for s in self.sources if s not in self.source_errors]
        if manifest is None:
            raise MulticastFailed("; ".join(f"source {s} {e}"
                                            for s, e in self.source_errors.items()))
        nblocks = len(manifest["blocks"])
        order = list(range(nblocks))
        self.nblocks = nblocks
        nbytes = sum(end - start for _, _, start, end, _, _ in manifest["blocks"])
        self.participants += self.destinations
        replies = await asyncio.gather(*(self._ask(d, {"op": "prepare", "manifest": manifest,
                                                       "ttl_s": self.ttl_s})
                                         for d in self.destinations))
        self.alive = list(self.sources)
        for dst, reply in zip(self.destinations, replies):
            if reply.get("ok"):
                self.addresses[dst] = reply["address"]
                self.alive.append(dst)
            else:
                self.failed[dst] = f"prepare failed: {reply.get('error')}"
        self.have = {n: set() for n in self.alive}
        for src in self.sources:
            self.have[src] = set(order)
        if self.head_first:
            self.first = _head_blocks(manifest)
        schedule = kway_schedule(len(self.alive), min(len(self.sources), len(self.alive)),
                                 nblocks, self.first)
        planned_steps = steps_of(schedule)
        epoch = 0
        prepare_seconds = None
        epoch_seconds: list[float] = []
        while True:
            lost = await self._start_epoch(epoch, schedule)
            epoch_seconds.append(self.now())
            if prepare_seconds is None:
                prepare_seconds = self.now()
            if lost is None:
                lost = await self._watch(epoch)
            if lost is None:
                break  # every survivor holds the model
            peer, reason = lost
            if peer == "*":  # the deadline: whoever is incomplete fails
                await self._abort(epoch)
                for n in self._incomplete():
                    self._fail(n, reason)
                break
            self._fail(peer, reason)
            await self._abort(epoch, also=[peer])  # a peer only suspected must stop too
            self._fail_orphans()
            if not self._incomplete():
                break
            epoch += 1
            schedule = repair_schedule([self.have[n] for n in self.alive], order)
        outcomes = tuple(NodeOutcome(
            d, d not in self.failed and d in self.done_at, self.done_at.get(d),
            self.registered.get(d, False),
            self.failed.get(d) or (None if d in self.done_at else "did not complete"),
            dict(sorted(self.arrivals[d].items())), dict(sorted(self.senders[d].items())))
            for d in self.destinations)
        return MulticastReport(
            self.id, self.model_path, self.sources[0], nblocks, nbytes, planned_steps, epoch + 1,
            prepare_seconds or 0.0, self.now(), outcomes, sources=tuple(self.sources),
            epoch_seconds=tuple(epoch_seconds), source_errors=dict(self.source_errors))

    async def _start_epoch(self, epoch: int, schedule: list[Transfer]
                           ) -> tuple[str, str] | None:
        """Plan and go on every live node; a node that does not take its part is lost."""
        nodes = list(self.alive)
        addresses = {n: self.addresses[n] for n in nodes}
        plans = {n: {"op": "plan", "epoch": epoch, "addresses": addresses, "sends": [],
                     "receives": [], "rate_bytes_per_s": self.rate_bytes_per_s} for n in nodes}
        for t in schedule:
            src, dst = nodes[t.src], nodes[t.dst]
            plans[src]["sends"].append([t.step, dst, t.block])
            plans[dst]["receives"].append([t.step, src, t.block])
        for op in ("plan", "go"):
            bodies = [plans[n] if op == "plan" else {"op": "go", "epoch": epoch} for n in nodes]
            replies = await asyncio.gather(*(self._ask(n, b) for n, b in zip(nodes, bodies)))
            for n, reply in zip(nodes, replies):
                if not reply.get("ok"):
                    return n, f"{n} did not take its part of epoch {epoch}: {reply.get('error')}"
        return None

    async def _watch(self, epoch: int) -> tuple[str, str] | None:
        """Events until every live node holds the model (None), or a lost peer."""
        while self._incomplete():
            left = self.deadline - time.perf_counter()
            if left <= 0:
                return "*", f"the multicast did not finish within {self.timeout_s:g} s"
            try:
                at, event = await asyncio.wait_for(self.events.get(), left)
            except asyncio.TimeoutError:
                continue
            node, kind = event.get("node"), event.get("kind")
            if node not in self.have or node in self.failed:
                continue
            if kind == "block":
                self.have[node].add(event["block"])
                self._arrived(node, event, at)
            elif kind == "complete":
                self.done_at.setdefault(node, at)
                self.registered[node] = bool(event.get("registered"))
            elif kind == "suspect" and event.get("epoch") == epoch \
                    and event.get("peer") in self.alive:
                return event["peer"], f"lost during the transfer ({event.get('reason')})"
        return None

    async def _abort(self, epoch: int, also: list[str] = ()) -> None:
        """Stop the epoch on every live node (and on `also`, quietly); the live nodes' answers
        say what they hold."""
        nodes = list(self.alive)
        for n in also:
            await self._tell(n, {"op": "abort", "epoch": epoch})
        replies = await asyncio.gather(*(self._ask(n, {"op": "abort", "epoch": epoch})
                                         for n in nodes))
        for n, reply in zip(nodes, replies):
            if not reply.get("ok"):
                self._fail(n, f"did not answer the abort of epoch {epoch}: {reply.get('error')}")
                continue
            self.have[n] = set(reply["have"])
            if reply.get("complete") and n not in self.sources:
                self.done_at.setdefault(n, self.now())
                self.registered[n] = bool(reply.get("registered"))
        while not self.events.empty():  # events of the stopped epoch: blocks and completions count
            at, event = self.events.get_nowait()
            node = event.get("node")
            if node in self.have and node not in self.failed and event.get("kind") == "complete":
                self.done_at.setdefault(node, at)
                self.registered[node] = bool(event.get("registered"))
            elif node in self.arrivals and event.get("kind") == "block":
                self._arrived(node, event, at)

    def _arrived(self, node: str, event: dict, at: float) -> None:
        if node in self.arrivals and event["block"] not in self.arrivals[node]:
            self.arrivals[node][event["block"]] = at
            self.senders[node][event["block"]] = event.get("src")

    def _fail(self, node: str, reason: str) -> None:
        if node in self.alive:
            self.alive.remove(node)
        self.failed.setdefault(node, reason)
        self.done_at.pop(node, None)

    def _fail_orphans(self) -> None:
        """Survivors missing a block that no survivor holds cannot complete."""
        held = set().union(*(self.have[n] for n in self.alive)) if self.alive else set()
        lost = sorted(self.failed)
        for n in list(self.alive):
            missing = sorted(b for b in range(self.nblocks) if b not in self.have[n]
                             and b not in held)
            if missing:
                holders = [x for x in lost if self.have.get(x, set()) & set(missing)]
                self._fail(n, f"blocks {missing} were held only by lost nodes "
                              f"({', '.join(holders)})")

    def _incomplete(self) -> list[str]:
        return [n for n in self.alive if n not in self.sources and n not in self.done_at]

    async def _tell(self, node: str, body: dict) -> None:
        """A message that wants no answer: to a node that is lost, or only suspected. A request
        could wait out its whole timeout (NATS may not have noticed yet that the node's
        connection is gone, and routes the request to it)."""
        try:
            await self.nc.publish(multicast_node_subject(node),
                                  json.dumps({**body, "transfer": self.id}).encode())
        except Exception as exc:
            log.info("multicast %s: %s to %s not sent: %r", self.id, body["op"], node, exc)

    async def _ask(self, node: str, body: dict, timeout: float | None = None,
                   quiet: bool = False) -> dict:
        body = {**body, "transfer": self.id}
        asked = time.perf_counter()
        try:
            msg = await self.nc.request(multicast_node_subject(node), json.dumps(body).encode(),
                                        timeout=timeout or self.control_timeout_s)
            return json.loads(msg.data)
        except Exception as exc:  # no endpoint (gone), a timeout, a broken reply
            log.info("multicast %s: %s to %s failed after %.2f s: %r", self.id, body["op"],
                     node, time.perf_counter() - asked, exc)
            if quiet:
                return {"ok": False}
            return {"ok": False, "error": f"no answer from {node}'s multicast endpoint "
                                          f"({type(exc).__name__}: {exc})"}
