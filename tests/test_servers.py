"""The real servers start from their wheels and answer; redis keeps its data across a restart;
nothing a test process starts outlives it, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import nats
import pytest
import redis
import redis.asyncio as aioredis

from shared.servers import ServerProcess, start_nats, start_redis

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


async def test_nats_has_jetstream(nats_url):
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


async def test_redis_roundtrip(redis_url):
    r = aioredis.from_url(redis_url)
    try:
        await r.set("slinfer:test", b"x")
        assert await r.get("slinfer:test") == b"x"
    finally:
        await r.aclose()


# ---------------------------------------------------------------- helpers


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (a killed orphan stays a zombie until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still alive after `timeout_s` (polled; empty when all are gone)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- durability


def test_redis_keeps_its_data_when_killed_and_restarted(tmp_path) -> None:
    server = start_redis(tmp_path / "redis", password="pw")
    try:
        client = redis.Redis.from_url(server.url)
        client.hset("slinfer:models", "tiny", b"record")
        client.close()
        port, pid = server.port, server.proc.pid
        os.kill(pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        server = server.again()  # same port, same data directory, same password
        assert server.port == port and server.proc.pid != pid
        client = redis.Redis.from_url(server.url)
        assert client.hget("slinfer:models", "tiny") == b"record"
        client.close()
    finally:
        server.stop()


# ---------------------------------------------------------------- nothing outlives its starter


def test_a_server_started_from_a_worker_thread_outlives_that_thread(tmp_path) -> None:
    """PDEATHSIG fires when the forking *thread* exits: a server started from a short-lived
    thread (asyncio.to_thread, an executor) must not die with it."""
    started: list[ServerProcess] = []
    worker = threading.Thread(target=lambda: started.append(start_nats(tmp_path / "nats")))
    worker.start()
    worker.join()
    try:
        time.sleep(1.0)  # a death signal would have arrived by now
        assert started and started[0].proc.poll() is None
    finally:
        for server in started:
            server.stop()


PYTEST_SESSION = textwrap.dedent('''
    """A pytest session using the suite's server fixtures (and one server started from a worker
    thread), that writes their pids and then dies the way the test asks."""
    import ctypes, os, threading, time
    from pathlib import Path
    from shared.servers import start_redis
    from tests.conftest import nats_server, redis_server  # noqa: F401 (fixtures)

    def test_then_die(nats_server, redis_server, tmp_path):
        extra = []
        t = threading.Thread(target=lambda: extra.append(start_redis(tmp_path / "extra")))
        t.start(); t.join()
        pids = [nats_server.proc.pid, redis_server.proc.pid, extra[0].proc.pid]
        Path(os.environ["PIDS_FILE"]).write_text(" ".join(map(str, pids)))
        go = Path(os.environ["PIDS_FILE"] + ".go")  # the test has seen them running
        for _ in range(6000):
            if go.exists() and os.environ["HOW"] == "segfault":
                ctypes.string_at(0)  # SIGSEGV in this process
            time.sleep(0.1)  # until killed from outside
''')


@pytest.mark.parametrize("how", ["SIGKILL", "segfault"])
def test_fixture_servers_die_with_the_pytest_process(tmp_path, how) -> None:
    (tmp_path / "test_session.py").write_text(PYTEST_SESSION)
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIDS_FILE": str(pids_file), "HOW": how}
    with open(tmp_path / "out.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--basetemp", str(tmp_path / "bt"), str(tmp_path / "test_session.py")],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_file.exists(), (tmp_path / "out.log").read_text()
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(pid_alive(p) for p in pids)
        Path(f"{pids_file}.go").touch()
        if how == "SIGKILL":
            proc.kill()
        expected = -signal.SIGKILL if how == "SIGKILL" else -signal.SIGSEGV
        assert proc.wait(timeout=60) == expected, (tmp_path / "out.log").read_text()
        assert not wait_gone(pids), f"left running after pytest died by {how}: {pids}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(pids)


def test_free_ports_are_outside_the_ephemeral_range_and_never_repeat():
    """Server ports from below the range the kernel gives outgoing connections (so no client
    socket can take one before its server binds it), each handed out once per process."""
    from shared.servers import PORT_RANGE, free_port

    low, _high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_RANGE[0] <= p <= PORT_RANGE[1] < low for p in ports)
