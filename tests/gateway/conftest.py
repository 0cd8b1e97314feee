"""Gateway test fixtures: the real app served by uvicorn on a free port, against real NATS and
Redis, with a tiny model directory from `shared.modelgen`.

The gateway tests get their own nats-server and valkey (package scope): they publish on the real
request stream and read it back with a stand-in responder, which must not meet a placer started by
another test package on the session's servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
import uvloop
from redis import Redis as SyncRedis

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared import wire
from shared.registry import model_id, model_record_from_dir
from shared.servers import ServerProcess, free_port, start_nats, start_redis
from shared.subjects import MODELS_HASH
from tests.gateway.responder import Responder
from tests.servers import running

API_KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
OPERATOR_KEY = "key-op"
PUBLIC_MODEL = "tiny"  # public, max_context from the directory (2048)
SHORT_MODEL = "tiny-short"  # public, max_context 64: context-length errors
PRIVATE_A = "a-private"  # private to tenant-a (its registry id: model_id(PRIVATE_A, "tenant-a"))


@pytest.fixture(scope="package")
def _gw_nats(tmp_path_factory) -> Iterator[ServerProcess]:
    with running(start_nats, tmp_path_factory.mktemp("gw-nats")) as server:
        yield server


@pytest.fixture(scope="package")
def _gw_redis(tmp_path_factory) -> Iterator[ServerProcess]:
    with running(start_redis, tmp_path_factory.mktemp("gw-redis")) as server:
        yield server


@pytest.fixture(scope="package")
def nats_url(_gw_nats: ServerProcess) -> str:
    return _gw_nats.url


@pytest.fixture(scope="package")
def redis_url(_gw_redis: ServerProcess) -> str:
    return _gw_redis.url


@pytest.fixture(scope="package")
def model_dir(demo_model, tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory.mktemp("gw-data"))


def copy_model(src: Path, dst: Path) -> Path:
    """A model directory of hard links to `src`'s files (no symlink: those are checked)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            os.link(f, dst / f.name)
    return dst


@pytest.fixture(scope="package")
def tenant_models(tmp_path_factory, model_dir: Path) -> Path:
    """SLINFER_TENANT_MODELS_DIR: <dir>/tenant-a/tiny and <dir>/tenant-b/tiny hold the model."""
    root = tmp_path_factory.mktemp("gw-tenants")
    for tenant in API_KEYS.values():
        copy_model(model_dir, root / tenant / "tiny")
    return root


@pytest.fixture(scope="package")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="package")
def seeded_models(redis_url: str, model_dir: Path) -> dict[str, object]:
    """The registry as most tests expect it (written directly, not through the API under test)."""
    base = model_record_from_dir(PUBLIC_MODEL, model_dir)
    records = {
        PUBLIC_MODEL: base,
        SHORT_MODEL: dataclasses.replace(base, name=SHORT_MODEL, max_context=64),
        PRIVATE_A: dataclasses.replace(base, name=model_id(PRIVATE_A, "tenant-a"), owner="tenant-a"),
    }
    r = SyncRedis.from_url(redis_url)
    for record in records.values():
        r.hset(MODELS_HASH, record.name, wire.encode(record))
    r.close()
    return records


@dataclass
class RunningGateway:
    url: str
    settings: GatewaySettings
    server: uvicorn.Server
    thread: threading.Thread
    loop: list = dataclasses.field(default_factory=list)  # the gateway's event loop, once running

    def stop(self) -> None:
        """Stop it; one that is still running 15 s later fails with what its loop is doing (a
        gateway left running in the test process goes on logging after its servers are gone)."""
        self.server.should_exit = True
        self.thread.join(timeout=15)
        if self.thread.is_alive():
            raise AssertionError(f"the gateway at {self.url} did not stop:\n{_tasks(self.loop)}")


def _tasks(loop: list) -> str:
    out = io.StringIO()
    for task in asyncio.all_tasks(loop[0]) if loop else ():
        task.print_stack(file=out)
    return out.getvalue()


def start_gateway(settings: GatewaySettings) -> RunningGateway:
    """Serve `create_app(settings)` with uvicorn in a thread (its own event loop)."""
    # A bounded graceful shutdown, as `slinfer gateway` has (services/gateway/__main__.py): a
    # response still streaming to a client that stopped reading is cancelled after 5 s.
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            access_log=False)
    server = uvicorn.Server(config)
    loop: list = []

    async def serve() -> None:
        loop.append(asyncio.get_running_loop())
        await server.serve()

    def run() -> None:  # on uvloop, as uvicorn runs it
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())

    thread = threading.Thread(target=run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    return RunningGateway(f"http://{settings.host}:{settings.port}", settings, server, thread, loop)


@pytest.fixture(scope="package")
def make_settings(nats_url: str, redis_url: str, model_dir: Path, tenant_models: Path):
    def make(**overrides) -> GatewaySettings:
        base = GatewaySettings(nats_url=nats_url, redis_url=redis_url, host="127.0.0.1",
                               port=free_port(), api_keys=API_KEYS, max_body_bytes=64 * 1024,
                               request_timeout_s=10.0, default_max_tokens=16,
                               operator_keys=frozenset({OPERATOR_KEY}),
                               model_roots=(model_dir.parent,), tenant_models_dir=tenant_models,
                               access_log=False)  # (as uvicorn's was: tests read stderr)
        return dataclasses.replace(base, **overrides)

    return make


@pytest.fixture(scope="package")
def gateway(make_settings, seeded_models) -> Iterator[RunningGateway]:
    """The gateway with API keys (tenant-a, tenant-b)."""
    gw = start_gateway(make_settings())
    yield gw
    gw.stop()


@pytest.fixture(scope="package")
def local_gateway(make_settings, seeded_models) -> Iterator[RunningGateway]:
    """The gateway with no API keys: no auth, tenant "local", loopback only."""
    gw = start_gateway(make_settings(api_keys={}, operator_keys=frozenset()))
    yield gw
    gw.stop()


@pytest.fixture
def client_a(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer key-a"},
                      timeout=20, trust_env=False) as c:
        yield c


@pytest.fixture
def client_b(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer key-b"},
                      timeout=20, trust_env=False) as c:
        yield c


@pytest.fixture
def client_op(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                      timeout=20, trust_env=False) as c:
        yield c


@pytest.fixture
async def responder(gateway: RunningGateway, nats_url: str, hf_tokenizer):
    """Stands in for placer + node: pulls the request stream and plays a scripted token stream.
    Depends on `gateway` so the request stream exists before it subscribes."""
    r = Responder(nats_url, hf_tokenizer)
    await r.start()
    yield r
    await r.stop()


@pytest.fixture(scope="package")
def openvino_model(redis_url, seeded_models) -> str:
    """The public tiny model registered again on the OpenVINO engine, whose sampling is its own."""
    name = "tiny-openvino"
    record = dataclasses.replace(seeded_models[PUBLIC_MODEL], name=name, engine="openvino")
    r = SyncRedis.from_url(redis_url)
    r.hset(MODELS_HASH, name, wire.encode(record))
    r.close()
    return name
