"""The scheduler's side of a backend coming back (a restarting tritonserver): queue, don't fail."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy
from aiworks.scheduler.router import Router

from aiworks.core.errors import Unavailable
from aiworks.core.model_config import ModelSpec, ModelState

KEY = ("m", "1")


def spec(state: ModelState = ModelState.READY) -> ModelSpec:
    return ModelSpec(name="m", version="1", state=state)


def setup(state: ModelState):
    registry = ReplicaRegistry(lambda address: None)
    replica = registry.register("r1", "127.0.0.1:1", "gpu", {}, [spec(state)], gpus=[{"index": 0, "name": "H200"}])
    return registry, replica, Router(registry, 0, outliers=OutlierDetector(OutlierPolicy(), time.monotonic))


async def test_a_recovering_version_resolves_and_its_requests_wait_for_it():
    registry, replica, router = setup(ModelState.LOADING)
    assert registry.resolve("m", "1").state is ModelState.LOADING
    assert registry.resolve("m", "").version == "1"
    assert registry.holders(KEY) == [] and registry.recovering(KEY) == [replica]
    assert replica.gpus == [{"index": 0, "name": "H200"}]
    waiting = asyncio.create_task(router.acquire(KEY))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no replica serves it yet: the batch waits, it does not fail
    registry.heartbeat("r1", [spec()])  # the backend is back
    assert await asyncio.wait_for(waiting, 1) is replica


async def test_a_down_replica_whose_version_recovers_still_holds_the_queue_but_a_tried_one_does_not():
    registry, replica, router = setup(ModelState.LOADING)
    registry.mark_down(replica, "its batch failed")
    waiting = asyncio.create_task(router.acquire(KEY))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(Unavailable, match="no live replica"):  # the retry of a batch that failed on it
        await router.acquire(KEY, exclude={"r1"})


async def test_a_version_that_is_gone_fails_at_once():
    registry, replica, router = setup(ModelState.READY)
    registry.heartbeat("r1", [])
    with pytest.raises(Unavailable):
        registry.resolve("m", "1")
    with pytest.raises(Unavailable):
        await router.acquire(KEY)


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
