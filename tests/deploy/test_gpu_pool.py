"""The chart's GPU runtime pool (runtimeGpu, templates/runtime-gpu.yaml), rendered by the real Helm engine
and validated against the Kubernetes schemas, and the CUDA image's Dockerfile."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from typing import Any

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml

from .support import CHART, REPO, Rendered, api_group, venv_tool

GPU_VALUES = {"runtimeGpu": {"enabled": True, "models": ["minilm_torch"], "labels": {"zone": "a"},
                            "storageUris": {"minilm_torch": "s3://models/minilm_torch"}}}
TRITON_VALUES = {
    "runtimeGpu": {
        "enabled": True,
        "gpus": 0,
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        "triton": {"enabled": True, "gpus": 1, "extraArgs": ["--log-verbose=0"]},
    }
}


def deployment(rendered: Rendered) -> dict[str, Any]:
    return rendered.get("Deployment", "aiworks-runtime-gpu")


def containers(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment(rendered)["spec"]["template"]["spec"]["containers"]}


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_off_by_default(render: Callable[..., Rendered]) -> None:
    assert not [o for o in render(None).objects if "runtime-gpu" in o["metadata"]["name"]]


def test_the_pool_asks_for_gpus_on_gpu_nodes_and_advertises_device_gpu(render: Callable[..., Rendered]) -> None:
    rendered = render(GPU_VALUES)
    pod = deployment(rendered)["spec"]["template"]["spec"]
    runtime = containers(rendered)["runtime"]
    assert runtime["image"] == "aiworks/model-runtime-cuda:0.1.0"
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    variables = env(runtime)
    assert variables["AIWORKS_RUNTIME_DEVICE"] == "gpu"
    assert json.loads(variables["AIWORKS_RUNTIME_MODELS"]) == ["minilm_torch"]
    assert json.loads(variables["AIWORKS_RUNTIME_LABELS"]) == {"pool": "gpu", "zone": "a"}
    assert "AIWORKS_RUNTIME_TRITON_URL" not in variables
    # It drains on SIGTERM as the CPU pools do (runtime.drainSeconds), and Kubernetes waits for that.
    assert pod["terminationGracePeriodSeconds"] == int(variables["AIWORKS_RUNTIME_DRAIN_S"]) + 15
    # Readiness follows the models and backends (the service's own probe over its mutual TLS); liveness the port.
    assert runtime["readinessProbe"]["exec"]["command"] == ["aiworks", "probe", "--quiet", "runtime"]
    assert runtime["livenessProbe"]["tcpSocket"]["port"] == 8020
    # Behind the mesh the kubelet's gRPC probes: readiness "" (models, backends), liveness the process.
    meshed = containers(render({**GPU_VALUES, "istio": {"enabled": True}}))["runtime"]
    assert "service" not in meshed["readinessProbe"]["grpc"]
    assert meshed["livenessProbe"]["grpc"]["service"] == "aiworks.runtime.v1.RuntimeService"
    # Its model is fetched before the runtime starts, by the CPU runtime's image (the storage initializer).
    [fetch] = deployment(rendered)["spec"]["template"]["spec"]["initContainers"]
    assert fetch["args"][:3] == ["s3://models/minilm_torch", "--model", "minilm_torch"]
    assert fetch["image"] == "aiworks/model-runtime:0.1.0"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    service = rendered.get("Service", "aiworks-runtime-gpu")
    assert service["spec"]["clusterIP"] == "None"


def test_a_triton_container_on_loopback_shares_the_pod(render: Callable[..., Rendered]) -> None:
    rendered = render(TRITON_VALUES)
    found = containers(rendered)
    runtime, triton = found["runtime"], found["tritonserver"]
    assert "nvidia.com/gpu" not in runtime["resources"]["limits"]
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert triton["image"].startswith("nvcr.io/nvidia/tritonserver:")
    args = triton["args"]
    assert "--model-control-mode=explicit" in args and "--grpc-address=127.0.0.1" in args
    assert "--allow-http=false" in args and "--metrics-address=127.0.0.1" in args
    assert "ports" not in triton  # nothing of Triton's is reachable from outside the pod
    variables = env(runtime)
    assert variables["AIWORKS_RUNTIME_TRITON_URL"] == "127.0.0.1:8001"
    assert variables["AIWORKS_RUNTIME_TRITON_REPOSITORY"] == "/triton-models"
    assert variables["AIWORKS_RUNTIME_TRITON_METRICS_PORT"] == "8002"  # its metrics: 127.0.0.1:8002
    mounts = {c: {m["name"]: m for m in found[c]["volumeMounts"]} for c in found}
    # Both see the suite's repository at the same path: the links the runtime writes resolve in Triton.
    assert mounts["runtime"]["models"]["mountPath"] == mounts["tritonserver"]["models"]["mountPath"] == "/models"
    assert mounts["tritonserver"]["triton-models"]["readOnly"] is True
    assert not mounts["runtime"]["triton-models"].get("readOnly")
    assert rendered.get("PodDisruptionBudget", "aiworks-runtime-gpu")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("values", [GPU_VALUES, TRITON_VALUES], ids=["runtime", "with-triton"])
@pytest.mark.parametrize("kube_version", ["1.27.0", kubernetes_validate.utils.latest_version()])
def test_objects_validate_strictly(render: Callable[..., Rendered], values, kube_version: str) -> None:
    rendered = render(values)
    objects = [o for o in rendered.objects if "runtime-gpu" in o["metadata"]["name"]]
    assert {o["kind"] for o in objects} >= {"ServiceAccount", "Service", "Deployment"}
    for obj in objects:
        assert api_group(obj) in ("", "apps", "policy")
        kubernetes_validate.validate(obj, kube_version, strict=True)


def test_values_schema_admits_the_block_and_refuses_mistakes() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    for broken in ({"gpus": -1}, {"gpuMemoryFraction": 1.5}, {"unknown": 1}, {"triton": {"grpcPort": 8020}}):
        bad = json.loads(json.dumps(values))
        for key, value in broken.items():
            if isinstance(value, dict):
                bad["runtimeGpu"][key].update(value)
            else:
                bad["runtimeGpu"][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_cuda_image_builds_from_a_base_given_as_a_build_argument() -> None:
    parsed = list(dockerfile.parse_file(str(REPO / "services" / "model-runtime" / "Dockerfile.cuda")))
    args = dict(c.value[0].split("=", 1) for c in parsed if c.cmd == "ARG" and "=" in c.value[0])
    stages = [c.value[0] for c in parsed if c.cmd == "FROM"]
    assert stages == ["${CUDA_IMAGE}", "${CUDA_IMAGE}"]
    assert re.match(r"^nvidia/cuda:\d+\.\d+\.\d+-[a-z-]*runtime-ubuntu\d+\.\d+$", args["CUDA_IMAGE"])
    assert "TORCH_INDEX_URL" in args and args["TORCH_VERSION"] == "2.13.0"
    runs = " ".join(c.value[0] for c in parsed if c.cmd == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and "pip install --no-cache-dir ." in runs
    last = max(i for i, c in enumerate(parsed) if c.cmd == "FROM")
    final = parsed[last:]
    [user] = [c.value[0] for c in final if c.cmd == "USER"]
    assert int(user.split(":")[0]) >= 1000
    environment = " ".join(" ".join(c.value) for c in final if c.cmd == "ENV")
    assert "AIWORKS_RUNTIME_DEVICE" in environment and "gpu" in environment
    [entrypoint] = [c for c in final if c.cmd == "ENTRYPOINT"]
    assert entrypoint.value == ("aiworks", "runtime")
    result = subprocess.run([venv_tool("hadolint"), str(REPO / "services" / "model-runtime" / "Dockerfile.cuda")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
