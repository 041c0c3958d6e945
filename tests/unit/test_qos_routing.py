"""Latency-aware routing, pools, outlier ejection, retries and version weights, on fake replicas and a fake clock."""

import asyncio

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import Internal, InvalidArgument, NotFound, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy, ReplicaHealth
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.traffic_state import TrafficPolicy, TrafficState


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """Echoes its input after ``delay_s``; can fail the next N batches or hang."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.name = name
        self.delay_s = delay_s
        self.batches = 0
        self.fail_next = 0
        self.fail_with: Exception = Unavailable(f"{name} is unreachable")
        self.seen_timeouts: list[float] = []

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        self.seen_timeouts.append(timeout_s)
        if self.fail_next:
            self.fail_next -= 1
            raise self.fail_with
        await asyncio.sleep(self.delay_s)
        self.batches += 1
        return [Tensor.from_numpy("y", inputs[0].to_numpy())], 0

    async def close(self):
        pass


def spec(version="1", batching=False) -> ModelSpec:
    return ModelSpec(
        "m",
        version,
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(batching, 0, ()),
    )


def make(replicas: dict[str, FakeReplica], specs=None, *, devices=None, clock=None, **settings):
    registry = ReplicaRegistry(lambda address: replicas[address])
    for rid in replicas:
        registry.register(rid, rid, (devices or {}).get(rid, "cpu"), {}, specs or [spec()])
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(SchedulerSettings(**settings), registry, **kwargs), registry


def request(version="", **parameters) -> InferRequest:
    x = np.ones((1, 2), dtype=np.float32)
    return InferRequest("m", version, [Tensor.from_numpy("x", x)], parameters=parameters)


async def load(scheduler, clients: int, per_client: int, **parameters):
    async def client():
        for _ in range(per_client):
            await scheduler.infer(request(**parameters))

    await asyncio.gather(*(client() for _ in range(clients)))


# ---- latency-aware routing -------------------------------------------------------------------


async def test_a_ten_times_slower_replica_gets_about_a_tenth_of_the_batches():
    fast, slow = FakeReplica("fast", delay_s=0.002), FakeReplica("slow", delay_s=0.02)
    scheduler, _ = make({"fast": fast, "slow": slow}, max_inflight_batches=1)
    await load(scheduler, clients=4, per_client=60)
    share = slow.batches / (fast.batches + slow.batches)
    assert share < 0.2, (fast.batches, slow.batches)
    assert slow.batches > 0  # still used when the fast one is busy


async def test_equal_replicas_share_the_load():
    a, b = FakeReplica("a", delay_s=0.005), FakeReplica("b", delay_s=0.005)
    scheduler, _ = make({"a": a, "b": b}, max_inflight_batches=1)
    await load(scheduler, clients=4, per_client=25)
    assert 0.3 < a.batches / (a.batches + b.batches) < 0.7


async def test_realtime_prefers_gpu_replicas_and_batch_cpu_replicas():
    cpu, gpu = FakeReplica("cpu"), FakeReplica("gpu")
    scheduler, _ = make({"cpu": cpu, "gpu": gpu}, devices={"gpu": "gpu"})
    await load(scheduler, clients=2, per_client=10, priority=1)
    assert gpu.batches == 20 and cpu.batches == 0
    await load(scheduler, clients=2, per_client=10, priority="batch")
    assert cpu.batches == 20 and gpu.batches == 20


async def test_class_pools_are_configurable_by_label():
    a, b = FakeReplica("a"), FakeReplica("b")
    registry = ReplicaRegistry(lambda address: {"a": a, "b": b}[address])
    registry.register("a", "a", "cpu", {"pool": "spot"}, [spec()])
    registry.register("b", "b", "cpu", {}, [spec()])
    scheduler = Scheduler(SchedulerSettings(class_pools={"standard": "pool=spot"}), registry)
    await load(scheduler, clients=2, per_client=5)
    assert a.batches == 10 and b.batches == 0


# ---- failures: retries and the retry budget --------------------------------------------------


async def test_a_batch_that_fails_mid_flight_is_retried_on_another_replica():
    a, b = FakeReplica("a", delay_s=0.002), FakeReplica("b", delay_s=0.002)
    a.fail_next = 1  # its stream breaks under the first batch
    scheduler, registry = make({"a": a, "b": b})
    registry.replicas["b"].health.latency_s[("m", "1")] = 1.0  # the router tries "a" first
    await load(scheduler, clients=3, per_client=5)
    assert b.batches == 15 and a.batches == 0  # "a" is down until its next heartbeat
    assert not registry.replicas["a"].live
    assert scheduler.retry_budget.allowed == 1 and scheduler.retry_budget.active_retries == 0
    assert scheduler.status().queues[0].retries == 1


async def test_errors_the_model_raises_are_final():
    a, b = FakeReplica("a"), FakeReplica("b")
    a.fail_next = b.fail_next = 5
    a.fail_with = b.fail_with = InvalidArgument("bad rows")
    scheduler, _ = make({"a": a, "b": b})
    with pytest.raises(InvalidArgument):
        await scheduler.infer(request())
    assert scheduler.retry_budget.allowed == 0


def test_the_retry_budget_allows_a_percentage_with_a_minimum():
    budget = RetryBudget(budget_percent=20, min_concurrency=2)
    for _ in range(20):
        budget.begin()
    assert [budget.try_retry() for _ in range(5)] == [True, True, True, True, False]  # 20% of 20
    assert budget.denied == 1
    for _ in range(4):
        budget.retry_done()
    for _ in range(19):
        budget.end()
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]  # the minimum


async def test_a_spent_retry_budget_fails_fast_instead_of_retrying():
    a, b = FakeReplica("a"), FakeReplica("b")
    a.fail_next = b.fail_next = 1
    scheduler, _ = make({"a": a, "b": b}, retry_min_concurrency=0, retry_budget_percent=0)
    with pytest.raises(Unavailable, match="retry budget"):
        await scheduler.infer(request())
    assert scheduler.retry_budget.denied == 1


async def test_a_hung_replica_hits_the_per_try_timeout_and_the_batch_moves_on():
    slow, good = FakeReplica("slow", delay_s=5.0), FakeReplica("good")
    scheduler, registry = make({"slow": slow, "good": good}, runtime_timeout_s=0.05, outlier_consecutive_errors=1)
    registry.replicas["good"].health.latency_s[("m", "1")] = 1.0  # make the router try "slow" first
    response = await asyncio.wait_for(scheduler.infer(request()), 2.0)
    assert response.outputs[0].shape == (1, 2) and good.batches == 1
    assert registry.replicas["slow"].health.times_ejected == 1


async def test_the_runtime_is_told_the_time_left():
    replica = FakeReplica("r")
    scheduler, _ = make({"r": replica}, runtime_timeout_s=30)
    await scheduler.infer(request(timeout=200_000))
    await scheduler.infer(request())
    assert 0.1 < replica.seen_timeouts[0] <= 0.2 and replica.seen_timeouts[1] == 30


# ---- outlier ejection ------------------------------------------------------------------------


def test_ejection_time_grows_with_each_ejection_and_the_replica_returns():
    clock = FakeClock()
    detector = OutlierDetector(OutlierPolicy(3, base_ejection_s=10, max_ejection_s=25, max_ejection_percent=100), clock)
    h, others = ReplicaHealth("r"), [ReplicaHealth("x"), ReplicaHealth("y")]
    population = [h, *others]
    assert [detector.failure(h, population) for _ in range(3)] == [False, False, True]
    assert detector.ejected(h) and detector.remaining_s(h) == 10
    clock.now += 10
    assert not detector.ejected(h)  # back after baseEjectionTime × 1
    for _ in range(3):
        detector.failure(h, population)
    assert detector.remaining_s(h) == 20  # × 2
    clock.now += 20
    assert not detector.ejected(h)
    for _ in range(3):
        detector.failure(h, population)
    assert detector.remaining_s(h) == 25  # × 3, capped at max_ejection_s
    clock.now += 25 + 3 * 10  # three healthy base periods after returning
    assert not detector.ejected(h)
    for _ in range(3):
        detector.failure(h, population)
    assert detector.remaining_s(h) == 10 and h.times_ejected == 1


def test_a_success_resets_the_consecutive_count():
    detector = OutlierDetector(OutlierPolicy(2, 10, 300, 100), FakeClock())
    h = ReplicaHealth("r")
    detector.failure(h, [h])
    detector.success(h)
    assert detector.failure(h, [h]) is False and not detector.ejected(h)


def test_max_ejection_percent_keeps_enough_replicas_in():
    detector = OutlierDetector(OutlierPolicy(1, 10, 300, max_ejection_percent=50), FakeClock())
    hs = [ReplicaHealth(str(i)) for i in range(4)]
    assert [detector.failure(h, hs) for h in hs] == [True, True, False, False]
    small = [ReplicaHealth("a"), ReplicaHealth("b")]
    tight = OutlierDetector(OutlierPolicy(1, 10, 300, max_ejection_percent=10), FakeClock())
    assert [tight.failure(h, small) for h in small] == [True, False]  # one may always be ejected


async def test_a_failing_replica_is_ejected_then_returns_after_its_time():
    clock = FakeClock()
    bad, good = FakeReplica("bad"), FakeReplica("good")
    bad.fail_next = 1000
    bad.fail_with = Internal("model crashed")
    scheduler, registry = make(
        {"bad": bad, "good": good},
        clock=clock,
        outlier_consecutive_errors=3,
        outlier_base_ejection_s=30,
        outlier_max_ejection_percent=50,
    )
    registry.replicas["good"].health.latency_s[("m", "1")] = 1.0  # the router prefers "bad" until ejected
    failures = 0
    for _ in range(10):
        try:
            await scheduler.infer(request())
        except Internal:
            failures += 1
    assert failures == 3 and good.batches == 7
    view = {r.replica_id: r for r in scheduler.status().replicas}
    assert view["bad"].ejected and view["bad"].times_ejected == 1 and view["bad"].ejected_for_s == 30
    bad.fail_next = 0
    clock.now += 31
    await scheduler.infer(request())
    assert bad.batches == 1  # back, and preferred again
    assert not {r.replica_id: r for r in scheduler.status().replicas}["bad"].ejected


async def test_when_every_holder_is_ejected_they_still_serve():
    clock = FakeClock()
    only = FakeReplica("only")
    only.fail_next = 1
    only.fail_with = Internal("boom")
    scheduler, registry = make({"only": only}, clock=clock, outlier_consecutive_errors=1)
    with pytest.raises(Internal):
        await scheduler.infer(request())
    assert scheduler.outliers.ejected(registry.replicas["only"].health)
    await scheduler.infer(request())  # panic routing: better a suspect replica than none


# ---- version weights -------------------------------------------------------------------------


def test_weights_split_exactly_and_skip_versions_without_replicas():
    state = TrafficState()
    state.set(TrafficPolicy("m", {"1": 90, "2": 10}))
    picks = [state.choose("m", {"1", "2"}) for _ in range(1000)]
    assert picks.count("2") == 100
    assert "2" in picks[:10]  # interleaved, not a run at the end
    assert {state.choose("m", {"1"}) for _ in range(10)} == {"1"}
    assert state.choose("m", set()) is None
    assert state.choose("other", {"1"}) is None
    state.set(TrafficPolicy("m", {}))
    assert state.get("m") is None


def test_policies_are_validated():
    with pytest.raises(InvalidArgument):
        TrafficPolicy("m", {"1": -1})
    with pytest.raises(InvalidArgument):
        TrafficPolicy("m", {"1": 0})
    assert TrafficPolicy.parse("m", ["1=90", "2=10"]).share("2") == 0.1
    with pytest.raises(InvalidArgument):
        TrafficPolicy.parse("m", ["1:90"])


async def test_the_scheduler_applies_weights_only_to_requests_without_a_version():
    replica = FakeReplica("r")
    scheduler, _ = make({"r": replica}, [spec("1"), spec("2")])
    scheduler.set_traffic(TrafficPolicy("m", {"1": 75, "2": 25}))
    versions = [(await scheduler.infer(request())).version for _ in range(100)]
    assert versions.count("2") == 25
    assert {(await scheduler.infer(request("2"))).version for _ in range(5)} == {"2"}
    with pytest.raises(InvalidArgument, match="no version"):
        scheduler.set_traffic(TrafficPolicy("m", {"9": 1}))
    with pytest.raises(NotFound):
        scheduler.set_traffic(TrafficPolicy("nope", {"1": 1}))
    assert scheduler.get_traffic("m").weights == {"1": 75, "2": 25}
    assert scheduler.status().traffic[0].model == "m"
