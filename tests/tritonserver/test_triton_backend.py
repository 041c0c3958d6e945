"""The triton backend against a real tritonserver that the test started (``triton_url`` mode)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_support import IRIS_ROWS, ort_reference

from aiworks.core.errors import AIWorksError, Unavailable
from aiworks.core.model_config import read_config
from aiworks.runtime import triton_backend
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.settings import RuntimeSettings
from aiworks.runtime.triton_backend import TritonModel


@pytest.fixture
def connection(triton_server):
    settings = RuntimeSettings(
        scheduler_address="",
        triton_url=triton_server.grpc_url,
        triton_repository=triton_server.model_repository,
        triton_metrics_url=triton_server.metrics_url,
        triton_instance_kind="KIND_CPU",
    )
    conn = triton_backend.configure(settings)
    yield conn
    triton_backend.shutdown()


@pytest.fixture
def direct(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    yield client
    client.close()


def triton_state(client, name: str) -> dict[str, str]:
    return {m["version"]: m["state"] for m in client.get_model_repository_index(as_json=True).get("models", [])
            if m["name"] == name and "version" in m}  # fmt: skip


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def load(repository, name: str, version: int) -> TritonModel:
    repo = ModelRepository(repository)
    config = read_config(repository / name)
    return TritonModel(repo.model_file(config, version), config, 1)


def test_load_run_and_unload_go_through_triton(connection, direct, suite_repository):
    model = load(suite_repository, "iris_triton", 1)
    try:
        # Every version the config's policy selects comes in the same Triton load.
        assert triton_state(direct, "iris_triton") == {"1": "READY", "2": "READY"}
        # Triton was handed its own config: the python backend, on the CPU, not the suite's keys.
        config = direct.get_model_config("iris_triton", as_json=True)["config"]
        assert config["backend"] == "python"
        assert {g["kind"] for g in config["instance_group"]} == {"KIND_CPU"}
        assert "triton_backend" not in config.get("parameters", {})

        label, probabilities = model.run({"input": IRIS_ROWS}, ["label", "probabilities"])
        want = ort_reference(suite_repository, "iris_triton", 1, IRIS_ROWS)
        assert label.shape == (3, 1)  # the config's dims [1], as Triton answers (the model makes [])
        np.testing.assert_array_equal(label, want["label"].reshape(3, 1))
        np.testing.assert_allclose(probabilities, want["probabilities"], rtol=1e-6)

        # For configs that leave them out, inputs and outputs come from Triton's metadata.
        inputs, outputs = model.io_specs(batched=True)
        assert [(t.name, t.datatype, t.dims) for t in inputs] == [("input", "FP32", (4,))]
        assert {t.name for t in outputs} == {"label", "probabilities"}
    finally:
        model.close()
    assert "READY" not in triton_state(direct, "iris_triton").values()
    assert connection.held_versions("iris_triton") == []


def test_versions_are_held_together_and_released_one_by_one(connection, direct, suite_repository):
    v1, v2 = load(suite_repository, "iris_triton", 1), load(suite_repository, "iris_triton", 2)
    assert triton_state(direct, "iris_triton") == {"1": "READY", "2": "READY"}
    p1 = v1.run({"input": IRIS_ROWS}, ["probabilities"])[0]
    p2 = v2.run({"input": IRIS_ROWS}, ["probabilities"])[0]
    assert not np.allclose(p1, p2)  # two different models behind one Triton name

    # A reload holds the version twice; dropping the old object keeps it served.
    again = load(suite_repository, "iris_triton", 1)
    del v1  # the data plane drops a retired version like this: no close() call
    time.sleep(0.3)
    assert connection.held_versions("iris_triton") == [1, 2]
    again.close()
    states = triton_state(direct, "iris_triton")
    assert states["2"] == "READY" and states.get("1") != "READY"
    v2.close()
    wait_for(lambda: "READY" not in triton_state(direct, "iris_triton").values())


def test_a_model_triton_lost_is_unavailable_then_loaded_again(connection, direct, suite_repository):
    model = load(suite_repository, "iris_triton", 2)
    try:
        direct.unload_model("iris_triton")  # as a restarted tritonserver would have forgotten it
        wait_for(lambda: "READY" not in triton_state(direct, "iris_triton").values())
        with pytest.raises(Unavailable, match="unknown model"):
            model.run({"input": IRIS_ROWS}, ["label"])
        wait_for(lambda: triton_state(direct, "iris_triton").get("2") == "READY")
        assert model.run({"input": IRIS_ROWS}, ["label"])[0].shape == (3, 1)
    finally:
        model.close()


def test_gpu_metrics_are_read_from_tritons_metrics_port(connection):
    metrics = connection.gpu_metrics()
    # This CPU-only build reports CPU gauges; a GPU build adds nv_gpu_* per GPU uuid.
    assert 0.0 <= metrics["nv_cpu_utilization"][""] <= 1.0
    assert metrics["nv_cpu_memory_total_bytes"][""] > 0
    assert all(name.startswith(("nv_gpu_", "nv_cpu_", "nv_energy_")) for name in metrics)


def test_unreachable_triton_is_unavailable(suite_repository, tmp_path):
    from aiworks.supervisor.supervisor import free_port

    settings = RuntimeSettings(
        scheduler_address="",
        triton_url=f"127.0.0.1:{free_port()}",
        triton_repository=tmp_path,
        triton_request_timeout_s=2,
    )
    triton_backend.configure(settings)
    try:
        with pytest.raises(Unavailable, match="Triton"):
            load(suite_repository, "iris_triton", 1)
        assert not triton_backend.connection().healthy()
    finally:
        triton_backend.shutdown()


def test_default_model_filename_reaches_triton(connection, direct, suite_repository, tmp_path):
    import shutil

    folder = tmp_path / "iris_named"
    shutil.copytree(suite_repository / "iris_triton", folder)
    for version in ("1", "2"):
        (folder / version / "model.py").rename(folder / version / "stand_in.py")
    text = (folder / "config.pbtxt").read_text().replace('name: "iris_triton"', 'name: "iris_named"')
    (folder / "config.pbtxt").write_text(text + 'default_model_filename: "stand_in.py"\n')
    repo = ModelRepository(tmp_path)
    config = read_config(folder)
    assert repo.model_file(config, 1).name == "stand_in.py"
    model = TritonModel(repo.model_file(config, 1), config, 1)
    try:
        assert direct.get_model_config("iris_named", as_json=True)["config"]["default_model_filename"] == "stand_in.py"
        assert model.run({"input": IRIS_ROWS}, ["label"])[0].shape == (3, 1)
    finally:
        model.close()


def test_a_tensorrt_plan_is_handed_to_triton_as_a_plan(connection, suite_repository, tmp_path):
    """No TensorRT in this tritonserver: it refuses the plan, and says why (a GPU build serves it)."""
    folder = tmp_path / "iris_plan"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.plan").write_bytes(b"not a real engine")
    (folder / "config.pbtxt").write_text(
        'name: "iris_plan"\nplatform: "tensorrt_plan"\nmax_batch_size: 8\n'
        'input [ { name: "input" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "probabilities" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    )
    config = read_config(folder)
    assert config.backend == "triton"  # a plan only Triton serves: no backend line needed
    path = ModelRepository(tmp_path).model_file(config, 1)
    assert path.name == "model.plan"
    with pytest.raises(AIWorksError, match="iris_plan") as refused:
        TritonModel(path, config, 1)
    assert "tensorrt" in str(refused.value).lower()
    assert str(connection.repository) not in str(refused.value)  # no folder of this replica's leaves it
    assert 'platform: "tensorrt_plan"' in (connection.repository / "iris_plan" / "config.pbtxt").read_text()


async def test_a_retired_version_is_released_in_triton(connection, direct, suite_repository, tmp_path):
    import shutil

    from aiworks.runtime.dataplane import RuntimeDataPlane

    shutil.copytree(suite_repository / "iris_triton", tmp_path / "iris_triton")
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path), retire_quiet_s=0.1, warmup=False)
    try:
        specs = await dataplane.load("iris_triton")
        assert connection.held_versions("iris_triton") == [1, 2]
        # Triton holds the batch window (500 µs in the config): the scheduler is told to send at once.
        assert {s.batching.max_queue_delay_us for s in specs} == {0} and all(s.batching.enabled for s in specs)
        config = tmp_path / "iris_triton" / "config.pbtxt"
        config.write_text(
            config.read_text().replace(
                "version_policy: { all { } }", "version_policy: { specific { versions: [ 2 ] } }"
            )
        )
        await dataplane.load("iris_triton")  # version 1 retires, and is closed once idle
        deadline = time.monotonic() + 10
        while connection.held_versions("iris_triton") != [2] and time.monotonic() < deadline:
            await __import__("asyncio").sleep(0.05)
        assert connection.held_versions("iris_triton") == [2]
        wait_for(lambda: triton_state(direct, "iris_triton").get("1") != "READY")
    finally:
        await dataplane.unload("iris_triton")
        await dataplane.close()
