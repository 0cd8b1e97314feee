"""Model multicast between node workers (λScale §4.2): a node's endpoint that sends and receives a
model's checkpoint in blocks over direct TCP connections, following a plan that a coordinator
(`services.placer.multicast`) hands out over NATS.

The wire split: NATS carries the control (request-reply on `multicast_node_subject(node)`: offer,
prepare, plan, go, abort, finish; events to `multicast_events_subject(transfer)`: a block
arrived, the node holds the whole model, a peer was lost); the bytes go over one TCP connection
per (sender, receiver, epoch), nothing but a small hello and then (header, block) frames.

What travels is the loader's host-memory form (`services.node.loader`): one aligned buffer per
partition file of the converted checkpoint. A block is a contiguous byte range of one partition
(`shared.core.multicast.cut_blocks`), so a block is one `sendall` out of the sender's buffer and
one series of `recv_into` straight into the receiver's buffer: no copy besides the kernel's. The
receiver allocates its buffers from the loader's host pool, and once every block is in it
registers the checkpoint in its DRAM tier (`CheckpointLoader.admit_host`), so the engine's next
`loader.load(model)` is a DRAM hit: the same tensors a local load would give.

Integrity: the source's manifest carries, for every block, the running CRC-32 of its partition
at the block's start and end (`crc_start`, `crc_end`): one pass over the source's memory, whose
last value per partition must equal the checkpoint index's CRC of the partition file (else the
source refuses to offer). A receiver checks every block as it lands (`crc32(block, crc_start) ==
crc_end`) before it forwards it or counts it, so a complete copy is, link by link, the index's.

Execution: the plan is the coordinator's step schedule, but a node does not wait for steps: its
sends run in plan order, each as soon as the node holds the block (a dataflow reading of the
binomial pipeline, which the plan's step order keeps free of cycles). Failures: a receiver that
sees its sender's connection end early, a sender whose connection breaks or is refused, and a
receiver whose expected sender never connects (`connect_timeout_s`) report the peer to the
coordinator, which aborts the epoch everywhere (sockets shut, threads joined, each node answers
what it holds) and hands out a repair plan among the survivors.

Run one endpoint as its own process (tests, benchmarks):

    python -m services.node.multicast --node-id n1 --nats nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref

import torch

from services.node.loader import CheckpointLoader, LoaderSettings
from services.node.loader.loader import HostCheckpoint
from services.node.multicast_transfer import (FRAME, HELLO, MAX_HELLO, Epoch, Manifest,
                                              MulticastError, TransferState, build_manifest,
                                              recv_exact, recv_into, send_bytes, tune)
from shared.core.multicast import DEFAULT_BLOCKS
from shared.subjects import multicast_events_subject, multicast_node_subject

log = logging.getLogger("slinfer.multicast")
DEFAULT_TTL_S = 3600.0  # a transfer whose coordinator sent no ttl_s is forgotten after this


class MulticastEndpoint:
    """A node's multicast endpoint: a TCP listener for blocks and a NATS request-reply subject
    for the coordinator. Use it inside a node worker (pass the worker's NATS connection and its
    loader) or as its own process (`main`)."""

    def __init__(self, nc, node_id: str, loader: CheckpointLoader, host: str = "127.0.0.1",
                 port: int = 0, *, advertise_host: str | None = None,
                 connect_timeout_s: float = 10.0, rate_bytes_per_s: float | None = None) -> None:
        self.nc = nc
        self.node_id = node_id
        self.loader = loader
        self.host = host  # what the TCP listener binds
        self.advertise_host = advertise_host or host  # what peers connect to (bind 0.0.0.0:
        # advertise the node's own address)
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.rate_bytes_per_s = rate_bytes_per_s  # per sending connection; None: unpaced
        self.address: tuple[str, int] | None = None
        self._transfers: dict[str, TransferState] = {}
        # (model, blocks) -> (the host checkpoint it was made of, its manifest)
        self._manifests: dict[tuple[str, int], tuple[weakref.ref, Manifest]] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._sub = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        # Received blocks: bytes and the seconds from a block's header to its last byte (the
        # link's own rate, without the waits of the pipeline), for `link_bytes_per_s`.
        self._rx_bytes = 0
        self._rx_seconds = 0.0
        # model path -> (monotonic time, whether it arrived whole and went into the DRAM tier)
        # of the last transfer this node received it by (`wait_for_model`).
        self._outcomes: dict[str, tuple[float, bool]] = {}
        self._outcome_cond = threading.Condition()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = socket.create_server((self.host, self.port), backlog=128)
        self._listener = listener
        self.address = (self.advertise_host, listener.getsockname()[1])
        self._accepting = threading.Thread(target=self._accept_loop, daemon=True,
                                           name=f"multicast-accept-{self.node_id}")
        self._accepting.start()
        self._sub = await self.nc.subscribe(multicast_node_subject(self.node_id),
                                            cb=self._on_command)

    async def stop(self) -> None:
        with self._outcome_cond:  # loads waiting for a model stop waiting
            self._closed = True
            self._outcome_cond.notify_all()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            transfers, self._transfers = list(self._transfers.values()), {}
        for t in transfers:
            await asyncio.to_thread(self._stop_epoch, t)
        if self._accepting is not None:
            await asyncio.to_thread(self._accepting.join, 5.0)

    # -- what the node worker asks ---------------------------------------------------------------

    def link_bytes_per_s(self) -> float | None:
        """The rate received blocks came in at, over every block so far (None: none yet)."""
        with self._lock:
            return self._rx_bytes / self._rx_seconds if self._rx_seconds > 0 else None

    def wait_for_model(self, model_path: str, since: float, timeout_s: float) -> bool | None:
        """Block until a transfer of `model_path` to this node ends after `since` (monotonic):
        True when the model arrived whole and is in the DRAM tier, False when the transfer ended
        without it; None when none ended within `timeout_s` (it never started, or is late) or
        the endpoint stopped."""
        key = _key(model_path)
        deadline = time.monotonic() + timeout_s
        with self._outcome_cond:
            while True:
                at, ok = self._outcomes.get(key, (0.0, False))
                if at >= since:
                    return ok
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._outcome_cond.wait(min(left, 0.5))

    def wait_blocks(self, model_path: str, ready, timeout_s: float
                    ) -> tuple[Manifest, HostCheckpoint, frozenset[int]] | None:
        """(A worker thread) Block until a transfer of `model_path` to this node holds blocks
        for which `ready(manifest, have)` is true (or holds all of them); then its manifest,
        its buffers (the blocks in `have` hold the model's bytes, the others not yet) and
        `have`. None when no such transfer came within `timeout_s`, or the endpoint stopped.
        Execute-while-load (services/node/pipeline_mode.py) runs layers from these buffers."""
        key = _key(model_path)
        deadline = time.monotonic() + timeout_s
        while not self._closed:
            with self._lock:
                t = next((t for t in self._transfers.values()
                          if t.receiving and _key(t.manifest.model_path) == key), None)
            left = deadline - time.monotonic()
            if t is None:
                if left <= 0:
                    return None
                time.sleep(min(left, 0.02))  # the coordinator's prepare has not come yet
                continue
            with t.cond:
                while not (t.complete or ready(t.manifest, t.have)):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed or (t.epoch is not None and t.epoch.stopping.is_set()
                                                     and not t.complete):
                        return None
                    t.cond.wait(min(left, 0.5))
                return t.manifest, t.host, frozenset(t.have)
        return None

    def _ended(self, t: TransferState) -> None:
        """A transfer this node received by is over (complete or not): tell `wait_for_model`."""
        if t.outcome_told:
            return
        t.outcome_told = True
        with self._outcome_cond:
            self._outcomes[_key(t.manifest.model_path)] = (time.monotonic(),
                                                           t.complete and t.registered)
            self._outcome_cond.notify_all()

    # -- control: NATS request-reply -------------------------------------------------------------

    async def _on_command(self, msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg) -> None:
        try:
            body = json.loads(msg.data)
            handler = getattr(self, f"_op_{body.get('op')}", None)
            if handler is None:
                raise MulticastError(f"unknown op {body.get('op')!r}")
            reply = {"ok": True, **(await handler(body))}
        except Exception as exc:  # every failure is an answer, never a silent timeout
            log.warning("multicast %s on %s failed: %s", msg.data[:80], self.node_id, exc)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["node"] = self.node_id
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())

    async def _op_ping(self, body: dict) -> dict:
        return {"address": list(self.address or ())}

    async def _op_offer(self, body: dict) -> dict:
        """Be the source of a transfer: the model in host memory and its manifest."""
        model_path = body["model_path"]
        blocks = int(body.get("blocks", DEFAULT_BLOCKS))
        host, manifest = await asyncio.to_thread(self._source, model_path, blocks)
        self._register(TransferState(body["transfer"], manifest, host,
                                 set(range(len(manifest.blocks)))), body.get("ttl_s"))
        return {"address": list(self.address), "manifest": manifest.to_wire()}

    def _source(self, model_path: str, blocks: int) -> tuple[HostCheckpoint, Manifest]:
        host = self.loader.host_checkpoint(model_path)
        key = (model_path, blocks)
        with self._lock:
            held, manifest = self._manifests.get(key, (None, None))
        if manifest is None or held() is not host:
            manifest = build_manifest(host, model_path, blocks)
            with self._lock:  # a checkpoint in memory does not change: checksum it once
                self._manifests[key] = (weakref.ref(host), manifest)
        return host, manifest

    async def _op_prepare(self, body: dict) -> dict:
        """Be a receiver: buffers from the loader's pool for the manifest's checkpoint."""
        manifest = Manifest.from_wire(body["manifest"])
        if problems := manifest.problems():
            raise MulticastError("bad manifest: " + "; ".join(problems[:3]))
        host = await asyncio.to_thread(self.loader.empty_host_checkpoint, manifest.index,
                                       manifest.model_path)
        self._register(TransferState(body["transfer"], manifest, host, set()), body.get("ttl_s"))
        return {"address": list(self.address)}

    async def _op_plan(self, body: dict) -> dict:
        t = self._transfer(body["transfer"])
        if t.epoch is not None and not t.epoch.stopping.is_set():
            raise MulticastError(f"epoch {t.epoch.number} of {t.id} is still running")
        receives: dict[str, set[int]] = {}
        for _, src, block in body["receives"]:
            receives.setdefault(src, set()).add(block)
        rate = body.get("rate_bytes_per_s") or self.rate_bytes_per_s
        t.epoch = Epoch(int(body["epoch"]),
                         {n: (a[0], int(a[1])) for n, a in body["addresses"].items()},
                         sorted((s, d, b) for s, d, b in body["sends"]), receives,
                         float(rate) if rate else None)
        return {}

    async def _op_go(self, body: dict) -> dict:
        t = self._transfer(body["transfer"])
        ep = t.epoch
        if ep is None or ep.number != int(body["epoch"]):
            raise MulticastError(f"no plan for epoch {body['epoch']} of {t.id}")
        if ep.sends:
            ep.spawn(self._send_loop, t, ep, name=f"multicast-send-{self.node_id}")
        else:
            self._emit(t, ep, "sent")
        if ep.receives:
            ep.spawn(self._watch_connections, t, ep, name=f"multicast-watch-{self.node_id}")
        return {}

    async def _op_abort(self, body: dict) -> dict:
        """Stop the transfer's epoch (sockets shut, threads joined); what this node holds."""
        t = self._transfer(body["transfer"])
        await asyncio.to_thread(self._stop_epoch, t)
        with t.cond:
            return {"have": sorted(t.have), "complete": t.complete,
                    "registered": t.registered}

    async def _op_finish(self, body: dict) -> dict:
        """The transfer is over: stop it and forget it (a checkpoint that arrived whole stays
        in the DRAM tier; a partial one goes back to the pool)."""
        with self._lock:
            t = self._transfers.pop(body["transfer"], None)
        if t is None:
            return {"known": False}
        await asyncio.to_thread(self._stop_epoch, t)
        if t.receiving:
            self._ended(t)
        return {"known": True, "complete": t.complete, "registered": t.registered}

    async def _op_holding(self, body: dict) -> dict:
        """What this node can run of `model_path` from its blocks so far (a receiver heading an
        execution pipeline asks the other receivers, λScale Algorithm 2): the decoder layers and
        whether the head (`weights.holding_of`); every layer once its DRAM tier holds it whole."""
        from services.node.engines.weights import holding_of

        key = _key(body["model_path"])
        with self._lock:
            t = next((t for t in self._transfers.values()
                      if t.receiving and _key(t.manifest.model_path) == key), None)
        if t is not None:
            with t.cond:
                have = set(t.have)
            held = holding_of(t.manifest.index, list(t.manifest.blocks), have)
            return {"layers": sorted(held.layers), "head": held.head, "whole": False}
        whole = self.loader.tier_of(body["model_path"]) == "dram"
        return {"layers": [], "head": False, "whole": whole}

    async def _op_abandon(self, body: dict) -> dict:
        """The coordinator will not bring `model_path` here after all (no source could offer it,
        or this node failed out of the transfer before it began): a load waiting for it stops
        waiting and reads the node's tiers."""
        with self._outcome_cond:
            self._outcomes[_key(body["model_path"])] = (time.monotonic(), False)
            self._outcome_cond.notify_all()
        return {}

    async def _op_digest(self, body: dict) -> dict:
        """SHA-256 of every tensor as `loader.load` gives it to an engine now, and the tier it
        came from (checks that a multicast left byte-identical weights in the DRAM tier)."""
        return await asyncio.to_thread(self._digest, body["model_path"])

    def _digest(self, model_path: str) -> dict:
        result = self.loader.load(model_path)
        tensors = {name: hashlib.sha256(memoryview(
            t.contiguous().view(torch.uint8).numpy()) if t.numel() else b"").hexdigest()
                   for name, t in result.state_dict.items()}
        return {"tier": result.tier, "tensors": tensors}

    async def _op_load(self, body: dict) -> dict:
        """Load the model through the loader as an engine would (the storage baseline)."""
        result = await asyncio.to_thread(self.loader.load, body["model_path"])
        return {"tier": result.tier, "seconds": result.seconds, "bytes": result.bytes,
                "direct": result.direct}

    async def _op_drop(self, body: dict) -> dict:
        dropped = await asyncio.to_thread(self.loader.drop, body["model_path"])
        with self._lock:
            self._manifests.clear()
        return {"dropped": dropped}

    def _register(self, t: TransferState, ttl_s: float | None) -> None:
        """Track the transfer until its finish, or for `ttl_s` at most (default
        DEFAULT_TTL_S): a coordinator that died must not leave its buffers here for good."""
        with self._lock:
            if t.id in self._transfers:
                raise MulticastError(f"transfer {t.id} is already known here")
            self._transfers[t.id] = t
        # The timer names the transfer by its id, not the object: a finished transfer's buffers
        # must go back to the loader's pool now, not when its ttl runs out.
        self._loop.call_later(float(ttl_s or DEFAULT_TTL_S), self._expire, t.id)

    def _expire(self, transfer_id: str) -> None:
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is None:
            return  # finished
        log.warning("multicast %s on %s expired before its finish", t.id, self.node_id)
        if t.receiving:
            self._ended(t)
        task = asyncio.create_task(asyncio.to_thread(self._stop_epoch, t))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _transfer(self, transfer_id: str) -> TransferState:
        with self._lock:
            t = self._transfers.get(transfer_id)
        if t is None:
            raise MulticastError(f"no transfer {transfer_id} on {self.node_id}")
        return t

    def _emit(self, t: TransferState, ep: Epoch, kind: str, **fields) -> None:
        """An event to the coordinator (from any thread)."""
        body = {"kind": kind, "node": self.node_id, "epoch": ep.number, **fields}
        subject = multicast_events_subject(t.id)
        if self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.nc.publish(subject, json.dumps(body).encode()),
                                             self._loop)

    def _suspect(self, t: TransferState, ep: Epoch, peer: str, reason: str) -> None:
        if not ep.stopping.is_set():
            log.warning("multicast %s epoch %d on %s: %s", t.id, ep.number, self.node_id, reason)
            self._emit(t, ep, "suspect", peer=peer, reason=reason)

    def _stop_epoch(self, t: TransferState) -> None:
        ep = t.epoch
        if ep is None:
            return
        with ep.lock:
            ep.stopping.set()
            sockets, threads = list(ep.sockets), list(ep.threads)
        with t.cond:
            t.cond.notify_all()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(self.connect_timeout_s + 5.0)

    # -- data plane: threads -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed: the endpoint stops
            threading.Thread(target=self._serve_connection, args=(sock,), daemon=True,
                             name=f"multicast-recv-{self.node_id}").start()

    def _serve_connection(self, sock: socket.socket) -> None:
        """A sender's connection: hello, then the blocks the plan has it send here."""
        try:
            sock.settimeout(self.connect_timeout_s)  # the hello follows the connect at once
            (n,) = HELLO.unpack(recv_exact(sock, HELLO.size))
            if n > MAX_HELLO:
                raise MulticastError(f"hello of {n} bytes")
            hello = json.loads(recv_exact(sock, n))
            sock.settimeout(None)
            t = self._transfer(hello["transfer"])
        except (OSError, ValueError, KeyError, MulticastError) as exc:
            log.warning("multicast connection to %s refused: %s", self.node_id, exc)
            sock.close()
            return
        ep = t.epoch
        src = hello["src"]
        if ep is None or ep.number != hello["epoch"] or \
                not ep.adopt(sock, threading.current_thread()):
            sock.close()
            return
        with ep.lock:
            ep.connected.add(src)
        self._receive(t, ep, src, sock)

    def _receive(self, t: TransferState, ep: Epoch, src: str, sock: socket.socket) -> None:
        expected = set(ep.receives.get(src, ()))
        total, got = len(expected), 0
        try:
            tune(sock)
            while expected:
                header = recv_exact(sock, FRAME.size, eof_ok=True)
                began = time.perf_counter()
                if header is None:
                    raise ConnectionError(f"connection from {src} closed after {got} of "
                                          f"{total} blocks")
                index, nbytes = FRAME.unpack(header)
                if index not in expected:
                    raise MulticastError(f"{src} sent block {index}, which the plan does not "
                                         f"have it send here")
                block = t.manifest.blocks[index]
                if nbytes != block.size:
                    raise MulticastError(f"{src} sent {nbytes} bytes for block {index} of "
                                         f"{block.size}")
                view = t.views[block.file][block.start:block.end]
                if recv_into(sock, view, block.crc_start) != block.crc_end:
                    raise MulticastError(f"block {index} from {src} failed its checksum")
                with self._lock:
                    self._rx_bytes += block.size
                    self._rx_seconds += time.perf_counter() - began
                expected.discard(index)
                got += 1
                completed = t.add(index)
                self._emit(t, ep, "block", block=index, src=src)
                if completed:
                    t.registered = self.loader.admit_host(t.manifest.model_path, t.host)
                    self._emit(t, ep, "complete", registered=t.registered)
                    self._ended(t)
        except (OSError, ConnectionError, MulticastError) as exc:
            self._suspect(t, ep, src, f"{self.node_id} receiving from {src}: {exc}")
        finally:
            sock.close()

    def _watch_connections(self, t: TransferState, ep: Epoch) -> None:
        """Every sender of this epoch must connect within connect_timeout_s of the go."""
        if ep.stopping.wait(self.connect_timeout_s):
            return
        with ep.lock:
            missing = [s for s in ep.receives if s not in ep.connected]
        for src in missing:
            self._suspect(t, ep, src, f"{src} did not connect to {self.node_id} within "
                                      f"{self.connect_timeout_s:g} s")

    def _send_loop(self, t: TransferState, ep: Epoch) -> None:
        conns: dict[str, socket.socket] = {}
        dead: set[str] = set()
        try:
            for dst in dict.fromkeys(d for _, d, _ in ep.sends):
                try:
                    conns[dst] = self._connect(t, ep, dst)
                except (OSError, MulticastError) as exc:
                    dead.add(dst)
                    self._suspect(t, ep, dst, f"{self.node_id} cannot connect to {dst} at "
                                              f"{ep.addresses.get(dst)}: {exc}")
            clock = time.perf_counter()
            for _, dst, index in ep.sends:
                if dst in dead:
                    continue
                if not t.wait_for(index, ep.stopping):
                    return  # stopped
                block = t.manifest.blocks[index]
                try:
                    conns[dst].sendall(FRAME.pack(index, block.size))
                    clock = send_bytes(conns[dst], t.views[block.file][block.start:block.end],
                                        ep.rate_bytes_per_s, clock)
                except OSError as exc:
                    dead.add(dst)
                    self._suspect(t, ep, dst, f"{self.node_id} sending block {index} to {dst}: "
                                              f"{exc}")
        finally:
            for sock in conns.values():
                sock.close()
            if not ep.stopping.is_set():
                self._emit(t, ep, "sent", failed=sorted(dead))

    def _connect(self, t: TransferState, ep: Epoch, dst: str) -> socket.socket:
        if dst not in ep.addresses:
            raise MulticastError("no address")
        sock = socket.create_connection(ep.addresses[dst], timeout=self.connect_timeout_s)
        if not ep.adopt(sock):
            raise MulticastError("stopped")
        tune(sock)
        hello = json.dumps({"transfer": t.id, "epoch": ep.number, "src": self.node_id}).encode()
        sock.sendall(HELLO.pack(len(hello)) + hello)
        sock.settimeout(None)
        return sock



