"""End to end: gateway, scheduler and a runtime replica that starts and supervises its own tritonserver."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from triton_support import IRIS_ROWS, ort_reference
from tritonclient.utils import InferenceServerException

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, Status
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.runtime.client import RuntimeClient
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

pytestmark = pytest.mark.e2e


def tritonservers_under(pid: int) -> list[int]:
    """Live tritonserver processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm == "tritonserver" and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def suite(triton_distribution, suite_repository, tmp_path_factory):
    triton_port = free_port()
    config = SuiteConfig.on_free_ports(
        model_repository=suite_repository,
        replicas=1,
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_env={
            "AIWORKS_RUNTIME_DEVICE": "gpu",  # Triton-backed replicas advertise the GPU pool
            "AIWORKS_RUNTIME_TRITON_GRPC_PORT": str(triton_port),
            "AIWORKS_RUNTIME_TRITON_INSTANCE_KIND": "KIND_CPU",  # this tritonserver has no GPU
        },
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    runtime = next(c for c in supervisor.children if c.name == "runtime-0")
    triton_pids = tritonservers_under(runtime.process.pid)
    if len(triton_pids) != 1:
        supervisor.stop()
        pytest.fail(f"the runtime should supervise one tritonserver, found {triton_pids}; its log ends:\n"
                    + "\n".join(runtime.log_path.read_text().splitlines()[-20:]))  # fmt: skip
    yield {
        "supervisor": supervisor,
        "gateway_grpc": f"127.0.0.1:{config.grpc_port}",
        "gateway_http": f"http://127.0.0.1:{config.http_port}",
        "triton": f"127.0.0.1:{triton_port}",
        "triton_pid": triton_pids[0],
    }
    supervisor.stop()
    # Stopping the runtime stops its tritonserver too.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{triton_pids[0]}").exists():
        state = Path(f"/proc/{triton_pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.1)
    assert tritonservers_under(runtime.process.pid) == []


def infer(url: str, model: str, version: str = "") -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("input", list(IRIS_ROWS.shape), "FP32")
        tensor.set_data_from_numpy(IRIS_ROWS)
        result = client.infer(model, [tensor], model_version=version)
        return {name: result.as_numpy(name) for name in ("label", "probabilities")}
    finally:
        client.close()


def triton_index(url: str) -> dict[tuple[str, str], str]:
    client = grpcclient.InferenceServerClient(url)
    try:
        models = client.get_model_repository_index(as_json=True).get("models", [])
        return {(m["name"], m.get("version", "")): m.get("state", "") for m in models}
    finally:
        client.close()


def test_the_suite_answers_what_triton_answers_directly(suite, suite_repository):
    for version in ("1", "2"):
        through_suite = infer(suite["gateway_grpc"], "iris_triton", version)
        direct = infer(suite["triton"], "iris_triton", version)
        want = ort_reference(suite_repository, "iris_triton", int(version), IRIS_ROWS)
        # Both show the label in the config's dims [1] (the model makes [], its reshape).
        np.testing.assert_array_equal(through_suite["label"], direct["label"])
        np.testing.assert_array_equal(through_suite["label"], want["label"].reshape(-1, 1))
        np.testing.assert_array_equal(through_suite["probabilities"], direct["probabilities"])
        np.testing.assert_allclose(through_suite["probabilities"], want["probabilities"], rtol=1e-6)
    # The same model on the suite's own ONNX Runtime backend agrees too.
    np.testing.assert_allclose(infer(suite["gateway_grpc"], "iris")["probabilities"],
                               infer(suite["gateway_grpc"], "iris_triton", "1")["probabilities"], rtol=1e-6)  # fmt: skip


def test_triton_replica_advertises_gpu(suite):
    supervisor = suite["supervisor"]
    with supervisor.caller_channel(supervisor.scheduler_address, "scheduler") as channel:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(scheduler_pb2.StatusRequest(), timeout=5)
    (replica,) = reply.replicas
    assert replica.device == "gpu"
    assert {"iris_triton:1", "iris_triton:2", "iris:1"} <= set(replica.models)


def test_unload_and_load_go_through_tritons_repository_api(suite):
    base = suite["gateway_http"]
    assert triton_index(suite["triton"])[("iris_triton", "1")] == "READY"
    assert requests.post(f"{base}/v2/repository/models/iris_triton/unload", timeout=30).status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        states = {v for (name, _), v in triton_index(suite["triton"]).items() if name == "iris_triton"}
        if "READY" not in states:
            break
        time.sleep(0.1)
    assert "READY" not in states, "Triton still serves the model the suite unloaded"

    assert requests.post(f"{base}/v2/repository/models/iris_triton/load", timeout=60).status_code == 200
    index = triton_index(suite["triton"])
    assert index[("iris_triton", "1")] == index[("iris_triton", "2")] == "READY"
    deadline = time.monotonic() + 10
    while requests.get(f"{base}/v2/models/iris_triton/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert infer(suite["gateway_grpc"], "iris_triton", "2")["label"].shape == (3, 1)


def _health(address: str, service: str = "") -> str:
    """The replica's gRPC health (open to every caller, as kubelet probes are)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _load(url: str, stop: threading.Event, outcomes: list) -> None:
    """One client sending requests back to back; records (sent, answered, error status or None)."""
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("input", list(IRIS_ROWS.shape), "FP32")
    tensor.set_data_from_numpy(IRIS_ROWS)
    try:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                result = client.infer("iris_triton", [tensor], model_version="2", client_timeout=30)
                assert result.as_numpy("label").shape == (3, 1)
                outcomes.append((sent, time.monotonic(), None))
            except InferenceServerException as exc:
                outcomes.append((sent, time.monotonic(), exc.status()))
    finally:
        client.close()


async def _ask_the_replica(supervisor, address: str) -> AIWorksError:
    """A request straight to the replica, as a gateway sends it; the error it is answered with."""
    client = RuntimeClient(address, 1 << 24, 10.0, supervisor.client_tls_for("gateway"),
                           caller=supervisor.client_caller("gateway"))  # fmt: skip
    try:
        request = InferRequest("iris_triton", "2", [Tensor("input", "FP32", IRIS_ROWS.shape, IRIS_ROWS.tobytes())])
        with pytest.raises(AIWorksError) as refused:
            await client.infer(request, RequestOptions())
        return refused.value
    finally:
        await client.close()


def test_a_killed_tritonserver_is_back_within_10_s_and_only_inflight_requests_fail(suite):
    """Runs last: kill -9 the module's tritonserver under load from 8 clients."""
    supervisor = suite["supervisor"]
    with supervisor.caller_channel(supervisor.scheduler_address, "scheduler") as channel:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(scheduler_pb2.StatusRequest(), timeout=5)
    runtime_address = reply.replicas[0].address
    assert _health(runtime_address) == "SERVING"
    clients = 8
    stop, outcomes = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(suite["gateway_grpc"], stop, outcomes)) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(suite["triton_pid"], signal.SIGKILL)
        # Meanwhile the replica is not ready (gRPC health, the model's readiness), though alive,
        # and a batch sent to it straight away is refused with UNAVAILABLE naming the restart.
        time.sleep(0.3)
        assert _health(runtime_address) == "NOT_SERVING"
        assert _health(runtime_address, "aiworks.runtime.v1.RuntimeService") == "SERVING"
        assert (
            requests.get(f"{suite['gateway_http']}/v2/models/iris_triton/versions/2/ready", timeout=5).status_code
            != 200
        )
        refused = asyncio.run(_ask_the_replica(supervisor, runtime_address))
        assert refused.status is Status.UNAVAILABLE
        assert "exited with code -9" in refused.message and "restarting" in refused.message
        deadline = killed_at + 15
        while time.monotonic() < deadline and not any(s > killed_at + 0.3 and e is None for s, _, e in outcomes):
            time.sleep(0.05)
        time.sleep(1.0)  # some more load on the restarted server
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    answered_after = [a for s, a, e in outcomes if e is None and s > killed_at]
    failed = [(s, a, e) for s, a, e in outcomes if e is not None]
    assert answered_after, "no request was answered after the kill"
    back_in_s = min(answered_after) - killed_at
    assert back_in_s < 10, f"serving again only after {back_in_s:.1f} s"
    # Only requests sent before the runtime noticed the death fail (each with an explicit UNAVAILABLE): the one
    # each client had in flight, and at most one more per client sent in the few milliseconds before the watcher
    # saw it. Every later one waited for the restart and was served.
    assert len(failed) <= 2 * clients, failed
    assert all(e == "StatusCode.UNAVAILABLE" for _, _, e in failed), failed
    assert all(s < killed_at + 0.2 for s, _, _ in failed), [(s - killed_at, e) for s, _, e in failed]
    assert _health(runtime_address) == "SERVING"
    runtime = next(c for c in supervisor.children if c.name == "runtime-0")
    new_pids = tritonservers_under(runtime.process.pid)
    assert len(new_pids) == 1 and new_pids[0] != suite["triton_pid"]
    print(f"back in {back_in_s:.2f} s; {len(failed)} in-flight request(s) failed, "
          f"{sum(1 for _, _, e in outcomes if e is None)} answered")  # fmt: skip
