"""The Helm chart (deploy/helm/rill) rendered by `helm template`: the probes, the engine-type label, the
GPUs kept equal to the shards, the grace period derived from the shutdown timeout, the model volume, and
the InferencePool selecting exactly the chart's pods with the endpoint picker configured by
deploy/inference-gateway/epp-config.yaml. Needs `helm` on PATH (.ci/run builds it); skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "rill"
HELM = shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not on PATH (.ci/run builds it)")


def render(*sets: str) -> dict[tuple[str, str], dict]:
    """`helm template rill CHART --set ...`, by (kind, name)."""
    args = [arg for value in sets for arg in ("--set", value)]
    out = subprocess.run(
        [HELM, "template", "rill", str(CHART), *args], check=True, capture_output=True, text=True
    ).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def rill_container(objects: dict[tuple[str, str], dict]) -> dict:
    return objects["Deployment", "rill"]["spec"]["template"]["spec"]["containers"][0]


def test_defaults_probe_health_and_ready_and_label_the_engine() -> None:
    objects = render()
    pod = objects["Deployment", "rill"]["spec"]["template"]
    container = rill_container(objects)
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "rill"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    env = {item["name"]: item["value"] for item in container["env"]}
    assert "RILL_MODEL_ID" not in env  # the built-in default model
    assert env["RILL_NUM_SHARD"] == "1" and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # 10 s preStop + 60 s for requests in flight + 10 s for the shards + 10 s of margin.
    assert pod["spec"]["terminationGracePeriodSeconds"] == 90 and env["RILL_SHUTDOWN_TIMEOUT"] == "60"
    # The gateway's objects only when asked for.
    assert not any(kind == "InferencePool" for kind, _ in objects)
    assert {kind for kind, _ in objects} == {"Deployment", "Service", "PodDisruptionBudget"}


def test_values_change_the_rendering() -> None:
    objects = render(
        "shards=4", "shutdownTimeoutSeconds=120", "model.id=/models/Llama-3.1-8B-Instruct",
        "model.claimName=rill-models", "model.createClaim=true", "autoscaling.enabled=true",
    )  # fmt: skip
    deployment = objects["Deployment", "rill"]
    container = rill_container(objects)
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["RILL_NUM_SHARD"] == "4" and env["RILL_MODEL_ID"] == "/models/Llama-3.1-8B-Instruct"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 150
    volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "rill-models"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert objects["PersistentVolumeClaim", "rill-models"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "replicas" not in deployment["spec"]  # the HorizontalPodAutoscaler owns it
    assert objects["HorizontalPodAutoscaler", "rill"]["spec"]["scaleTargetRef"]["name"] == "rill"

    cpu = rill_container(render("device=cpu", "dtype=float32"))
    assert {"name": "RILL_DTYPE", "value": "float32"} in cpu["env"]
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"] | cpu["resources"].get("limits", {})


def test_inference_pool_selects_the_pods_and_the_picker_reads_rills_config() -> None:
    objects = render("inferencePool.enabled=true")
    pool = objects["InferencePool", "rill"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod_labels = objects["Deployment", "rill"]["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    # ... and no other pod of the release: the endpoint picker's pods stay out of the pool.
    epp = objects["Deployment", "rill-epp"]
    assert not selector.items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": rill_container(objects)["ports"][0]["containerPort"]}]

    picker = pool["spec"]["endpointPickerRef"]
    service = objects["Service", picker["name"]]
    assert picker["port"]["number"] in {port["port"] for port in service["spec"]["ports"]}
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    config = objects["ConfigMap", "rill-epp"]["data"]["epp-config.yaml"]
    source = ROOT / "deploy" / "inference-gateway" / "epp-config.yaml"
    assert yaml.safe_load(config) == yaml.safe_load(source.read_text())
    assert "--config-file=/config/epp-config.yaml" in epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pool-name=rill" in epp["spec"]["template"]["spec"]["containers"][0]["args"]
