"""Real servers (nats-server, valkey) for the tests' fixtures, each stopped however its user ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.servers import ServerProcess


@contextmanager
def running(start: Callable[[Path], ServerProcess], data_dir: Path) -> Iterator[ServerProcess]:
    """`start(data_dir)`'s server, stopped on the way out: also when the test fails or a
    pytest-timeout (signal mode) raises in it."""
    server = start(data_dir)
    try:
        yield server
    finally:
        server.stop()
