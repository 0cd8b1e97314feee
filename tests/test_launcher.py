"""`slinfer up`: starts everything, serves, and on SIGINT/SIGTERM leaves no process behind.

Two layers:
- stand-in services (a tiny HTTP gateway, sleeping placer/nodes, one that ignores SIGTERM, one
  that forks a grandchild) exercise the launcher's process handling on real nats/redis servers;
- the real stack (gateway, placer, node, the random demo model) end to end.

"No process behind" is checked by scanning /proc for any live process whose command line or
environment mentions the run's data directory (every child gets SLINFER_DATA_DIR; nats and redis
get it on their command line), and by checking every pid in the launcher's pidfile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from services import launcher
from shared.servers import free_port

REPO = Path(__file__).resolve().parents[1]
NUL = bytes(1)
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

FAKE_GATEWAY = textwrap.dedent('''
    """Stand-in gateway: /health, /v1/models and the admin model API, plus a grandchild
    process that ignores SIGTERM (the launcher must still take it down with the group)."""
    import json, os, subprocess, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    models = {}

    class H(BaseHTTPRequestHandler):
        def _send(self, code, body=None):
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": n, "object": "model"} for n in models]})
            self._send(404, {"error": {"message": "no"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if set(body) - {"name", "path", "engine", "slo_class", "public", "replace"}:
                return self._send(400, {"error": {"message": "unknown field"}})
            if not os.path.isfile(os.path.join(body["path"], "config.json")):
                return self._send(400, {"error": {"message": "not a model directory"}})
            if body["name"] in models and not body.get("replace"):
                return self._send(409, {"error": {"message": "exists"}})
            models[body["name"]] = body
            self._send(201, body)

        def log_message(self, *a):
            pass

    host, port = os.environ["SLINFER_GATEWAY_HOST"], int(os.environ["SLINFER_GATEWAY_PORT"])
    print("fake gateway on", host, port, flush=True)
    ThreadingHTTPServer((host, port), H).serve_forever()
''')

FAKE_WORKER = textwrap.dedent('''
    """Stand-in placer/node: sleeps; FAKE_DIE=<node id> makes that node crash a second after
    every start, FAKE_CRASH_ONCE=<node id> after its first start only; FAKE_STUBBORN=1 makes the
    placer ignore SIGTERM (the launcher must SIGKILL it). A node joins the cluster as a node
    does (its id in the node set, a snapshot key), FAKE_JOIN_DELAY_S after it started."""
    import os, signal, sys, time
    import redis
    from shared.subjects import NODES_SET, node_key
    for name in ("SLINFER_NATS_URL", "SLINFER_REDIS_URL", "SLINFER_DATA_DIR"):
        assert os.environ[name], name
    me = os.environ.get("SLINFER_NODE_ID", "placer")
    if os.environ.get("FAKE_STUBBORN") == "1" and me == "placer":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(me, "hardware", os.environ.get("SLINFER_NODE_HARDWARE"), flush=True)
    marker = os.path.join(os.environ["SLINFER_DATA_DIR"], f"crashed-{me}")
    once = os.environ.get("FAKE_CRASH_ONCE") == me and not os.path.exists(marker)
    if os.environ.get("FAKE_DIE") == me or once:
        open(marker, "w").close()
        time.sleep(1)
        print("boom: fake failure in", me, flush=True)
        sys.exit(3)
    if me != "placer":
        time.sleep(float(os.environ.get("FAKE_JOIN_DELAY_S", "0")))
        print(me, "joined", flush=True)  # first: once the launcher sees it, the log has it
        client = redis.Redis.from_url(os.environ["SLINFER_REDIS_URL"])
        client.set(node_key(me), b"snapshot", ex=600)
        client.sadd(NODES_SET, me)
    time.sleep(600)
''')

DRIVER = textwrap.dedent('''
    import os, sys
    from services import launcher
    launcher.CHILD_MODULES = {"placer": "fake_worker", "node": "fake_worker",
                              "gateway": os.environ.get("FAKE_GATEWAY_MODULE", "fake_gateway")}
    launcher.PROFILER_MODULE = None  # stand-ins need no timing profile
    launcher.STOP_TIMEOUT_S = 2.0
    # Short restart delays; a crash 1 s after each start is a crash loop (give up after 3).
    launcher.RESTART_DELAY_S, launcher.HEALTHY_AFTER_S, launcher.GIVE_UP_AFTER = 0.2, 30.0, 3
    sys.exit(launcher.main(sys.argv[1:]))
''')


# ---------------------------------------------------------------- helpers


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def live_processes_mentioning(marker: str) -> list[str]:
    """Live (non-zombie) processes whose cmdline or environment contains `marker`."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if state != "Z" and (needle in cmdline or needle in environ):
            found.append(f"{entry.name}: {cmdline.replace(NUL, b' ').decode(errors='replace')}")
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen, out: Path, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"slinfer up exited ({proc.returncode}) while waiting for {what}:\n{_read(out)}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{_read(out)}")


