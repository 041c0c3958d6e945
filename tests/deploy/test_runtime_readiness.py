"""A runtime whose models failed to load is alive but not ready (grpc.health.v1), so Kubernetes
probes and `helm test` see it; with its model in place the same command is ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiworks.supervisor.supervisor import free_port

LIVENESS = "aiworks.runtime.v1.RuntimeService"


def health(port: int, service: str = "") -> int | None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            ).status
        except grpc.RpcError:
            return None


def run_runtime(repository: Path, models: str, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    # On loopback the runtime tells callers apart by the installation's token (health checks stay open).
    token = log.parent / "internal-token"
    if not token.exists():
        token.write_text(os.urandom(24).hex())
        token.chmod(0o600)
    env = {
        **os.environ, "AIWORKS_RUNTIME_PORT": str(port), "AIWORKS_RUNTIME_METRICS_PORT": "0",
        "AIWORKS_RUNTIME_SCHEDULER_ADDRESS": f"127.0.0.1:{free_port()}", "AIWORKS_RUNTIME_MODELS": models,
        "AIWORKS_RUNTIME_MODEL_REPOSITORY": str(repository), "AIWORKS_RUNTIME_REPLICA_ID": "r0",
        "AIWORKS_RUNTIME_INTERNAL_TOKEN_FILE": str(token),
    }  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "aiworks", "runtime"], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    return process, port


def wait_alive(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while health(port, LIVENESS) != health_pb2.HealthCheckResponse.SERVING:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_failed_model_means_not_ready(tmp_path: Path) -> None:
    from aiworks.storage.fetch import fetch_model

    repository = tmp_path / "models"
    repository.mkdir()
    process, port = run_runtime(repository, '["iris"]', tmp_path / "empty.log")
    try:
        wait_alive(process, port, tmp_path / "empty.log")
        time.sleep(0.5)
        assert health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "is NOT ready: model(s) iris failed to load" in (tmp_path / "empty.log").read_text()
    finally:
        process.terminate()
        process.wait(10)
    fetch_model("demo", "iris", repository)
    process, port = run_runtime(repository, '["iris"]', tmp_path / "iris.log")
    try:
        wait_alive(process, port, tmp_path / "iris.log")
        deadline = time.monotonic() + 30
        while health(port) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, (tmp_path / "iris.log").read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(10)
