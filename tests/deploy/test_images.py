"""The images, built and run here: `make images` with podman on a base made from Debian's packages,
then docker-compose.yml brought up with podman-compose and real inferences (tritonclient, HTTP and
gRPC, over the gateway's TLS) sent through it.

Slow (minutes the first time, while the images build): marked `images`, left out of `make test` and
run by .ci/run (`make test-images`). The base images' root filesystems are cached under .cache/images
keyed by their Debian package lists, and podman keeps its layer cache, so later runs rebuild little.

What the machine cannot have is left out, and said: the compose file's Envoy and Grafana images come
from registries that are not reachable here, and neither program is packaged by Debian.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .support import REPO, venv_tool

pytestmark = [pytest.mark.images, pytest.mark.slow, pytest.mark.timeout(3600)]

UNAVAILABLE = {"envoy", "grafana"}  # no registry here, not in Debian: left out, as the module says
PROJECT = "aiworkstest"


def needed() -> None:
    for tool in ("podman", "runc", "mmdebstrap", "catatonit", "unshare"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/ensure-debian-packages.sh")


def engine_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(REPO / "deploy" / "images" / "containers.conf"), "ENGINE": "podman"}


def base_image(kind: str) -> str:
    done = subprocess.run(["sh", str(REPO / "scripts" / "build-base-image.sh"), kind], env=engine_env(),
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    needed()
    bases = {kind: base_image(kind) for kind in ("python", "redis", "prometheus")}
    env = {**engine_env(), "AIWORKS_BASE_IMAGE": bases["python"]}
    done = subprocess.run(["make", "-s", "images"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return bases


def podman_compose_file(bases: dict[str, str], out: Path) -> Path:
    """docker-compose.yml as Compose normalises it, for podman with host networking on one machine.

    Changes, each forced by this machine and nothing else: host networking (service names resolve to
    127.0.0.1, and runtime-2 moves to 8022/8023 beside runtime-1); Redis and Prometheus from images made
    of Debian's packages; no Envoy or Grafana; health-gated start-up becomes start order, since podman
    runs healthchecks from systemd timers, which these machines lack.
    """
    env = {"PATH": "/usr/bin:/bin", "HOME": str(out), "AIWORKS_REDIS_IMAGE": bases["redis"],
           "AIWORKS_PROMETHEUS_IMAGE": bases["prometheus"]}  # fmt: skip
    done = subprocess.run([venv_tool("docker-compose"), "-f", str(REPO / "docker-compose.yml"), "config", "--format",
                           "json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    project = json.loads(done.stdout)
    services = {k: v for k, v in project["services"].items() if k not in UNAVAILABLE}
    names = sorted(services)
    for service in services.values():
        service.pop("build", None)
        service.pop("ports", None)
        service.pop("networks", None)
        if service.get("network_mode") != "none":
            service["network_mode"] = "host"
            service["extra_hosts"] = [f"{n}:127.0.0.1" for n in names]
        service["depends_on"] = {
            dep: {"condition": "service_completed_successfully" if c["condition"] == "service_completed_successfully"
                  else "service_started"}
            for dep, c in service.get("depends_on", {}).items() if dep not in UNAVAILABLE
        }  # fmt: skip
        if not service["depends_on"]:
            del service["depends_on"]
    runtime2 = services["runtime-2"]
    runtime2["environment"].update(AIWORKS_RUNTIME_PORT="8022", AIWORKS_RUNTIME_METRICS_PORT="8023",
                                   AIWORKS_RUNTIME_ADVERTISE_ADDRESS="runtime-2:8022")  # fmt: skip
    runtime2["healthcheck"]["test"] = [w.replace("8020", "8022") for w in runtime2["healthcheck"]["test"]]
    services["prometheus"]["entrypoint"] = ["prometheus"]  # Debian's binary; the official image's entrypoint
    # The nearline class's 500 ms deadline is for a quiet machine; on this shared one a request may wait longer for
    # the worker, and would be answered 504 (expired) instead of run.
    services["gateway"]["environment"]["AIWORKS_GATEWAY_ASYNC_DEADLINE_S"] = "30"
    # Volumes named by the project podman-compose is given.
    volumes = {name: {k: v for k, v in spec.items() if k != "name"} for name, spec in project.get("volumes", {}).items()}
    compose = {"name": PROJECT, "services": services, "volumes": volumes}
    path = out / "compose.podman.yml"
    path.write_text(yaml.safe_dump(compose, sort_keys=False))
    return path


def test_compose_serves_inferences_with_podman(images: dict[str, str], tmp_path: Path) -> None:
    compose = podman_compose_file(images, tmp_path)
    plan = tmp_path / "plan.json"
    result = tmp_path / "result.json"
    plan.write_text(json.dumps({"compose": str(compose), "project": PROJECT, "timeout_s": 420,
                                "podman_compose": venv_tool("podman-compose")}))  # fmt: skip
    env = {**engine_env(), "PYTHONPATH": str(REPO / "tests")}
    subprocess.run(["unshare", "--net", sys.executable, "-m", "deploy.compose_podman", str(plan), str(result)],
                   env=env, cwd=tmp_path, timeout=1200)  # fmt: skip
    found = json.loads(result.read_text())
    assert "error" not in found, json.dumps(found, indent=1)[-8000:]
    for model, classes in (("iris", 3), ("digits", 10)):
        labels = found[model]
        # The label output is [N, 1], as Triton's classifiers answer (one row per input row).
        assert labels["http"] == labels["grpc"] and len(labels["http"]) == 2, labels
        assert all(len(row) == 1 and 0 <= row[0] < classes for row in labels["http"]), labels
    for name in ("gateway", "cache", "monitor", "batch-runner"):
        assert found[f"{name}_heavy"] == "False False", f"{name}'s image holds onnxruntime or torch"
    # The tiers through compose: an asynchronous request answered by the nearline worker as the synchronous call
    # is, and a batch job run by the batch runner, every line's answer the online one.
    tiers = found["tiers"]
    assert tiers["async_submit"] == 202, tiers
    assert tiers["async"] == {"status": 200, "request_status": "completed", "label": tiers["sync"][0]}, tiers
    assert tiers["batch"]["status"] == "completed", tiers
    assert tiers["batch"]["counts"] == {"total": 3, "completed": 3, "failed": 0}, tiers
    assert tiers["batch"]["labels"] == {f"row-{i}": label for i, label in enumerate(tiers["sync"])}, tiers
    assert found["tiers_up"] == {"batch-runner": "running", "nearline-worker": "running"}, found["tiers_up"]
    print(f"compose up {found['up_s']} s, iris answered at {found['iris_s']} s, digits at {found['digits_s']} s, "
          f"the tiers' request and job done at {found['tiers_s']} s")