def _key(model_path: str) -> str:
    return str(os.path.normpath(str(model_path)))


# -- the endpoint as its own process ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.node.multicast",
                                description="A node's model-multicast endpoint on its own.")
    p.add_argument("--node-id", required=True)
    p.add_argument("--nats", default=os.environ.get("SLINFER_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--host", default="127.0.0.1", help="address the TCP listener binds")
    p.add_argument("--port", type=int, default=0, help="TCP port (0: any free one)")
    p.add_argument("--advertise-host", help="address peers connect to (default: --host)")
    p.add_argument("--dram-cache-bytes", type=int, default=16 << 30,
                   help="the loader's DRAM tier budget (received models are kept there)")
    p.add_argument("--loader-threads", type=int, default=LoaderSettings.threads)
    p.add_argument("--rate-bytes-per-s", type=float, default=None,
                   help="pace each sending connection (default: as fast as the link goes)")
    p.add_argument("--connect-timeout-s", type=float, default=10.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.node_id} %(message)s")
    return asyncio.run(_serve(args))


async def _serve(args) -> int:
    from shared.bus import connect_nats

    nc = await connect_nats(args.nats, f"multicast-{args.node_id}")
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=args.dram_cache_bytes,
                                             threads=args.loader_threads, dram_bytes_per_s=1e10))
    endpoint = MulticastEndpoint(nc, args.node_id, loader, args.host, args.port,
                                 advertise_host=args.advertise_host,
                                 connect_timeout_s=args.connect_timeout_s,
                                 rate_bytes_per_s=args.rate_bytes_per_s)
    await endpoint.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"multicast endpoint {args.node_id} ready at {endpoint.address[0]}:"
          f"{endpoint.address[1]}", flush=True)
    await stop.wait()
    await endpoint.stop()
    await nc.close()
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
