"""A backend coming back (a restarting tritonserver): the gateway's requests wait for it, they do not fail."""

from __future__ import annotations

import asyncio

import pytest
from routing_support import FakeReplica, make

from aiworks.core.errors import DeadlineExceeded, Unavailable
from aiworks.core.model_config import ModelSpec, ModelState, TensorSpec

KEY = ("m", "1")


def spec(state: ModelState = ModelState.READY) -> ModelSpec:
    return ModelSpec(name="m", version="1", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (2,)),),
                     outputs=(TensorSpec("y", "FP32", (2,)),), state=state)  # fmt: skip


def setup(state: ModelState):
    replica = FakeReplica("r1")
    suite = make({"r1": replica}, [spec(state)], devices={"r1": "gpu"})
    suite.registry.replicas["r1"].gpus = [{"index": 0, "name": "H200"}]
    return suite, replica


async def test_a_recovering_version_resolves_and_its_requests_wait_for_it():
    suite, replica = setup(ModelState.LOADING)
    assert suite.mirror.resolve("m", "1").state is ModelState.LOADING
    assert suite.mirror.resolve("m", "").version == "1"
    assert suite.mirror.holders(KEY) == [] and [r.replica_id for r in suite.mirror.recovering(KEY)] == ["r1"]
    waiting = asyncio.create_task(suite.infer("1"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no replica serves it yet: the request waits, it does not fail
    suite.registry.heartbeat("r1", [spec()])  # the backend is back
    suite.sync()
    answer = await asyncio.wait_for(waiting, 1)
    assert answer.outputs[0].shape == (1, 2) and replica.batches == 1


async def test_a_request_with_a_deadline_waits_no_longer_than_it():
    suite, _ = setup(ModelState.LOADING)
    with pytest.raises(DeadlineExceeded, match="coming back"):
        await asyncio.wait_for(suite.infer("1", timeout=50_000), 2)


async def test_a_version_that_is_gone_fails_at_once():
    suite, _ = setup(ModelState.READY)
    suite.registry.heartbeat("r1", [])
    suite.sync()
    with pytest.raises(Unavailable):
        suite.mirror.resolve("m", "1")
    with pytest.raises(Unavailable):
        await asyncio.wait_for(suite.infer("1"), 1)


def test_status_prints_a_gpu_replicas_gpus():
    from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
    from aiworks.status import format_status

    reply = pb.StatusResponse(replicas=[pb.ReplicaStatus(
        replica_id="gpu-0", device="gpu", live=True,
        gpus=[pb.GpuInfo(index=0, name="NVIDIA H200", memory_used_bytes=12 << 30, memory_total_bytes=141 << 30,
                         utilization_ratio=0.87)],
    )])  # fmt: skip
    assert "gpu 0: NVIDIA H200, 12.0/141.0 GiB, 87% busy" in format_status(reply)


def test_a_gpu_replica_heartbeats_its_nvml_readings():
    from aiworks.core.gpu import GpuReading
    from aiworks.runtime.registrar import gpu_messages

    reading = GpuReading(0, "GPU-1234", "NVIDIA H200", 0.5, 10 << 30, 141 << 30)
    (message,) = gpu_messages(lambda: [reading])
    assert (message.uuid, message.name, message.utilization_ratio) == ("GPU-1234", "NVIDIA H200", 0.5)
    assert message.memory_total_bytes == 141 << 30
    assert gpu_messages(None) == []

    def broken():
        raise RuntimeError("GPU fell off the bus")

    assert gpu_messages(broken) == []  # the heartbeat still goes
