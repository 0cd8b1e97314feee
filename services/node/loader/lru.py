"""A least-recently-used map with a byte budget: the bookkeeping of the DRAM and disk tiers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class _Slot(Generic[V]):
    value: V
    nbytes: int


class LRUBytes(Generic[V]):
    """Entries of known size; admitting one evicts the least recently used entries until the
    total fits `capacity_bytes`. An entry larger than the whole budget is refused (and evicts
    nothing). `on_evict(key, value)` runs for every entry evicted to make room."""

    def __init__(self, capacity_bytes: int,
                 on_evict: Callable[[str, V], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._on_evict = on_evict
        self._slots: OrderedDict[str, _Slot[V]] = OrderedDict()  # oldest first
        self.used_bytes = 0

    def get(self, key: str) -> V | None:
        """The value, now the most recently used; None when absent."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        self._slots.move_to_end(key)
        return slot.value

    def __contains__(self, key: str) -> bool:
        return key in self._slots

    def admit(self, key: str, value: V, nbytes: int) -> list[str]:
        """Insert (or replace) as most recently used; returns the keys evicted to make room.
        Raises ValueError when `nbytes` exceeds the whole budget."""
        if nbytes > self.capacity_bytes:
            raise ValueError(f"{nbytes} bytes exceed the tier's budget of {self.capacity_bytes}")
        self.remove(key)
        evicted = []
        while self.used_bytes + nbytes > self.capacity_bytes:
            old_key, old = self._slots.popitem(last=False)
            self.used_bytes -= old.nbytes
            evicted.append(old_key)
            if self._on_evict is not None:
                self._on_evict(old_key, old.value)
        self._slots[key] = _Slot(value, nbytes)
        self.used_bytes += nbytes
        return evicted

    def remove(self, key: str) -> V | None:
        slot = self._slots.pop(key, None)
        if slot is None:
            return None
        self.used_bytes -= slot.nbytes
        return slot.value

    def entries(self) -> list[tuple[str, V, int]]:
        """(key, value, bytes), least recently used first."""
        return [(k, s.value, s.nbytes) for k, s in self._slots.items()]