def get_json(url: str):
    try:
        with _http.open(url, timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def assert_nothing_left(data_dir: Path, proc: subprocess.Popen) -> None:
    pids = json.loads((data_dir / "slinfer-up.pids").read_text())
    assert {"nats", "redis", "placer", "node-0", "gateway", "launcher"} <= set(pids), pids
    deadline = time.monotonic() + 5  # orphans reparented to init may take a moment to be reaped
    while time.monotonic() < deadline:
        alive = [f"{n}={p}" for n, p in pids.items() if pid_alive(p)]
        left = live_processes_mentioning(str(data_dir))
        if not alive and not left:
            return
        time.sleep(0.2)
    pytest.fail(f"processes left behind: pidfile {alive}, /proc scan {left}")


def start_up(args: list[str], out: Path, env: dict[str, str], driver: bool) -> subprocess.Popen:
    argv = [sys.executable, "-c", DRIVER] if driver else [sys.executable, "-m", "services.cli", "up"]
    with open(out, "wb") as log:
        return subprocess.Popen(argv + args, cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_forcefully(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    fake_dir = tmp_path / "fakes"
    fake_dir.mkdir()
    (fake_dir / "fake_gateway.py").write_text(FAKE_GATEWAY)
    (fake_dir / "fake_worker.py").write_text(FAKE_WORKER)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_dir), str(REPO), env.get("PYTHONPATH", "")])
    env.pop("SLINFER_API_KEYS", None)
    return env


# ---------------------------------------------------------------- argument checks


def test_refuses_public_host_without_api_keys(monkeypatch, capsys) -> None:
    monkeypatch.delenv("SLINFER_API_KEYS", raising=False)
    with pytest.raises(SystemExit) as exc:
        launcher.parse_args(["--host", "0.0.0.0"])
    assert exc.value.code == 2
    assert "SLINFER_API_KEYS" in capsys.readouterr().err


