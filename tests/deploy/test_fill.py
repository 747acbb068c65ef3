"""The manifests that bring weights into the cluster (components/fill, components/fill-per-pod,
overlays/kserve-storage-uri; docs/deploy.md, "Weights into the cluster"), marker `deploy`:

1. the fill Job, the per-pod init container and the KServe variant follow the design: the project's image running
   kev-fill, non-root on a read-only root with requests and limits, the keys from a Secret mounted as files, the volume
   written where Triton reads KEV_CHECKPOINT and KEV_BASE, and arguments kev-fill itself accepts;
2. under `podman kube play`, the Job's pod (played as a Pod: podman 4.3 plays Pods and Deployments, not Jobs) fills a
   podman volume from an S3-compatible server on loopback (moto, signatures checked), refuses a corrupted object with
   a non-zero exit and nothing at its name, completes once the store is fixed, and the local Triton pod then answers
   from that volume (a checkpoint of another seed than the image's own: other answers than README's).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kev_backend.dev import synthetic
from kev_backend.serve.fill import cli, s3
from kev_backend.serve.fill.names import MARKER
from tests.deploy.test_manifests import IMAGE, find, objects, podman, triton_pods, wait_ready, where
from tests.helpers import README_ANSWERS, README_REQUEST, TRITON_HTTP
from tests.serve.fill.conftest import S3Store, s3_store, sha256sums  # noqa: F401 (s3_store: a fixture)

pytestmark = pytest.mark.deploy

SECURE = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
          "capabilities": {"drop": ["ALL"]}}  # fmt: skip
KEYS = "/var/run/secrets/kev-fill"


def config_map(name: str, ref: str) -> dict[str, str]:
    """The data of the ConfigMap `ref` names (kustomize adds a hash to the generated name)."""
    return next(o for o in objects(name) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == ref)["data"]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in a container's args, as the kubelet expands them."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def expanded_args(name: str, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The container's args as the kubelet runs them ($(VAR) from its env) and its env, ConfigMap values resolved."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_map(name, ref["name"])[ref["key"]]
    return expand(container["args"], env), env


def check_fill_container(name: str, spec: dict[str, Any], container: dict[str, Any]) -> None:
    assert container["image"] == "registry.example.com/kev/kev-on-triton:0.1.0", where(container)
    assert container["command"] == ["/opt/kev/.venv/bin/kev-fill"]
    assert container["securityContext"] == SECURE
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys() <= container["resources"]["limits"].keys()
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    # Keys as files from the Secret, never in the environment.
    assert not [e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[KEYS]["name"]]["secret"]["secretName"] == "kev-fill-credentials" and mounts[KEYS]["readOnly"]
    assert not mounts["/models"].get("readOnly")
    # Arguments kev-fill accepts, a source it builds, and a volume holding what Triton loads.
    args, env = expanded_args(name, container)
    parsed = cli.parser().parse_args(args)
    assert parsed.source == "s3" and str(parsed.dest) == "/models"
    assert env["AWS_ACCESS_KEY_ID_FILE"].startswith(KEYS + "/") and env["AWS_SECRET_ACCESS_KEY_FILE"].startswith(KEYS)
    source = s3.S3Source(parsed.url, env["AWS_ENDPOINT_URL_S3"], env["AWS_REGION"], transport=None)  # type: ignore[arg-type]
    assert source.prefix.endswith("/") and source.scheme == "https"
    _, serving = triton_pods("overlays/gpu")
    serving_env = {e["name"]: e.get("value") for e in serving["env"]}
    assert serving_env["KEV_CHECKPOINT"].startswith("/models/") and serving_env["KEV_BASE"].startswith("/models/")


def test_the_fill_job() -> None:
    name = "overlays/gpu-fill"
    job = find(name, "Job", "kev-fill")
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 1
    (container,) = spec["containers"]
    check_fill_container(name, spec, container)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "kev-checkpoints"
    # The claim is shared: written by the Job, read by every Triton pod, which waits for the marker.
    claim = find(name, "PersistentVolumeClaim", "kev-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    triton_spec, triton = triton_pods(name)
    (wait,) = triton_spec["initContainers"]
    assert f"/models/{MARKER}" in " ".join(wait["command"]) and wait["securityContext"] == SECURE
    assert wait["image"] == triton["image"] == container["image"]
    # Nothing reaches the Job's pod; it reaches DNS and HTTPS only.
    policy = find(name, "NetworkPolicy", "kev-fill")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["ingress"] == [] and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    ports = sorted((p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"])
    assert ports == [(53, "TCP"), (53, "UDP"), (443, "TCP")]
    triton_volumes = {v["name"]: v for v in triton_spec["volumes"]}
    assert triton_volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "kev-checkpoints", "readOnly": True}


def test_the_per_pod_fill() -> None:
    name = "overlays/gpu-per-pod"
    spec, triton = triton_pods(name)
    (fill,) = spec["initContainers"]
    check_fill_container(name, spec, fill)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in fill["volumeMounts"]}
    volume = volumes[mounts["/models"]["name"]]
    assert set(volume) == {"name", "ephemeral"}, volume  # no shared claim left beside it
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    triton_mount = next(m for m in triton["volumeMounts"] if m["mountPath"] == "/models")
    assert triton_mount == {"name": volume["name"], "mountPath": "/models", "readOnly": True}
    assert not [o for o in objects(name) if o["kind"] == "PersistentVolumeClaim"]
    # The pod may now reach DNS and HTTPS, nothing else; ingress unchanged.
    policy = find(name, "NetworkPolicy", "kev-triton")
    ports = sorted((p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"])
    assert ports == [(53, "TCP"), (53, "UDP"), (443, "TCP")]
    assert policy["spec"]["ingress"] == find("overlays/gpu", "NetworkPolicy", "kev-triton")["spec"]["ingress"]


def test_kserve_with_a_storage_uri() -> None:
    name = "overlays/kserve-storage-uri"
    spec, container = triton_pods(name)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["STORAGE_URI"].startswith("s3://") and s3.parse_url(env["STORAGE_URI"])
    # KServe's storage initializer copies the prefix to /mnt/models.
    assert env["KEV_CHECKPOINT"] == "/mnt/models/kev-4b" and env["KEV_BASE"] == "/mnt/models/Qwen3.5-4B-Base"
    assert "/models" not in {m["mountPath"] for m in container["volumeMounts"]}
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert not [o for o in objects(name) if o["kind"] == "PersistentVolumeClaim"]
    # Everything else as deploy/kserve.
    _, plain = triton_pods("kserve")
    assert {k: v for k, v in container.items() if k not in ("env", "volumeMounts")} == {
        k: v for k, v in plain.items() if k not in ("env", "volumeMounts")
    }


# --- podman kube play ------------------------------------------------------------------------------------------


def pod_of_job(job: dict[str, Any], pod_name: str, volume: str, keys: Path, config: dict[str, str]) -> dict[str, Any]:
    """The Job's pod template as a Pod for podman 4.3 (which plays no Jobs), on the local image: the claim is the
    podman volume `volume`, the Secret a host folder of key files, ConfigMap values written in (`config`) and $(VAR)
    in args expanded."""
    spec = json.loads(json.dumps(job["spec"]["template"]["spec"]))
    for container in spec["containers"]:
        container["image"], container["imagePullPolicy"] = IMAGE, "IfNotPresent"
        for item in container["env"]:
            ref = item.pop("valueFrom", {}).get("configMapKeyRef")
            if ref:
                item["value"] = config[ref["key"]]
        # The kubelet expands $(VAR) in args; podman 4.3 does not.
        env = {item["name"]: item["value"] for item in container["env"]}
        container["args"] = expand(container["args"], env)
    for item in spec["volumes"]:
        if "persistentVolumeClaim" in item:
            item["persistentVolumeClaim"]["claimName"] = volume
        if "secret" in item:
            del item["secret"]
            item["hostPath"] = {"path": str(keys), "type": "Directory"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": job["spec"]["template"]
            ["metadata"]["labels"]}, "spec": spec}  # fmt: skip


def play_to_the_end(manifest: Path, container: str, timeout_s: float = 120) -> tuple[int, str]:
    """Plays a pod whose container runs to completion: its exit code and its log."""
    podman("kube", "play", "--network", "host", str(manifest))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            state = podman("inspect", container, "--format", "{{.State.Status}} {{.State.ExitCode}}").stdout.split()
            if state[0] in ("exited", "stopped") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state[0] in ("exited", "stopped"), f"{container} still {state[0]} after {timeout_s} s"
        return int(state[1]), podman("logs", container).stdout + podman("logs", container).stderr
    finally:
        down = podman("kube", "down", str(manifest), check=False)
        assert down.returncode == 0, down.stderr


def test_a_fill_then_triton_from_the_filled_volume_in_podman(
    s3_store: S3Store,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.fail(f"{IMAGE} is missing: PODMAN_ROOT=... make image")
    has_fill = podman("run", "--rm", "--entrypoint", "/opt/kev/.venv/bin/kev-fill", IMAGE, "--help", check=False)
    if has_fill.returncode != 0:
        pytest.fail(f"{IMAGE} has no kev-fill: rebuild it (make image)")
    # Another seed than the image's embedded checkpoint: its answers are not README's.
    synthetic.build(tmp_path / "ckpt", seed=1)
    files = {
        p.relative_to(tmp_path / "ckpt").as_posix(): p.read_bytes()
        for top in ("kev", "base")
        for p in sorted((tmp_path / "ckpt" / top).iterdir())
    }
    bucket, prefix = s3_store.bucket(), "kev-tiny/v1/"
    bad = "kev/adapter_model.safetensors"
    s3_store.put(bucket, {**files, bad: files[bad][::-1], "SHA256SUMS": sha256sums(files)}, prefix)

    tag = f"kev-fill-test-{os.getpid()}"
    volume = podman("volume", "create", tag).stdout.strip()
    try:
        # A fresh claim is root-owned on podman (a cluster applies fsGroup): the pod's user must write it.
        mountpoint = podman("volume", "inspect", volume, "--format", "{{.Mountpoint}}").stdout.strip()
        os.chown(mountpoint, 10001, 10001)
        keys = tmp_path / "keys"
        keys.mkdir()
        (keys / "AWS_ACCESS_KEY_ID").write_text(s3_store.access_key)
        (keys / "AWS_SECRET_ACCESS_KEY").write_text(s3_store.secret_key)
        for path in (keys, *keys.iterdir()):
            os.chown(path, 10001, 10001)
        job = find("overlays/gpu-fill", "Job", "kev-fill")
        config = {"url": f"s3://{bucket}/{prefix}", "endpoint": s3_store.url, "region": "us-east-1"}
        manifest = tmp_path / "fill.yaml"
        manifest.write_text(yaml.safe_dump(pod_of_job(job, tag, volume, keys, config)))
        box = f"{tag}-{job['spec']['template']['spec']['containers'][0]['name']}"

        # The corrupted object is refused: a non-zero exit naming it, nothing at its name, no marker.
        code, log = play_to_the_end(manifest, box)
        assert code == 1 and f"kev-fill: error: {bad}: refused: sha256" in log, log
        filled = Path(mountpoint)
        assert not (filled / bad).exists() and not (filled / MARKER).exists()
        assert not [p for p in filled.rglob("*") if p.name.endswith(".part")]

        # The store fixed, the same pod completes the fill: only what was missing is fetched.
        s3_store.put(bucket, {bad: files[bad]}, prefix)
        code, log = play_to_the_end(manifest, box)
        assert code == 0 and "marker written" in log, log
        # The first run placed the files before the refused one (in key order); the rest are fetched now.
        assert re.findall(r"kev-fill: fetched (\S+):", log) == sorted(n for n in files if n >= bad), log
        assert len(re.findall(r"kev-fill: kept ", log)) == sum(n < bad for n in files), log
        assert {n: (filled / n).read_bytes() for n in files} == files
        marker = json.loads((filled / MARKER).read_text())
        assert marker["source"]["bucket"] == bucket and set(marker["files"]) == set(files)

        answers = triton_answers(tmp_path, tag, volume)
        assert answers.keys() == README_ANSWERS.keys() and answers != README_ANSWERS
    finally:
        podman("volume", "rm", "--force", volume, check=False)


def triton_answers(tmp_path: Path, tag: str, volume: str) -> dict[str, Any]:
    """README's request to the local overlay's Triton pod with the filled volume at /models (read-only) and
    KEV_CHECKPOINT/KEV_BASE on it, as components/gpu names them."""
    deployment = json.loads(json.dumps(find("overlays/local", "Deployment", "kev")))
    deployment["metadata"]["name"] = name = f"{tag}-triton"
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    container["env"] += [
        {"name": "KEV_CHECKPOINT", "value": "/models/kev"},
        {"name": "KEV_BASE", "value": "/models/base"},
    ]
    container["volumeMounts"].append({"name": "checkpoints", "mountPath": "/models", "readOnly": True})
    spec["volumes"].append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": volume, "readOnly": True}})
    manifest = tmp_path / "triton.yaml"
    manifest.write_text(yaml.safe_dump(deployment))
    podman("kube", "play", str(manifest))
    try:
        box, result = wait_ready(name, container)
        logs = podman("logs", box, check=False)
        assert result.returncode == 0, result.stdout + result.stderr + logs.stdout[-3000:] + logs.stderr[-3000:]
        env = podman("exec", box, "printenv", "KEV_CHECKPOINT").stdout.strip()
        assert env == "/models/kev", env
        reply = podman("exec", box, "/opt/kev/.venv/bin/python", "-c", TRITON_HTTP, json.dumps(README_REQUEST)).stdout
        return json.loads(json.loads(reply)["outputs"][0]["data"][0])["answers"]
    finally:
        down = podman("kube", "down", str(manifest), check=False)
        assert down.returncode == 0, shlex.join(["kube", "down"]) + down.stderr
