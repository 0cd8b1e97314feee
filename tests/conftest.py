"""Shared fixtures: real nats-server and redis (valkey) processes on free ports, one per session
(`nats_url`, `redis_url`) or a test's own pair (`own_servers`); the tiny demo model built once per
session (`demo_model` copies it where a fixture wants it) and its profile measured once
(`demo_profile`); one real stack of processes serving it per session (`stack`), shared by the
e2e and gateway tests that do not stop its services.

Each server is stopped in a `finally`, so a failing test (or a pytest-timeout in its default
signal mode, which raises in the test) still stops it; if the pytest process itself dies
(SIGKILL, a segfault, pytest-timeout's thread mode calling os._exit) the kernel kills the
servers (`shared.servers.popen_tied`: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys

# On several xdist workers each process (and every stack it starts) gets its share of the cores
# for torch's OpenMP threads, set before torch loads. Two workers of two threads each on this
# 2-core box spin-wait at every parallel op for threads the other worker holds: two real-model
# profiles at once took 55 s each against 22 s with one thread each (bench box, 16 s alone),
# and in one CI run two of them stalled past pytest's 10-minute timeout.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    if "torch" in sys.modules:  # (a plugin loaded it first: tell it too)
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from shared.core.perf_model import Profile
from shared.servers import ServerProcess, start_nats, start_redis
from tests.servers import running

# Fixtures that start a real server (nats-server, valkey, the services) or a real engine: a test
# that uses one, directly or through another fixture, is an integration test whatever its file
# says (`-m "not integration"` then leaves out exactly those). Tests that start servers or engines
# without a fixture carry the marker themselves.
REAL_FIXTURES = frozenset({"nats_server", "redis_server", "own_servers", "stack", "traced_stack",
                           "make_engine", "hf_model", "engine", "profile", "connections",
                           "real_model_dir", "demo_profile"})


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


# `make test` runs on two pytest-xdist workers, and each scope below runs whole on one of them:
# a test file (its module fixtures are built once), tests/e2e (its files share the session's
# stacks, the real model's the slowest to build) and tests/cluster (it adds namespaces and routes
# to the one machine). A scheduler of our own, since xdist's `loadgroup` marks do not work with
# pytest 9 (xdist 3.8 renames an item's `_nodeid`, which pytest 9 no longer reads).
SHARED_SCOPES = ("tests/e2e/", "tests/cluster/")


def xdist_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((d for d in SHARED_SCOPES if path.startswith(d)), path)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: unknown without it)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ScopeScheduling(config, log)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test leaves os.environ as it found it. Code under test may set variables itself (the
    launcher's made-up operator key, which `monkeypatch` cannot undo when it deleted an unset
    variable first), and on an xdist worker the next test may start a stack that inherits them:
    the fault tests' stack once came up with auth on and answered their load 401."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


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


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Callable[[Path], Path]:
    """`demo_model(data_dir)`: the tiny demo model at data_dir/models/tiny-llama, where
    `shared.modelgen.ensure_demo_model(data_dir)` would build it. It is built once per session
    (its tokenizer training and weights take seconds) and copied: each caller owns its copy, so
    a conversion written beside it or a file a test damages reaches no other fixture."""
    from shared.modelgen import ensure_demo_model, is_built

    built = ensure_demo_model(tmp_path_factory.mktemp("demo-build"))

    def copy_to(data_dir: Path) -> Path:
        target = Path(data_dir) / "models" / built.name
        if not is_built(target, "tiny"):
            shutil.copytree(built, target)
        return target

    return copy_to


@pytest.fixture(scope="session")
def demo_profile(demo_model, tmp_path_factory) -> Profile:
    """The demo model's profile under `services.stack.MODEL`, measured once, with the plan
    `running_stack` measures when it is given no profile: every stack of the session that serves
    the demo model stores this one instead of measuring its own."""
    from services.profiler.run import profile_model
    from services.stack import MODEL, running_stack

    plan = inspect.signature(running_stack).parameters["plan"].default
    model_dir = demo_model(tmp_path_factory.mktemp("demo-profile"))
    # Measured twice, the faster of the two kept at every point: a run that another process
    # starved would otherwise price every stack of the session as too slow for its SLOs.
    first, second = (profile_model(model_dir, MODEL, plan=plan)[0] for _ in range(2))
    return fastest_of(first, second)


def fastest_of(a: Profile, b: Profile) -> Profile:
    """`a` with every measured time the smaller of `a`'s and `b`'s (same plan, same model)."""
    low = lambda x, y: [min(p, q) for p, q in zip(x, y)]  # noqa: E731
    return replace(
        a, prefill=replace(a.prefill, seconds=low(a.prefill.seconds, b.prefill.seconds)),
        decode=replace(a.decode, seconds=[low(x, y) for x, y in zip(a.decode.seconds,
                                                                    b.decode.seconds)]),
        load_s=min(a.load_s, b.load_s), engine_init_s=min(a.engine_init_s, b.engine_init_s))


@pytest.fixture(scope="session")
def demo_model_dir(demo_model, tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def stack(tmp_path_factory, demo_model_dir, demo_profile: Profile):
    """The session's stack (`services.stack`: nats-server, valkey, the placer, a CPU node and the
    gateway as real processes, started the way `slinfer up` starts them) serving the demo model.
    One for the e2e and gateway tests that do not stop its services, not one per directory."""
    from services.stack import running_stack

    with running_stack(tmp_path_factory.mktemp("stack"), demo_model_dir, profile=demo_profile) as s:
        yield s