def test_rejects_model_dir_without_config(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(["--model-dir", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err


def test_rejects_zero_nodes(capsys) -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(["--nodes", "0"])
    assert "--nodes must be >= 1" in capsys.readouterr().err


def test_the_default_model_is_the_real_smollm2(real_model_dir) -> None:
    """With neither --model-dir nor --random-model, `slinfer up` serves the real model, from
    the data directory's models/ (the fixture converted it there once: nothing is redone)."""
    from shared.default_model import NAME

    opts = launcher.parse_args(["--data-dir", str(real_model_dir.parents[1])])
    assert launcher.resolve_model(opts) == (NAME, real_model_dir)
    opts = launcher.parse_args(["--data-dir", str(real_model_dir.parents[1]),
                                "--model-name", "smol"])
    assert launcher.resolve_model(opts) == ("smol", real_model_dir)


def test_random_model_is_the_tiny_demo_and_excludes_model_dir(tmp_path, capsys) -> None:
    opts = launcher.parse_args(["--data-dir", str(tmp_path), "--random-model"])
    assert launcher.resolve_model(opts) == ("tiny-llama", tmp_path / "models" / "tiny-llama")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        launcher.parse_args(["--random-model", "--model-dir", str(tmp_path)])
    assert "give one" in capsys.readouterr().err


def test_backoff_doubles_caps_resets_after_a_healthy_run_and_gives_up() -> None:
    b = launcher.Backoff(first_s=0.5, max_s=3.0, healthy_s=60.0, give_up_after=6)
    assert [b.after_crash(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]  # capped
    assert b.after_crash(1.0) is None  # the 6th fast crash in a row: give up
    b = launcher.Backoff(first_s=0.5, max_s=30.0, healthy_s=60.0, give_up_after=3)
    assert [b.after_crash(1.0), b.after_crash(1.0)] == [0.5, 1.0]
    assert b.after_crash(61.0) == 0.5  # a minute of running ended the row
    assert b.after_crash(1.0) == 1.0 and b.after_crash(1.0) is None


def test_exit_status_names_the_signal() -> None:
    assert launcher.exit_status(3) == "exited with code 3"
    assert launcher.exit_status(-signal.SIGSEGV) == "was killed by SIGSEGV"


# ---------------------------------------------------------------- stand-in services


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_lifecycle_with_stand_ins(tmp_path, fakes, sig) -> None:
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    # The placer ignores SIGTERM: needs the SIGKILL path. The nodes join seconds after they
    # start (a real one loads its engine first): the banner must wait for them.
    env = fakes | {"FAKE_STUBBORN": "1", "FAKE_JOIN_DELAY_S": "3"}
    args = ["--port", str(port), "--nodes", "2", "--data-dir", str(data_dir),
            "--model-dir", str(tmp_path / "model"), "--model-name", "tiny"]
    proc = start_up(args, out, env, driver=True)
    try:
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 60, proc, out, "the banner")
        for node in ("node-0", "node-1"):  # joined before the banner said "up"
            assert "joined" in _read(data_dir / "logs" / f"{node}.log"), _read(out)
        models = get_json(f"http://127.0.0.1:{port}/v1/models")
        assert [m["id"] for m in models["data"]] == ["tiny"]
        text = _read(out)
        assert f"http://127.0.0.1:{port}" in text and "nats://127.0.0.1:" in text
        assert "auth is off" in text and 'model="tiny"' in text
        assert "hardware cpu" in _read(data_dir / "logs" / "node-1.log")
        # nats, redis, placer, 2 nodes, gateway and the gateway's grandchild
        assert len(live_processes_mentioning(str(data_dir))) >= 7

        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == 0, _read(out)
        assert "placer did not stop" in _read(out)  # the stubborn one was killed
        assert_nothing_left(data_dir, proc)
    finally:
        stop_forcefully(proc)


@pytest.mark.integration
def test_registration_replaces_and_reports_gateway_errors(tmp_path, fakes) -> None:
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    args = ["--port", str(port), "--data-dir", str(data_dir), "--model-dir", str(tmp_path / "model")]
    proc = start_up(args, out, fakes, driver=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 60, proc, out, "the banner")
        launcher.register_model(url, "model", tmp_path / "model")  # same name again: replaced
        assert [m["id"] for m in get_json(f"{url}/v1/models")["data"]] == ["model"]
        with pytest.raises(RuntimeError, match="HTTP 400: .*not a model directory"):
            launcher.register_model(url, "other", tmp_path / "nowhere")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        stop_forcefully(proc)


def read_pids(data_dir: Path) -> dict[str, int]:
    try:
        return json.loads((data_dir / "slinfer-up.pids").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.integration
def test_crashed_child_is_restarted_alone(tmp_path, fakes) -> None:
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    args = ["--port", str(port), "--nodes", "2", "--data-dir", str(data_dir),
            "--model-dir", str(tmp_path / "model")]
    proc = start_up(args, out, fakes | {"FAKE_CRASH_ONCE": "node-1"}, driver=True)
    try:
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 60, proc, out, "the banner")
        wait_for(lambda: "node-1 restarted" in _read(out), 60, proc, out, "node-1's restart")
        text = _read(out)
        assert "node-1 exited with code 3 after" in text and "restarting in 0.2s" in text, text
        pids = read_pids(data_dir)
        assert pid_alive(pids["node-1"]) and "hardware cpu" in _read(data_dir / "logs" / "node-1.log")
        # Nothing else was touched: every other process still runs, the gateway still answers.
        assert all(pid_alive(pids[n]) for n in ("nats", "redis", "placer", "node-0", "gateway"))
        assert "restarted" not in text.replace("node-1 restarted", "")
        assert get_json(f"http://127.0.0.1:{port}/v1/models") is not None
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, _read(out)
        assert_nothing_left(data_dir, proc)
    finally:
        stop_forcefully(proc)


@pytest.mark.integration
def test_crash_loop_gives_up_with_the_log_and_stops_everything(tmp_path, fakes) -> None:
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    args = ["--port", str(port), "--nodes", "2", "--data-dir", str(data_dir),
            "--model-dir", str(tmp_path / "model")]
    proc = start_up(args, out, fakes | {"FAKE_DIE": "node-1"}, driver=True)
    try:
        code = proc.wait(timeout=120)
        text = _read(out)
        assert code == 1, text
        assert text.count("node-1 exited with code 3 after") == 2, text  # each restart logged
        assert "restarting in 0.2s" in text and "restarting in 0.4s" in text  # backing off
        assert "node-1 crashed 3 times in a row" in text and "giving up" in text
        assert "boom: fake failure in node-1" in text  # the log tail
        assert_nothing_left(data_dir, proc)
    finally:
        stop_forcefully(proc)


@pytest.mark.integration
def test_killed_launcher_takes_its_children_with_it(tmp_path, fakes) -> None:
    """SIGKILL leaves the launcher no chance to clean up: the kernel kills its children
    (PR_SET_PDEATHSIG). Grandchildren are their parent's business: the stand-in gateway's
    SIGTERM-proof grandchild is cleaned up here, not checked."""
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    args = ["--port", str(port), "--nodes", "2", "--data-dir", str(data_dir),
            "--model-dir", str(tmp_path / "model")]
    proc = start_up(args, out, fakes, driver=True)
    try:
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 60, proc, out, "the banner")
        pids = read_pids(data_dir)
        children = {n: p for n, p in pids.items() if n != "launcher"}
        assert set(children) == {"nats", "redis", "placer", "node-0", "node-1", "gateway"}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (alive := [n for n, p in children.items() if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"still running after the launcher was killed: {alive}"
    finally:
        stop_forcefully(proc)
        # Whatever is left (valkey renames itself: the pidfile finds it, the scan may not).
        leftovers = {int(line.split(":")[0]) for line in live_processes_mentioning(str(data_dir))}
        leftovers |= {p for n, p in read_pids(data_dir).items() if n != "launcher"}
        for pid in leftovers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def demo_model_dir(demo_model, tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory.mktemp("demo"))


def registered(redis_url: str, name: str) -> bool:
    import redis

    from shared.subjects import MODELS_HASH

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return client.hget(MODELS_HASH, name) is not None
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_restarted(name: str, old_pid: int, data_dir: Path, proc, out: Path) -> int:
    wait_for(lambda: read_pids(data_dir).get(name, old_pid) != old_pid, 60, proc, out,
             f"{name} restarted")
    return read_pids(data_dir)[name]


@pytest.mark.integration
@pytest.mark.slow
def test_killed_servers_restart_with_their_data(tmp_path, fakes, demo_model_dir) -> None:
    """The real gateway registers the model in Redis; valkey and nats are SIGKILLed; the
    launcher restarts them on the same ports and data: the registry entry is still there (and
    the gateway lists it again), and the request stream is still in JetStream."""
    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    args = ["--port", str(port), "--data-dir", str(data_dir), "--model-dir", str(demo_model_dir),
            "--model-name", "tiny"]
    proc = start_up(args, out, fakes | {"FAKE_GATEWAY_MODULE": "services.gateway"}, driver=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 180, proc, out, "the banner")
        redis_url = _read(out).split("  redis     ")[1].split()[0]
        nats_url = _read(out).split("  nats      ")[1].split()[0]
        assert registered(redis_url, "tiny")
        pids = read_pids(data_dir)

        os.kill(pids["redis"], signal.SIGKILL)
        wait_restarted("redis", pids["redis"], data_dir, proc, out)
        assert "redis was killed by SIGKILL after" in _read(out)
        assert registered(redis_url, "tiny"), "the registry did not survive a redis restart"
        wait_for(lambda: "tiny" in [m["id"] for m in (get_json(f"{url}/v1/models") or {})
                                    .get("data", [])], 60, proc, out, "the gateway to list it")

        os.kill(pids["nats"], signal.SIGKILL)
        wait_restarted("nats", pids["nats"], data_dir, proc, out)
        assert stream_exists(nats_url, "SLINFER_REQUESTS")
        assert all(pid_alive(read_pids(data_dir)[n]) for n in ("placer", "node-0", "gateway"))
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, _read(out)
        assert_nothing_left(data_dir, proc)
    finally:
        stop_forcefully(proc)


def stream_exists(nats_url: str, stream: str) -> bool:
    import asyncio

    import nats

    async def check() -> bool:
        nc = await nats.connect(nats_url)
        try:
            return (await nc.jetstream().stream_info(stream)) is not None
        finally:
            await nc.close()

    return asyncio.run(check())


def processes_using(directory: Path) -> list[str]:
    """Live processes with a file under `directory` open (every service's log is)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if pid_alive(int(entry.name)) and any(t.startswith(str(directory)) for t in targets):
            found.append(f"{entry.name}: {_read(entry / 'comm').strip()}")
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_running_stack_stops_what_it_started_when_its_start_fails(tmp_path, demo_model,
                                                                  demo_profile) -> None:
    """services.stack (the e2e/ops fixtures' stack): a service that cannot start fails the
    fixture, and the servers and services already started are stopped, not left behind."""
    from services.stack import running_stack

    model_dir = demo_model(tmp_path)
    data = tmp_path / "stack"
    broken = {"gateway": {"SLINFER_GATEWAY_PORT": "not-a-port"}}
    with pytest.raises(RuntimeError, match="gateway exited"):
        with running_stack(data, model_dir, child_env=broken, profile=demo_profile):
            pytest.fail("the stack came up with a gateway that cannot start")
    deadline = time.monotonic() + 10
    while (left := processes_using(data)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running: {left}"


# ---------------------------------------------------------------- the real stack


def stream_one_chat_completion(base: str, model: str) -> None:
    """What the README tells a newcomer to do right after `make run`."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["length"], ["stop"]), (text, finish)


def _missing_services() -> list[str]:
    needed = ["services/placer/__main__.py", "services/node/__main__.py",
              "services/gateway/__main__.py", "shared/modelgen.py"]
    return [p for p in needed if not (REPO / p).exists()]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(_missing_services()),
                    reason=f"real stack not written yet: missing {', '.join(_missing_services())}")
def test_slinfer_up_serves_the_demo_model_and_stops_cleanly(tmp_path) -> None:
    from services.profiler.run import read_report

    data_dir, out, port = tmp_path / "data", tmp_path / "up.out", free_port()
    env = dict(os.environ)
    env.pop("SLINFER_API_KEYS", None)
    # The random demo: its build and profile take seconds where the default real model's
    # conversion and profile take minutes (tests/engines/test_real_model.py runs that one).
    # One short request needs no more of the profile than these bounds (the default's grid,
    # up to 1024 tokens and batches of 16, takes minutes on two busy cores).
    env |= {"SLINFER_PROFILE_MAX_LEN": "64", "SLINFER_PROFILE_MAX_BATCH": "2"}
    proc = start_up(["--port", str(port), "--data-dir", str(data_dir), "--random-model"], out,
                    env, driver=False)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get_json(f"{base}/health") is not None, 420, proc, out, "/health")
        wait_for(lambda: (get_json(f"{base}/v1/models") or {}).get("data"), 120, proc, out,
                 "a model in /v1/models")
        wait_for(lambda: "Ctrl+C stops everything" in _read(out), 60, proc, out, "the banner")
        assert "auth is off" in _read(out)
        model = get_json(f"{base}/v1/models")["data"][0]["id"]
        [cached] = (data_dir / "profiles").glob("*-cpu.json")
        profile = read_report(cached)
        assert (profile.decode.lengths[-1], profile.decode.batch_sizes) == (64, [1, 2])
        stream_one_chat_completion(base, model)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, _read(out)
        assert "did not stop" not in _read(out), f"a service ignored SIGTERM:\n{_read(out)}"
        assert_nothing_left(data_dir, proc)
    finally:
        stop_forcefully(proc)


def test_with_auth_on_the_stack_registers_its_model_as_the_operator(monkeypatch, tmp_path):
    """Public models are operator-only: with tenant keys and no operator key, `slinfer up` makes
    one that its gateway inherits and registers with it (not with a tenant's key, a 403)."""
    from services import launcher as L

    monkeypatch.setenv("SLINFER_API_KEYS", "tenant-key:acme")
    monkeypatch.delenv("SLINFER_OPERATOR_KEYS", raising=False)
    headers = L._admin_headers()
    made = os.environ["SLINFER_OPERATOR_KEYS"]
    assert made and made != "tenant-key" and headers["Authorization"] == f"Bearer {made}"
    opts = L.parse_args(["--data-dir", str(tmp_path)])
    assert L.child_env(opts, "nats://x:1", "redis://x:2")["SLINFER_OPERATOR_KEYS"] == made
    monkeypatch.setenv("SLINFER_OPERATOR_KEYS", "op-1,op-2")
    assert L._admin_headers()["Authorization"] == "Bearer op-1"
    monkeypatch.delenv("SLINFER_API_KEYS")
    assert "Authorization" not in L._admin_headers()  # no auth: the local caller is the operator
