"""The node's host-memory pool: aligned buffers that the loader reads checkpoints into, kept for
reuse once nothing views them any more.

Fresh anonymous memory costs a page fault (and the kernel zeroing the page) on first touch; on
the VM this was measured on, that made a cold load of llama-3.2-1b into fresh buffers run well
below the disk's O_DIRECT bandwidth. ServerlessLLM pre-allocates its pinned pool for the same
reason. Here a buffer whose checkpoint left the DRAM tier, and whose tensors no engine holds any
more, goes back to a free list and the next load reads into it: memory already faulted in.

A buffer is free when only the pool refers to its mmap: `torch.frombuffer` holds a reference to
the mmap for as long as any tensor viewing that memory lives, so the mmap's reference count says
whether an engine (or the DRAM tier) still uses it, without any bookkeeping in the engines.
"""

from __future__ import annotations

import mmap
import sys
import threading
from dataclasses import dataclass

import torch

from .checkpoint_format import align_up
from .direct_io import aligned_buffer

GRANULE = 2 << 20  # buffer sizes are multiples of a huge page: reusable across similar sizes
MAX_WASTE = 1.25  # a free buffer serves a request up to this factor smaller than itself


@dataclass
class _Slot:
    memory: mmap.mmap
    size: int

    def is_free(self) -> bool:
        # The slot's own reference and getrefcount's argument: nothing else views it.
        return sys.getrefcount(self.memory) <= 2


class HostBufferPool:
    """Hands out page-aligned host buffers (uint8 tensors) and keeps the ones nobody uses any
    more for later loads; `trim` lets free ones beyond a budget go back to the OS."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again

    def take(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A buffer of at least `nbytes`; a free one of a fitting size when there is one."""
        if pinned or not self.enabled:
            return aligned_buffer(nbytes, pinned=pinned)
        size = align_up(max(nbytes, 1), GRANULE)
        with self._lock:
            slot = self._fitting_free_slot(size)
            if slot is None:
                slot = _Slot(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                             size)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    slot.memory.madvise(mmap.MADV_HUGEPAGE)
                self._slots.append(slot)
            else:
                self.reused += 1
            return torch.frombuffer(slot.memory, dtype=torch.uint8)[:align_up(nbytes)]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._slots if s.is_free())

    def trim(self, keep_free_bytes: int) -> None:
        """Drop free buffers beyond `keep_free_bytes`, largest first (they fit the fewest)."""
        with self._lock:
            free = sorted((s for s in self._slots if s.is_free()), key=lambda s: -s.size)
            total = sum(s.size for s in free)
            for slot in free:
                if total <= keep_free_bytes:
                    break
                self._slots.remove(slot)
                total -= slot.size

    def _fitting_free_slot(self, size: int) -> _Slot | None:
        fits = [s for s in self._slots if size <= s.size <= size * MAX_WASTE and s.is_free()]
        return min(fits, key=lambda s: s.size) if fits else None
