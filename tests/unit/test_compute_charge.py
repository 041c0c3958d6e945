"""What each request cost the runtime: shares of batches, deadlines that pass mid-batch, failures (fake replicas)."""

import asyncio
import time

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import DeadlineExceeded, InvalidArgument, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.dispatch import Charge
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings

MS = 1_000_000  # ns


class WorkingReplica:
    """Takes ``delay_s`` per batch and reports it as compute time; can fail after working."""

    def __init__(self, delay_s: float = 0.05, fail_with: Exception | None = None):
        self.delay_s = delay_s
        self.fail_with = fail_with
        self.batches: list[int] = []

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        await asyncio.sleep(self.delay_s)
        self.batches.append(inputs[0].shape[0])
        if self.fail_with is not None:
            raise self.fail_with
        return [Tensor.from_numpy("y", inputs[0].to_numpy())], int(self.delay_s * 1e9)

    async def close(self):
        pass


def make(replica, delay_us=0, **settings) -> Scheduler:
    spec = ModelSpec(
        "m", "1", max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(True, delay_us, ()),
    )  # fmt: skip
    registry = ReplicaRegistry(lambda address: replica)
    registry.register("r0", "r0", "cpu", {}, [spec])
    return Scheduler(SchedulerSettings(**settings), registry)


def request(rows: int = 1, **parameters) -> InferRequest:
    return InferRequest("m", "", [Tensor.from_numpy("x", np.ones((rows, 2), np.float32))], parameters=parameters)


async def test_each_request_is_charged_its_share_of_the_batch_by_rows():
    replica = WorkingReplica(0.08)
    scheduler = make(replica, delay_us=30_000)  # the two requests wait for each other and share one batch
    one, three = Charge(), Charge()
    a, b = await asyncio.gather(
        scheduler.infer(request(1), charge=one), scheduler.infer(request(3), charge=three)
    )
    assert replica.batches == [4]
    assert (one.compute_ns, three.compute_ns) == (20 * MS, 60 * MS)
    assert (a.compute_s, b.compute_s) == (0.02, 0.06)  # and it travels with the response


async def test_a_deadline_that_passes_while_the_batch_runs_is_answered_when_the_work_ended():
    replica = WorkingReplica(0.2)
    scheduler = make(replica)
    charge = Charge()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="passed while it ran"):
        await scheduler.infer(request(1, timeout=50_000), charge=charge)  # 50 ms, in a 200 ms batch
    assert time.monotonic() - started >= 0.19  # the runtime was not cut short, nor was the charge
    assert charge.compute_ns == 200 * MS and replica.batches == [1]
    assert scheduler.status().queues[0].expired == 0  # it ran: not an expiry from the queue


async def test_a_request_dropped_from_the_queue_costs_nothing():
    replica = WorkingReplica(0.15)
    scheduler = make(replica, max_inflight_batches=1)
    blocker = asyncio.ensure_future(scheduler.infer(request(1), charge=Charge()))
    await asyncio.sleep(0.01)
    charge = Charge()
    with pytest.raises(DeadlineExceeded, match="while it was queued"):
        await scheduler.infer(request(1, timeout=30_000), charge=charge)
    await blocker
    assert charge.compute_ns == 0 and replica.batches == [1]


async def test_a_batch_the_model_refuses_after_working_is_charged_its_time():
    scheduler = make(WorkingReplica(0.05, fail_with=InvalidArgument("the model rejected the batch")))
    charge = Charge()
    with pytest.raises(InvalidArgument):
        await scheduler.infer(request(2), charge=charge)
    assert 45 * MS <= charge.compute_ns < 1000 * MS


async def test_an_unreachable_replica_costs_the_tenant_nothing():
    scheduler = make(WorkingReplica(0.0, fail_with=Unavailable("replica r0 is down")), max_retries=0)
    charge = Charge()
    with pytest.raises(Unavailable):
        await scheduler.infer(request(1), charge=charge)
    assert charge.compute_ns == 0


async def test_the_stream_answer_carries_compute_us_on_failures_too():
    from aiworks.core.converters import from_infer_request
    from aiworks.scheduler.servicer import SchedulerServicer

    servicer = SchedulerServicer(make(WorkingReplica(0.1)))
    ok = await servicer._infer_on_stream(from_infer_request(request(1)))
    assert ok.error_code == 0 and ok.compute_us == 100_000
    message = from_infer_request(request(1))
    message.timeout_us = 20_000
    late = await servicer._infer_on_stream(message)
    assert late.error_code != 0 and "while it ran" in late.error_message and late.compute_us == 100_000
