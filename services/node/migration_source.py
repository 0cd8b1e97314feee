"""Live migration, source side (the protocol and its pure decisions: shared/core/migration.py):
BEGIN, catch-up rounds while this node keeps decoding, then COMMIT. Until the destination accepts
the commit the request stays ours. Also MIGRATE (move these requests) and DRAIN (move them all
and take no new work).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace

from services.node.book import Live, RequestBook
from services.node.engines import resolve_engine
from services.node.lifecycle import RequestLifecycle
from services.node.runtime import NodeRuntime
from shared.cluster import read_nodes
from shared.core.admission import AdmitReason
from shared.core.migration import (MigrationLog, MigrationPolicy, Next, choose_destination,
                                   engine_refusal, next_step)
from shared.schemas import CommandKind, NodeCommand, NodeReply, RequestState

log = logging.getLogger("slinfer.node")
HISTORY_LEN = 4096
ABORT_TIMEOUT_S = 5.0


class MigrationSource:
    def __init__(self, rt: NodeRuntime, book: RequestBook, requests: RequestLifecycle,
                 publish_view: Callable[[], Awaitable[None]],
                 policy: MigrationPolicy | None = None) -> None:
        self.rt, self.book, self.requests = rt, book, requests
        self._publish_view = publish_view
        self.policy = policy or MigrationPolicy()
        self.migrations: deque[MigrationLog] = deque(maxlen=HISTORY_LEN)  # ended ones

    # --- commands -------------------------------------------------------------------------------
    def start_migrations(self, cmd: NodeCommand) -> NodeReply:
        """MIGRATE: move these requests live, each in its own task (the reply does not wait)."""
        started = [m for m in cmd.migrations
                   if m.request_id in self.book.live and m.request_id not in self.book.migrating]
        for m in started:
            self.rt.spawn(self.migrate_out(m.request_id, m.node_id, m.instance_id or None),
                          f"migrate-{m.request_id}")
        return NodeReply(bool(started), "migrating" if started else "not_here")

    def start_drain(self, cmd: NodeCommand | None = None) -> NodeReply:
        if not self.rt.draining:
            self.rt.draining = True
            self.rt.spawn(self._drain(), "drain")
        return NodeReply(True, "draining", generated=len(self.book.live))

    async def _drain(self) -> None:
        """Move every request off, each to the best node the cluster view shows then. A request
        no node takes now is tried again every `drain_retry_s` while it runs (the other nodes may
        be out of the view for a moment, or full); one that cannot move at all (its engine, an
        embedding) finishes here. Nothing is lost either way."""
        await self._publish_view()
        node_id = self.rt.s.node_id
        stuck: set[str] = set()  # requests that can never move: not tried again
        homeless: set[str] = set()  # requests a try found no destination for (recorded once)
        while not self.rt.stopping:
            todo = [rid for rid in self.book.live if rid not in self.book.migrating and rid not in stuck]
            if not todo:
                break
            for rid in todo:
                if not await self._drain_one(rid, node_id, homeless):
                    stuck.add(rid)
            if any(rid in self.book.live for rid in todo):
                await asyncio.sleep(self.policy.drain_retry_s)
        log.info("node %s drained: %d requests still finishing here", node_id, len(self.book.live))

    async def _drain_one(self, rid: str, node_id: str, homeless: set[str]) -> bool:
        """One try at moving `rid` off; False when no try ever can (the source refuses it). A
        try with nowhere to go is recorded for the request's first only (`homeless`): the
        retries every second would crowd the migration history out."""
        live = self.book.live.get(rid)
        if live is None or rid in self.book.migrating:
            return True
        try:
            nodes = await read_nodes(self.rt.redis)
        except Exception as exc:
            log.warning("drain: cluster view unavailable (%r); %s waits", exc, rid)
            return True
        dest = choose_destination(nodes, live.request.model, node_id)
        if dest is None:  # recorded, as a refused try is
            if rid not in homeless:
                homeless.add(rid)
                self.migrations.append(MigrationLog(rid, node_id, "", time.time(),
                                                    reason="no destination"))
                log.info("drain: no other node in the cluster view can take %s now; it runs "
                         "here and is tried again every %.1f s", rid, self.policy.drain_retry_s)
            return True
        moved = await self.migrate_out(rid, *dest)
        if dest[1] is not None and moved.reason == f"refused: {AdmitReason.INSTANCE_GONE.value}":
            # The view showed an instance its keep-alive has just reclaimed: that node loads
            # one for the request instead (a drain once gave up here).
            moved = await self.migrate_out(rid, dest[0], None)
        return not moved.unmovable

    # --- one migration ----------------------------------------------------------------------------
    async def migrate_out(self, rid: str, node_id: str, instance_id: str | None) -> MigrationLog:
        """Source side: BEGIN, catch-up rounds while this node keeps decoding, then COMMIT.
        Until the destination accepts the commit the request stays ours."""
        record = MigrationLog(rid, self.rt.s.node_id, node_id, time.time())
        live = self.book.live.get(rid)
        if live is None or rid in self.book.migrating or node_id == self.rt.s.node_id:
            record.reason = "not_here" if live is None else "busy_or_self"
            return record
        refusal = engine_refusal(resolve_engine(self.rt.records[live.instance_id].engine,
                                                self.rt.s.device))
        if live.request.embedding is not None:
            # Its whole work is one prefill, which a move would only run again over there.
            refusal = "an embedding request runs its prefill where it is"
        if refusal is not None:
            record.reason, record.unmovable = f"refused: {refusal}", True
            self.migrations.append(record)
            return record
        self.book.migrating.add(rid)
        try:
            record.reason = await self._rounds(live, node_id, instance_id, record)
        except Exception as exc:  # ours still: it runs on here
            log.exception("migration of %s to %s failed", rid, node_id)
            record.reason = f"error: {exc}"
            if self.book.live.get(rid) is None and not record.ok and rid in self.book.held:
                self._unhold(live, self.book.held.pop(rid))
        finally:
            self.book.migrating.discard(rid)
            self.migrations.append(record)
        with self.rt.obs.use(rid):
            log.info("migration of %s to %s: %s (%d rounds, %.3f s)", rid, node_id, record.reason,
                     len(record.rounds), record.total_s)
        return record

    async def _abort(self, node_id: str, rid: str) -> None:
        await self.rt.outbox.ask(node_id, NodeCommand(CommandKind.MIGRATE_ABORT, request_id=rid),
                                 ABORT_TIMEOUT_S)

    async def _rounds(self, live: Live, node_id: str, instance_id: str | None,
                      record: MigrationLog) -> str:
        policy, rid, outbox = self.policy, live.request.request_id, self.rt.outbox
        sent = len(live.output)
        begin = replace(live.request, resumed_token_ids=list(live.output),
                        trace_context=self.rt.obs.headers(rid) or live.request.trace_context)
        record.context_tokens = len(live.all_tokens)
        reply = await outbox.ask(node_id, NodeCommand(
            CommandKind.MIGRATE_BEGIN, request=begin, instance_id=instance_id,
            model=self.rt.records[live.instance_id]), policy.begin_timeout_s)
        record.begin_s = time.time() - record.started
        if reply is None or not reply.accepted:
            await self._abort(node_id, rid)
            return f"refused: {reply.reason if reply else 'no answer'}"
        while True:
            ended = self.book.live.get(rid) is not live or live.cancelled
            step = next_step(policy, len(record.rounds), len(live.output) - sent, ended)
            if step is Next.ABORT:
                await self._abort(node_id, rid)
                return "ended before the commit"
            if step is Next.COMMIT:
                break
            delta, t = live.output[sent:], time.time()
            reply = await outbox.ask(node_id, NodeCommand(
                CommandKind.MIGRATE_EXTEND, request_id=rid, tokens=delta, seq=sent),
                policy.round_timeout_s)
            if reply is None or not reply.accepted:
                await self._abort(node_id, rid)
                return f"round refused: {reply.reason if reply else 'no answer'}"
            record.rounds.append((len(delta), time.time() - t))
            sent += len(delta)
        return await self._commit(live, node_id, sent, record)

    async def _commit(self, live: Live, node_id: str, sent: int, record: MigrationLog) -> str:
        rid, outbox = live.request.request_id, self.rt.outbox
        async with self.rt.iter_lock:  # between two iterations: the last token is out
            if self.book.live.get(rid) is not live or live.cancelled:
                await self._abort(node_id, rid)
                return "ended before the commit"
            self.book.held[rid] = self._hold(live)
        record.stopped_at = time.time()
        reply = await outbox.ask(node_id, NodeCommand(
            CommandKind.MIGRATE_COMMIT, request_id=rid, tokens=live.output[sent:], seq=sent),
            self.policy.round_timeout_s)
        took = reply is not None and reply.accepted
        if reply is None:  # the answer may be what got lost: ask before running it here again
            status = await outbox.ask(node_id, NodeCommand(
                CommandKind.STATUS, request_id=rid, attempt=live.request.attempt), ABORT_TIMEOUT_S)
            took = status is not None and status.reason == RequestState.RUNNING.value
        view = self.book.held.pop(rid)
        if not took:
            # A cancel that came while it was held found it nowhere here; B saw it and said so.
            live.cancelled = live.cancelled or (reply is not None and reply.reason == "cancelled")
            self._unhold(live, view)
            await self._abort(node_id, rid)
            return f"commit refused: {reply.reason if reply else 'no answer'}"
        record.committed_at, record.ok = time.time(), True
        self.requests.moved_away(live)
        return "moved"

    def _hold(self, live: Live):
        """Stop a request between iterations without forgetting it: out of the core's batches and
        of `live`, its engine state (KV) kept, so a refused commit can put it back as it was."""
        self.book.live.pop(live.request.request_id, None)
        return self.rt.sched.park(live.instance_id, live.request.request_id)

    def _unhold(self, live: Live, view) -> None:
        if view is not None:
            self.rt.sched.unpark(live.instance_id, view)
        self.book.live[live.request.request_id] = live
        self.rt.wake.set()
