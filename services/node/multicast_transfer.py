"""What a model multicast moves and how (λScale §4.2; the endpoint is services/node/multicast.py):
the manifest (the checkpoint's index and its blocks with their CRC chain), one transfer's state on
a node (its buffers, the blocks verified so far, the epoch of the plan it follows), and the
framing of a block on a TCP connection (a JSON hello, then (header, block) frames).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field

from services.node.loader.checkpoint_format import CheckpointIndex
from services.node.loader.direct_io import writable_view
from services.node.loader.loader import HostCheckpoint
from shared.core.multicast import DEFAULT_BLOCKS, cut_blocks

HELLO = struct.Struct("!I")  # length of the JSON hello that opens a connection
FRAME = struct.Struct("!IQ")  # block index, byte count; the block's bytes follow
MAX_HELLO = 4096
PACE_CHUNK = 1 << 20  # bytes per send when a rate limit paces the sender


class MulticastError(RuntimeError):
    """A multicast step that cannot go on (bad manifest, checksum mismatch, unknown transfer)."""


@dataclass(frozen=True)
class BlockInfo:
    index: int
    file: str  # partition file
    start: int  # byte range [start, end) in that partition
    end: int
    crc_start: int  # running CRC-32 of the partition up to `start`
    crc_end: int  # ... and up to `end` (the last block's is the index's CRC of the partition)

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Manifest:
    """What a receiver needs to know before the bytes come: the checkpoint's index and the
    blocks (ranges and checksums)."""

    model_path: str  # the model as the loader names it (its key comes from the index)
    index: CheckpointIndex
    blocks: tuple[BlockInfo, ...]

    @property
    def bytes(self) -> int:
        return sum(b.size for b in self.blocks)

    def to_wire(self) -> dict:
        return {"model_path": self.model_path, "index": self.index.to_json(),
                "blocks": [[b.index, b.file, b.start, b.end, b.crc_start, b.crc_end]
                           for b in self.blocks]}

    @classmethod
    def from_wire(cls, body: dict) -> Manifest:
        return cls(body["model_path"], CheckpointIndex.from_json(body["index"]),
                   tuple(BlockInfo(*b) for b in body["blocks"]))

    def problems(self) -> list[str]:
        """Inconsistencies (empty: the blocks tile every partition in order and their CRC chain
        runs from 0 to the index's CRC of each partition)."""
        out = []
        by_file: dict[str, list[BlockInfo]] = {}
        for i, b in enumerate(self.blocks):
            if b.index != i:
                out.append(f"block {i} is numbered {b.index}")
            by_file.setdefault(b.file, []).append(b)
        for part in self.index.partitions:
            blocks = by_file.pop(part.file, [])
            position, crc = 0, 0
            for b in blocks:
                if b.start != position or b.crc_start != crc or b.end <= b.start:
                    out.append(f"block {b.index} does not follow on in {part.file}")
                position, crc = b.end, b.crc_end
            if position != part.size or crc != part.crc32:
                out.append(f"the blocks of {part.file} end at {position} with CRC {crc:#010x}, "
                           f"the index says {part.size} with {part.crc32:#010x}")
        out += [f"blocks name {f}, which is no partition of the index" for f in by_file]
        return out


def build_manifest(host: HostCheckpoint, model_path: str, blocks: int = DEFAULT_BLOCKS
                   ) -> Manifest:
    """Cut the checkpoint into about `blocks` blocks and checksum them in one pass over the
    host memory; raises MulticastError when that memory does not match the index's CRCs."""
    index = host.index
    starts: dict[str, list[int]] = {}
    for t in index.tensors:
        starts.setdefault(t.file, []).append(t.offset)
    cut = cut_blocks([(p.file, p.size) for p in index.partitions], starts, blocks,
                     index.alignment)
    views = {f: writable_view(buf) for f, buf in host.buffers.items()}
    crc: dict[str, int] = {}
    out = []
    for b in cut:
        begin = crc.get(b.file, 0)
        crc[b.file] = zlib.crc32(views[b.file][b.start:b.end], begin)
        out.append(BlockInfo(b.index, b.file, b.start, b.end, begin, crc[b.file]))
    for part in index.partitions:
        if crc.get(part.file, 0) != part.crc32:
            raise MulticastError(f"{model_path}: {part.file} in memory has CRC "
                                 f"{crc.get(part.file, 0):#010x}, the index says {part.crc32:#010x}")
    return Manifest(model_path, index, tuple(out))


@dataclass
class Epoch:
    """One plan of a transfer on this node: the first (the binomial pipeline) or a repair."""

    number: int
    addresses: dict[str, tuple[str, int]]  # node -> its endpoint's TCP address
    sends: list[tuple[int, str, int]]  # (step, destination node, block), in step order
    receives: dict[str, set[int]]  # sender node -> blocks it sends here
    rate_bytes_per_s: float | None = None  # pace each sending connection (None: unpaced)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sockets: list[socket.socket] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    connected: set[str] = field(default_factory=set)  # senders that have connected

    def adopt(self, sock: socket.socket, thread: threading.Thread | None = None) -> bool:
        """Track a socket (and the thread serving it) so a stop can shut it (and join the
        thread); False (socket closed) when stopping."""
        with self.lock:
            if self.stopping.is_set():
                sock.close()
                return False
            self.sockets.append(sock)
            if thread is not None:
                self.threads.append(thread)
            return True

    def spawn(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self.lock:
            if self.stopping.is_set():
                return
            self.threads.append(thread)
        thread.start()


class TransferState:
    """A model on its way through this node: the buffers, the blocks verified so far."""

    def __init__(self, transfer_id: str, manifest: Manifest, host: HostCheckpoint,
                 have: set[int]) -> None:
        self.id = transfer_id
        self.manifest = manifest
        self.host = host
        self.views = {f: writable_view(buf) for f, buf in host.buffers.items()}
        self.cond = threading.Condition()
        self.have = set(have)
        self.epoch: Epoch | None = None
        self.registered = False
        self.receiving = not have  # this node is a destination (a source starts with all)
        self.outcome_told = False

    @property
    def complete(self) -> bool:
        return len(self.have) == len(self.manifest.blocks)

    def wait_for(self, block: int, stopping: threading.Event) -> bool:
        with self.cond:
            while block not in self.have and not stopping.is_set():
                self.cond.wait(0.5)
            return block in self.have

    def add(self, block: int) -> bool:
        """Count a verified block; True when it made the model complete."""
        with self.cond:
            fresh = block not in self.have
            self.have.add(block)
            self.cond.notify_all()
            return fresh and self.complete


# -- the framing -------------------------------------------------------------------------------


def send_bytes(sock: socket.socket, view: memoryview, rate: float | None, clock: float
                ) -> float:
    """Send the block; with a rate, in chunks no faster than it (`clock`: when the pacing allows
    the next byte, carried from block to block)."""
    if not rate:
        sock.sendall(view)
        return clock
    for at in range(0, len(view), PACE_CHUNK):
        chunk = view[at:at + PACE_CHUNK]
        clock = max(clock, time.perf_counter() - 0.05) + len(chunk) / rate
        delay = clock - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sock.sendall(chunk)
    return clock


def tune(sock: socket.socket) -> None:
    # Buffer sizes stay with the kernel's autotuning (setting them turns it off; on this
    # machine's loopback a fixed 4 MiB was no faster).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise ConnectionError(f"connection closed {got} bytes into a {n}-byte message")
        got += k
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview, crc: int) -> int:
    """Fill `view` from the socket; returns the CRC-32 of its bytes continued from `crc`
    (computed piece by piece as they land, while they are still in the cache)."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed {got} bytes into a {len(view)}-byte block")
        crc = zlib.crc32(view[got:got + k], crc)
        got += k
    return crc
