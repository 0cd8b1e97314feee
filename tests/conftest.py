"""Shared fixtures: real nats-server and redis (valkey) processes on free ports, one per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.servers import ServerProcess, start_nats, start_redis


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: ServerProcess) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_url(redis_server: ServerProcess) -> str:
    return redis_server.url
