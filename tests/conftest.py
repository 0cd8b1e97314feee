"""Shared fixtures: real nats-server and redis (valkey) processes on free ports, one per session
(`nats_url`, `redis_url`) or a test's own pair (`own_servers`).

Each server is stopped in a `finally`, so a failing test (or a pytest-timeout in its default
signal mode, which raises in the test) still stops it; if the pytest process itself dies
(SIGKILL, a segfault, pytest-timeout's thread mode calling os._exit) the kernel kills the
servers (`shared.servers.popen_tied`: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.servers import ServerProcess, start_nats, start_redis
from tests.servers import running

# Fixtures that start a real server (nats-server, valkey, the services) or a real engine: a test
# that uses one, directly or through another fixture, is an integration test whatever its file
# says (`-m "not integration"` then leaves out exactly those). Tests that start servers or engines
# without a fixture carry the marker themselves.
REAL_FIXTURES = frozenset({"nats_server", "redis_server", "own_servers", "stack", "traced_stack",
                           "make_engine", "hf_model", "engine", "profile", "connections",
                           "real_model_dir"})


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> Iterator[ServerProcess]:
    with running(start_nats, tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[ServerProcess]:
    with running(start_redis, tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: ServerProcess) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_url(redis_server: ServerProcess) -> str:
    return redis_server.url


@pytest.fixture
def own_servers(tmp_path) -> Iterator[tuple[str, str]]:
    """This test's own nats-server and valkey (their URLs), for a test whose placer, profiler,
    registry or nodes must see only what it put there: the session's servers may still hold
    another test's nodes, models or handed-back requests."""
    with running(start_nats, tmp_path / "nats") as nats, \
            running(start_redis, tmp_path / "redis") as redis:
        yield nats.url, redis.url


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The default real model (SmolLM2-135M-Instruct), downloaded and converted once into the
    user's cache (SLINFER_CACHE_DIR, else ~/.cache/slinfer), not per test session: a few hundred
    MB that every later run reuses."""
    from shared.default_model import cache_dir, ensure_default_model

    return ensure_default_model(cache_dir())
