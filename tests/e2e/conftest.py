"""A real stack for end-to-end tests (`services.stack`): nats-server and valkey from wheels, the
demo model, a measured profile, and the placer, a CPU node worker and the gateway as real
processes - started the way `slinfer up` starts them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.stack import Stack, running_stack
from shared.modelgen import ensure_demo_model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return Path(ensure_demo_model(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def stack(tmp_path_factory, demo_model_dir) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), demo_model_dir) as s:
        yield s
