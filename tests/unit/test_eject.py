"""EjectReplica: the monitor takes a replica out of routing for a while, within maxEjectionPercent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy, ReplicaHealth
from aiworks.scheduler.settings import SchedulerSettings
from prometheus_client import REGISTRY

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import Internal, InvalidArgument, NotFound
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec


class FakeClock:
    def __init__(self):
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class CountingReplica:
    def __init__(self):
        self.batches = 0
        self.fail_with: Exception | None = None

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        if self.fail_with is not None:
            raise self.fail_with
        self.batches += 1
        await asyncio.sleep(0)
        return [Tensor.from_numpy("y", inputs[0].to_numpy())], 0

    async def close(self):
        pass


def make(names: list[str], clock: FakeClock, **settings) -> tuple[Scheduler, dict[str, CountingReplica]]:
    replicas = {n: CountingReplica() for n in names}
    spec = ModelSpec(
        "m", "1", max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(False, 0, ()),
    )  # fmt: skip
    registry = ReplicaRegistry(lambda address: replicas[address], clock=clock)
    for n in names:
        registry.register(n, n, "cpu", {}, [spec])
    defaults = {"outlier_base_ejection_s": 30.0, "outlier_max_ejection_percent": 50.0}
    return Scheduler(SchedulerSettings(**{**defaults, **settings}), registry, clock=clock), replicas


def request() -> InferRequest:
    return InferRequest("m", "", [Tensor.from_numpy("x", np.ones((1, 2), np.float32))])


def ejections(replica: str, reason: str) -> float:
    return REGISTRY.get_sample_value("aiworks_scheduler_ejections_total", {"replica": replica, "reason": reason}) or 0


async def test_an_ejected_replica_gets_no_batches_until_its_time_is_up():
    clock = FakeClock()
    scheduler, replicas = make(["ej-a", "ej-b"], clock)
    before = ejections("ej-a", "monitor")
    result = scheduler.eject_replica("ej-a", 12.5, "p99 over the SLO for 5 minutes")
    assert result.ejected and result.ejected_for_s == 12.5 and "p99 over the SLO" in result.message
    assert ejections("ej-a", "monitor") == before + 1
    view = {r.replica_id: r for r in scheduler.status().replicas}
    assert view["ej-a"].ejected and view["ej-a"].ejected_for_s == 12.5 and not view["ej-b"].ejected
    assert scheduler.registry.replicas["ej-a"].health.ejection_reason == "p99 over the SLO for 5 minutes"
    for _ in range(20):
        await scheduler.infer(request())
    assert (replicas["ej-a"].batches, replicas["ej-b"].batches) == (0, 20)
    clock.now += 12.5
    assert not {r.replica_id: r for r in scheduler.status().replicas}["ej-a"].ejected
    for _ in range(40):
        await scheduler.infer(request())
    assert replicas["ej-a"].batches > 0  # back in routing
    await scheduler.close()


def test_duration_zero_means_the_base_ejection_time_and_a_longer_ejection_is_kept():
    clock = FakeClock()
    scheduler, _ = make(["ej-c", "ej-d"], clock, outlier_base_ejection_s=45.0)
    assert scheduler.eject_replica("ej-c", 0, "asked").ejected_for_s == 45.0
    clock.now += 5
    again = scheduler.eject_replica("ej-c", 10, "asked again")
    assert again.ejected and again.ejected_for_s == 40.0  # the earlier, longer ejection stands


def test_ejection_that_would_exceed_max_ejection_percent_is_refused():
    clock = FakeClock()
    scheduler, _ = make(["ej-e", "ej-f", "ej-g", "ej-h"], clock, outlier_max_ejection_percent=50.0)
    assert scheduler.eject_replica("ej-e", 10, "x").ejected
    assert scheduler.eject_replica("ej-f", 10, "x").ejected
    before = ejections("ej-g", "monitor")
    refused = scheduler.eject_replica("ej-g", 10, "x")
    assert not refused.ejected and refused.ejected_for_s == 0
    assert "50%" in refused.message and "outlier_max_ejection_percent" in refused.message
    assert ejections("ej-g", "monitor") == before
    assert not scheduler.outliers.ejected(scheduler.registry.replicas["ej-g"].health)
    # One replica may always be ejected, as in Envoy, even with a tiny percentage.
    lone, _ = make(["ej-i", "ej-j"], clock, outlier_max_ejection_percent=1.0)
    assert lone.eject_replica("ej-i", 10, "x").ejected
    assert not lone.eject_replica("ej-j", 10, "x").ejected


def test_unknown_replica_is_not_found_and_a_negative_or_infinite_duration_invalid():
    scheduler, _ = make(["ej-k"], FakeClock())
    with pytest.raises(NotFound, match="unknown replica 'nope'"):
        scheduler.eject_replica("nope", 10, "x")
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument):
            scheduler.eject_replica("ej-k", bad, "x")


def test_monitor_ejections_leave_the_outlier_multiplier_alone():
    clock = FakeClock()
    detector = OutlierDetector(OutlierPolicy(2, base_ejection_s=10, max_ejection_s=100, max_ejection_percent=100), clock)
    h = ReplicaHealth("r")
    assert detector.eject(h, [h], 3, "monitor") == (True, 3)
    assert h.times_ejected == 0
    clock.now += 3
    assert [detector.failure(h, [h]) for _ in range(2)] == [False, True]
    assert detector.remaining_s(h) == 10  # the first outlier ejection: base × 1


async def test_outlier_ejections_count_with_reason_outlier():
    clock = FakeClock()
    scheduler, replicas = make(["ej-bad", "ej-good"], clock, outlier_consecutive_errors=2)
    replicas["ej-bad"].fail_with = Internal("model crashed")
    scheduler.registry.replicas["ej-good"].health.latency_s[("m", "1")] = 1.0  # prefer ej-bad until it is out
    before = ejections("ej-bad", "outlier")
    for _ in range(6):
        try:
            await scheduler.infer(request())
        except Internal:
            pass
    assert ejections("ej-bad", "outlier") == before + 1
    assert ejections("ej-bad", "monitor") == 0
    await scheduler.close()
