"""QoS end-to-end fixtures: the suite as real processes with QoS settings, plus extra runtimes.

``start_suite`` is tests/e2e's own (``tests/e2e/e2e_support.py``, loaded by
path: when only tests/qos runs, tests/e2e is not on sys.path). Each suite here runs with settings that
make the behaviour under test quick to provoke, listed next to it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.supervisor.supervisor import SuiteConfig

_spec = importlib.util.spec_from_file_location("e2e_support", Path(__file__).parent.parent / "e2e" / "e2e_support.py")
_e2e = sys.modules.get("e2e_support") or importlib.util.module_from_spec(_spec)
if "e2e_support" not in sys.modules:  # one module, whichever folder's tests import it first
    sys.modules[_spec.name] = _e2e  # dataclasses look their module up there
    _spec.loader.exec_module(_e2e)
start_suite = _e2e.start_suite
Suite = _e2e.Suite


def pytest_collection_modifyitems(items):
    for item in items:
        if "/qos/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)


def _suite_overrides(env: dict[str, str]) -> dict:
    overrides = {"extra_env": env, "log_level": "WARNING"}
    if "cache" in SuiteConfig.__dataclass_fields__:
        overrides["cache"] = False  # identical test inputs must reach the scheduler, not a result cache
    return overrides


def _suite(model_repository: Path, log_dir: Path, env: dict[str, str]) -> Suite:
    return start_suite(model_repository, log_dir, **_suite_overrides(env))


@pytest.fixture(scope="module")
def slow_suite(model_repository, tmp_path_factory):
    """Two runtimes that take 50 ms per batch (so queues build without burning CPU), small queue bounds
    (per replica: the queues are in the runtimes), and a long aging step (1 s) so the order of classes
    is strict within a test's short bursts."""
    env = {
        "AIWORKS_RUNTIME_DEBUG_DELAY_MS": "50",
        "AIWORKS_RUNTIME_MAX_QUEUE_REQUESTS": "100",
        "AIWORKS_RUNTIME_MAX_QUEUE_BYTES": str(1 << 20),
        "AIWORKS_RUNTIME_PRIORITY_AGING_MS": "1000",
    }
    suite = _suite(model_repository, tmp_path_factory.mktemp("slow-logs"), env)
    yield suite
    suite.supervisor.stop()


@pytest.fixture(scope="module")
def pair_suite(model_repository, tmp_path_factory):
    """Two ordinary runtimes; a 1 s per-try timeout and quick ejection (2 errors, 3 s base) for the
    ejection test."""
    env = {
        "AIWORKS_SCHEDULER_RUNTIME_TIMEOUT_S": "1.0",
        "AIWORKS_SCHEDULER_OUTLIER_CONSECUTIVE_ERRORS": "2",
        "AIWORKS_SCHEDULER_OUTLIER_BASE_EJECTION_S": "3",
    }
    suite = _suite(model_repository, tmp_path_factory.mktemp("pair-logs"), env)
    extras: list[ExtraRuntime] = []
    suite.extras = extras
    yield suite
    for extra in extras:
        extra.stop()
    suite.supervisor.stop()


# ---- an extra runtime replica, started by a test ---------------------------------------------------


@dataclass
class ExtraRuntime:
    """One more runtime replica with its own environment (for example a debug delay)."""

    suite: Suite
    replica_id: str
    models: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        sup = self.suite.supervisor
        log_path = sup.config.log_dir / f"{self.replica_id}.log"
        argv = [
            sys.executable, "-m", "aiworks", "runtime",
            "--replica-id", self.replica_id,
            "--host", "127.0.0.1",
            "--port", "0",
            "--scheduler-address", sup.scheduler_address,
            "--model-repository", str(self.suite.model_repository),
            "--log-level", "WARNING",
            "--models", *self.models,
        ]  # fmt: skip
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **sup.caller_env("runtime"), **self.env},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.replica_id} exited: {log_path.read_text()[-2000:]}")
            replica = replica_status(self.suite, self.replica_id)
            if replica is not None and replica.live and replica.models:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.replica_id} did not register within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- the scheduler's view and KServe clients -------------------------------------------------------


def scheduler_status(suite: Suite) -> scheduler_pb2.StatusResponse:
    with suite.supervisor.caller_channel(suite.supervisor.scheduler_address, "scheduler") as ch:
        return scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=5)


def replica_status(suite: Suite, replica_id: str):
    return next((r for r in scheduler_status(suite).replicas if r.replica_id == replica_id), None)


def child_pid(suite: Suite, name: str) -> int:
    return next(c.process.pid for c in suite.supervisor.children if c.name == name)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class KServeClient:
    """Async Open Inference Protocol calls over gRPC (tritonclient's own stubs), cheap enough for bursts."""

    def __init__(self, url: str):
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        self.channel = grpc.aio.insecure_channel(url)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def request(self, model: str, x: np.ndarray, version: str = "", priority=None, timeout_us: int | None = None):
        req = self.pb.ModelInferRequest(model_name=model, model_version=version)
        req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
        req.raw_input_contents.append(x.astype(np.float32).tobytes())
        if priority is not None:  # as tritonclient sends it
            if isinstance(priority, int):
                req.parameters["priority"].uint64_param = priority
            else:
                req.parameters["priority"].string_param = priority
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        return req

    async def infer(self, request, timeout_s: float = 60.0):
        return await self.stub.ModelInfer(request, timeout=timeout_s)

    async def close(self) -> None:
        await self.channel.close()


async def closed_loop(client: KServeClient, make_request, clients: int, duration_s: float, on_reply=None) -> dict:
    """``clients`` callers, each sending its next request when the last is answered, for ``duration_s``."""
    counts = {"ok": 0, "errors": []}
    stop_at = time.monotonic() + duration_s

    async def caller(i: int):
        while time.monotonic() < stop_at:
            try:
                reply = await client.infer(make_request(i))
            except grpc.aio.AioRpcError as exc:
                counts["errors"].append(f"{exc.code().name}: {exc.details()}")
                continue
            counts["ok"] += 1
            if on_reply is not None:
                on_reply(reply)

    await asyncio.gather(*(caller(i) for i in range(clients)))
    return counts
