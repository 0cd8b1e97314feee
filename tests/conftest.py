"""Shared fixtures: real nats-server and redis (valkey) processes on free ports, one per session.

Each server is stopped in a `finally`, so a failing test (or a pytest-timeout in its default
signal mode, which raises in the test) still stops it; if the pytest process itself dies
(SIGKILL, a segfault, pytest-timeout's thread mode calling os._exit) the kernel kills the
servers (`shared.servers.popen_tied`: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.servers import ServerProcess, start_nats, start_redis

# Fixtures that start a real server (nats-server, valkey, the services) or a real engine: a test
# that uses one, directly or through another fixture, is an integration test whatever its file
# says (`-m "not integration"` then leaves out exactly those). Tests that start servers or engines
# without a fixture carry the marker themselves.
REAL_FIXTURES = frozenset({"nats_server", "redis_server", "stack", "traced_stack", "make_engine",
                           "hf_model", "engine", "profile", "connections"})


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: ServerProcess) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_url(redis_server: ServerProcess) -> str:
    return redis_server.url
