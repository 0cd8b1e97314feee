"""Chunked, parallel, direct (O_DIRECT) file I/O into page-aligned host memory.

O_DIRECT moves data between the device and our buffer without the page cache: no second copy
through the kernel, no memory pressure from cached pages, and the same speed on every load, which
is what a startup-time estimate needs (the paper's argument against mmap-based loaders). It
requires the file offset, the length and the buffer address to be multiples of the device's
logical block size; ALIGNMENT (4096) covers every common device, and the checkpoint format pads
tensors and partitions to it. Buffers are anonymous mmaps (page-aligned by construction) or, on
CUDA nodes, pinned host memory checked for alignment.

Several threads issue `preadv` on disjoint chunks (the GIL is released during the system call),
which keeps a queue of requests at the device: one synchronous reader leaves a fast SSD idle
between requests. A filesystem without O_DIRECT (tmpfs) falls back to buffered reads; the result
says which was used.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_format import ALIGNMENT, align_up

DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_THREADS = 8


def aligned_buffer(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """A uint8 tensor of at least `nbytes` (rounded up to ALIGNMENT) at an ALIGNMENT-aligned
    address. Host memory from an anonymous mmap (returned to the OS when the last tensor viewing
    it dies), or CUDA-pinned memory when `pinned` (so a host-to-device copy is one DMA)."""
    size = align_up(max(nbytes, 1))
    if pinned:
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if buffer.data_ptr() % ALIGNMENT == 0:
            return buffer
        # The pinned allocator gave an unaligned block: over-allocate and view an aligned part.
        buffer = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        start = -buffer.data_ptr() % ALIGNMENT
        return buffer[start:start + size]
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults while the reads fill it
    return torch.frombuffer(memory, dtype=torch.uint8)


def writable_view(buffer: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable memoryview (what preadv fills)."""
    return memoryview(buffer.numpy()).cast("B")


def open_direct(path: Path, write: bool = False) -> tuple[int, bool]:
    """(fd, direct): O_DIRECT where the filesystem supports it, else a plain descriptor."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o644), False


@dataclass(frozen=True)
class ReadJob:
    path: Path
    size: int  # bytes to read from offset 0, a multiple of ALIGNMENT
    buffer: torch.Tensor  # uint8, ALIGNMENT-aligned, at least `size` bytes


@dataclass(frozen=True)
class IOStats:
    bytes: int
    seconds: float
    direct: bool  # every file was read (or written) with O_DIRECT

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class ParallelReader:
    """Reads whole files into aligned buffers: each file split into chunks of `chunk_bytes`, the
    chunks of all files read by `threads` threads at once."""

    def __init__(self, threads: int = DEFAULT_THREADS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if threads < 1 or chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
            raise ValueError(f"need threads >= 1 and chunk_bytes a multiple of {ALIGNMENT}")
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="slinfer-io")

    def read(self, jobs: list[ReadJob]) -> IOStats:
        started = time.perf_counter()
        fds: list[tuple[int, bool]] = []
        try:
            futures = []
            for job in jobs:
                _check_job(job)
                fd, direct = open_direct(job.path)
                fds.append((fd, direct))
                view = writable_view(job.buffer)
                for offset in range(0, job.size, self.chunk_bytes):
                    end = min(offset + self.chunk_bytes, job.size)
                    futures.append(self._pool.submit(_read_exact, fd, view[offset:end], offset))
            for future in futures:
                future.result()  # the first failure propagates
        finally:
            for fd, _ in fds:
                os.close(fd)
        return IOStats(sum(j.size for j in jobs), time.perf_counter() - started,
                       all(direct for _, direct in fds))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _check_job(job: ReadJob) -> None:
    if job.size % ALIGNMENT or job.buffer.data_ptr() % ALIGNMENT:
        raise ValueError(f"{job.path}: size and buffer address must be multiples of {ALIGNMENT}")
    if job.buffer.numel() < job.size:
        raise ValueError(f"{job.path}: buffer of {job.buffer.numel()} bytes < {job.size}")


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ended {len(view) - done} bytes early at offset {offset + done}")
        done += n


def write_direct(path: Path, buffer: torch.Tensor, size: int) -> IOStats:
    """Write `size` bytes (a multiple of ALIGNMENT) of an aligned buffer to a new file, with
    O_DIRECT where possible, and fsync it."""
    if size % ALIGNMENT or buffer.data_ptr() % ALIGNMENT:
        raise ValueError(f"size and buffer address must be multiples of {ALIGNMENT}")
    started = time.perf_counter()
    fd, direct = open_direct(path, write=True)
    try:
        view = writable_view(buffer)
        done = 0
        while done < size:
            done += os.pwritev(fd, [view[done:min(size, done + DEFAULT_CHUNK_BYTES)]], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return IOStats(size, time.perf_counter() - started, direct)


# -- page cache (benchmarks and tests: make a read cold, and check that it is) -------------------

def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop the file's clean cached pages (dirty ones are written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of the file now in the page cache (mincore over a mapping of it)."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = (size + page - 1) // page
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(address), size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return min(size, sum(b & 1 for b in vector) * page)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


def memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Host memory-copy bandwidth (torch's parallel copy between two warm buffers): the yardstick
    for a DRAM-tier hit that has to copy, and the DRAM tier's initial estimate."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault both in
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best
