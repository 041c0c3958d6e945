"""The scheduler's batching, splitting, routing and failover against fake replicas."""

import asyncio

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument, NotFound, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings


class FakeReplica:
    """Doubles its input; records every batch; can be made to fail or stall."""

    def __init__(self, delay_s: float = 0.0):
        self.batches: list[int] = []
        self.delay_s = delay_s
        self.fail_with: Exception | None = None

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        if self.fail_with is not None:
            raise self.fail_with
        x = inputs[0].to_numpy()
        self.batches.append(x.shape[0])
        await asyncio.sleep(self.delay_s)
        return [Tensor.from_numpy("y", x * 2)], 0

    async def close(self):
        pass


def spec(batching=True, max_batch=8, delay_us=20_000, version="1") -> ModelSpec:
    return ModelSpec(
        "m",
        version,
        max_batch_size=max_batch,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(batching, delay_us, ()),
    )


def make(replicas: dict[str, FakeReplica], specs, **settings):
    registry = ReplicaRegistry(lambda address: replicas[address])
    for rid in replicas:
        registry.register(rid, rid, "cpu", {}, specs)
    return Scheduler(SchedulerSettings(**settings), registry), registry


def request(rows: int, start: float = 0.0) -> InferRequest:
    x = (np.arange(rows * 2, dtype=np.float32) + start).reshape(rows, 2)
    return InferRequest("m", "", [Tensor.from_numpy("x", x)])


async def test_concurrent_requests_are_batched_and_split_exactly():
    replica = FakeReplica(delay_s=0.01)
    scheduler, _ = make({"r0": replica}, [spec()], max_inflight_batches=1)
    rows = [1, 3, 2, 1, 1, 2, 1, 1, 3, 2]
    responses = await asyncio.gather(*(scheduler.infer(request(n, start=100 * i)) for i, n in enumerate(rows)))
    for i, (n, resp) in enumerate(zip(rows, responses)):
        expected = (np.arange(n * 2, dtype=np.float32) + 100 * i).reshape(n, 2) * 2
        np.testing.assert_array_equal(resp.outputs[0].to_numpy(), expected)
    assert sum(replica.batches) == sum(rows)
    assert len(replica.batches) < len(rows)  # some requests shared a batch
    assert max(replica.batches) <= 8


async def test_no_batching_sends_each_request_alone():
    replica = FakeReplica(delay_s=0.005)
    scheduler, _ = make({"r0": replica}, [spec()], batching=False, max_inflight_batches=1)
    await asyncio.gather(*(scheduler.infer(request(2)) for _ in range(6)))
    assert replica.batches == [2] * 6


async def test_both_replicas_serve():
    a, b = FakeReplica(delay_s=0.01), FakeReplica(delay_s=0.01)
    scheduler, _ = make({"a": a, "b": b}, [spec(batching=False)], max_inflight_batches=1)
    await asyncio.gather(*(scheduler.infer(request(1)) for _ in range(10)))
    assert a.batches and b.batches and len(a.batches) + len(b.batches) == 10


async def test_a_failing_replica_is_retried_elsewhere():
    good, bad = FakeReplica(), FakeReplica()
    bad.fail_with = Unavailable("connection refused")
    scheduler, registry = make({"bad": bad, "good": good}, [spec(batching=False)])
    for _ in range(4):
        resp = await scheduler.infer(request(1))
        assert resp.outputs[0].shape == (1, 2)
    assert len(good.batches) == 4
    assert not registry.replicas["bad"].live


async def test_errors_from_the_model_are_not_retried():
    replica = FakeReplica()
    replica.fail_with = InvalidArgument("bad batch")
    scheduler, _ = make({"r0": replica}, [spec()])
    with pytest.raises(InvalidArgument, match="bad batch"):
        await scheduler.infer(request(1))


async def test_unknown_model_version_and_no_replica():
    scheduler, registry = make({"r0": FakeReplica()}, [spec()])
    with pytest.raises(NotFound, match="unknown model 'nope'"):
        await scheduler.infer(InferRequest("nope", "", []))
    with pytest.raises(NotFound, match="has no version '9'"):
        await scheduler.infer(InferRequest("m", "9", request(1).inputs))
    registry.mark_down(registry.replicas["r0"], "test")
    with pytest.raises(Unavailable, match="no live replica"):
        await scheduler.infer(request(1))


async def test_latest_version_is_the_default():
    scheduler, _ = make({"r0": FakeReplica()}, [spec(version="1"), spec(version="10"), spec(version="2")])
    resp = await scheduler.infer(request(1))
    assert resp.version == "10"


async def test_heartbeat_expiry_uses_the_clock():
    now = [0.0]
    registry = ReplicaRegistry(lambda a: FakeReplica(), clock=lambda: now[0])
    registry.register("r0", "x", "cpu", {}, [spec()])
    now[0] = 2.0
    assert registry.expire(3.0) == []
    now[0] = 3.5
    assert registry.expire(3.0) == ["r0"]
    assert registry.heartbeat("r0", []) is False  # the replica must register again
