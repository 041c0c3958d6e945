"""Latency-aware routing, pools, outlier ejection, retries and version weights, on fake replicas and a fake clock.

The scheduler (the control plane) hands its routing table to a gateway's
dispatcher, which routes: the same path as in the suite, without the gRPC
stream in between.
"""

import asyncio

import pytest
from routing_support import FakeClock, FakeReplica, load, make, spec

from aiworks.core.errors import DeadlineExceeded, Internal, InvalidArgument, NotFound, Unavailable
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy, ReplicaHealth
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.traffic_state import TrafficPolicy, TrafficState

# ---- latency-aware routing -------------------------------------------------------------------


async def test_a_ten_times_slower_replica_gets_about_a_tenth_of_the_batches():
    fast, slow = FakeReplica("fast", delay_s=0.002), FakeReplica("slow", delay_s=0.02)
    suite = make({"fast": fast, "slow": slow})
    await load(suite, clients=4, per_client=60)
    share = slow.batches / (fast.batches + slow.batches)
    assert share < 0.2, (fast.batches, slow.batches)
    assert slow.batches > 0  # still used when the fast one is busy


async def test_equal_replicas_share_the_load():
    a, b = FakeReplica("a", delay_s=0.005), FakeReplica("b", delay_s=0.005)
    suite = make({"a": a, "b": b})
    await load(suite, clients=4, per_client=25)
    assert 0.3 < a.batches / (a.batches + b.batches) < 0.7


async def test_realtime_prefers_gpu_replicas_and_batch_cpu_replicas():
    cpu, gpu = FakeReplica("cpu"), FakeReplica("gpu")
    suite = make({"cpu": cpu, "gpu": gpu}, devices={"gpu": "gpu"})
    await load(suite, clients=2, per_client=10, priority=1)
    assert gpu.batches == 20 and cpu.batches == 0
    await load(suite, clients=2, per_client=10, priority="batch")
    assert cpu.batches == 20 and gpu.batches == 20


async def test_class_pools_are_configurable_by_label():
    a, b = FakeReplica("a"), FakeReplica("b")
    suite = make({"a": a, "b": b}, labels={"a": {"pool": "spot"}}, class_pools={"standard": "pool=spot"})
    await load(suite, clients=2, per_client=5)
    assert a.batches == 10 and b.batches == 0


# ---- failures: retries and the retry budget --------------------------------------------------


async def test_a_request_that_fails_mid_flight_is_retried_on_another_replica():
    a, b = FakeReplica("a", delay_s=0.002), FakeReplica("b", delay_s=0.002)
    a.fail_next = 1  # its stream breaks under the first request
    suite = make({"a": a, "b": b})
    suite.replica("b").health.latency_s[("m", "1")] = 1.0  # the router tries "a" first
    await load(suite, clients=1, per_client=15)
    assert b.batches == 15 and a.batches == 0  # "a" is left out for a moment after it could not be reached
    budget = suite.dispatcher.budget
    assert budget.allowed == 1 and budget.active_retries == 0 and budget.active == 0
    assert suite.status().queues[0].retries == 1


async def test_errors_the_model_raises_are_final():
    a, b = FakeReplica("a"), FakeReplica("b")
    a.fail_next = b.fail_next = 5
    a.fail_with = b.fail_with = InvalidArgument("bad rows")
    suite = make({"a": a, "b": b})
    with pytest.raises(InvalidArgument):
        await suite.infer()
    assert suite.dispatcher.budget.allowed == 0


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
    suite = make({"a": a, "b": b}, retry_min_concurrency=0, retry_budget_percent=0)
    with pytest.raises(Unavailable, match="retry budget"):
        await suite.infer()
    assert suite.dispatcher.budget.denied == 1


async def test_a_hung_replica_hits_the_per_try_timeout_and_the_request_moves_on():
    slow, good = FakeReplica("slow", delay_s=5.0), FakeReplica("good")
    suite = make({"slow": slow, "good": good}, runtime_timeout_s=0.05, outlier_consecutive_errors=1,
                 outlier_max_ejection_percent=50)  # fmt: skip
    suite.replica("good").health.latency_s[("m", "1")] = 1.0  # make the router try "slow" first
    answer = await asyncio.wait_for(suite.infer(), 2.0)
    assert answer.outputs[0].shape == (1, 2) and good.batches == 1
    assert suite.replica("slow").health.times_ejected == 1


async def test_the_runtime_is_told_the_time_left():
    replica = FakeReplica("r")
    suite = make({"r": replica}, runtime_timeout_s=30)
    await suite.infer(timeout=200_000)
    await suite.infer()
    assert 0.1 < replica.seen_timeouts[0] <= 0.2 and replica.seen_timeouts[1] is None


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
    suite = make(
        {"bad": bad, "good": good},
        clock=clock,
        outlier_consecutive_errors=3,
        outlier_base_ejection_s=30,
        outlier_max_ejection_percent=50,
    )
    suite.replica("good").health.latency_s[("m", "1")] = 1.0  # the router prefers "bad" until ejected
    failures = 0
    for _ in range(10):
        try:
            await suite.infer()
        except Internal:
            failures += 1
    assert failures == 3 and good.batches == 7
    view = {r.replica_id: r for r in suite.status().replicas}
    assert view["bad"].ejected and view["bad"].times_ejected == 1 and view["bad"].ejected_for_s == 30
    bad.fail_next = 0
    clock.now += 31
    await suite.infer()
    assert bad.batches == 1  # back, and preferred again
    assert not {r.replica_id: r for r in suite.status().replicas}["bad"].ejected


async def test_when_every_holder_is_ejected_they_still_serve():
    clock = FakeClock()
    only = FakeReplica("only")
    only.fail_next = 1
    only.fail_with = Internal("boom")
    suite = make({"only": only}, clock=clock, outlier_consecutive_errors=1)
    with pytest.raises(Internal):
        await suite.infer()
    assert suite.dispatcher.outliers.ejected(suite.replica("only").health)
    await suite.infer()  # panic routing: better a suspect replica than none


async def test_an_ejection_the_monitor_asks_for_reaches_the_gateways_routing():
    clock = FakeClock()
    a, b = FakeReplica("a"), FakeReplica("b")
    suite = make({"a": a, "b": b}, clock=clock, outlier_max_ejection_percent=50)
    result = suite.scheduler.eject_replica("a", 20, "p99 breach")
    assert result.ejected and result.ejected_for_s == 20
    suite.sync()
    await load(suite, clients=2, per_client=5)
    assert a.batches == 0 and b.batches == 10
    assert {r.replica_id: r for r in suite.status().replicas}["a"].ejected
    suite.sync()  # the same order again: applied once
    assert suite.replica("a").health.times_ejected == 0
    clock.now += 21
    suite.replica("b").health.latency_s[("m", "1")] = 1.0
    await suite.infer()
    assert a.batches == 1  # back after its time
    assert suite.scheduler.eject_replica("b", 20, "again").ejected  # "a" is back: one of two may be out
    refused = suite.scheduler.eject_replica("a", 20, "and again")
    assert not refused.ejected and "50%" in refused.message  # both out would be more than 50%


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


async def test_the_gateway_applies_the_schedulers_weights_only_to_requests_without_a_version():
    replica = FakeReplica("r")
    suite = make({"r": replica}, [spec("1"), spec("2")])
    suite.scheduler.set_traffic(TrafficPolicy("m", {"1": 75, "2": 25}))
    suite.sync()
    versions = [suite.dispatcher.resolve("m", "").version for _ in range(100)]
    assert versions.count("2") == 25
    assert {suite.dispatcher.resolve("m", "2").version for _ in range(5)} == {"2"}
    with pytest.raises(InvalidArgument, match="no version"):
        suite.scheduler.set_traffic(TrafficPolicy("m", {"9": 1}))
    with pytest.raises(NotFound):
        suite.scheduler.set_traffic(TrafficPolicy("nope", {"1": 1}))
    assert suite.scheduler.get_traffic("m").weights == {"1": 75, "2": 25}
    assert suite.status().traffic[0].model == "m"
    suite.scheduler.set_traffic(TrafficPolicy("m", {}))
    suite.sync()
    assert {suite.dispatcher.resolve("m", "").version for _ in range(5)} == {"2"}  # the latest again


def test_a_replica_that_stops_answering_loses_every_choice_long_before_any_timeout():
    clock = FakeClock()
    suite = make({"ok": FakeReplica("ok"), "hang": FakeReplica("hang")}, clock=clock)
    router = suite.dispatcher.router
    ok, hang = suite.replica("ok"), suite.replica("hang")
    key = ("m", "1")
    ok.health.latency_s[key] = hang.health.latency_s[key] = 0.010  # both answered in 10 ms so far
    router.sent(hang)  # one request goes to "hang" and no answer comes back
    for _ in range(3):
        router.sent(ok)
    clock.now += 0.005  # 5 ms: not yet late; "hang" has fewer in flight and is still chosen
    assert router.pick(key) is hang
    clock.now += 0.100  # 105 ms of silence from "hang", ten times its usual latency; "ok" keeps answering
    router.answered(ok)
    router.sent(ok)
    assert {router.pick(key).replica_id for _ in range(20)} == {"ok"}
    router.answered(hang)  # it answers after all: back to its average
    assert hang.outstanding == 0 and router.pick(key) is hang


async def test_a_request_whose_deadline_passed_never_reaches_a_replica_and_is_counted_once():
    from prometheus_client import REGISTRY

    replica = FakeReplica("r")
    suite = make({"r": replica})
    labels = {"model": "m", "version": "1"}
    before = REGISTRY.get_sample_value("aiworks_scheduler_timeouts_total", labels) or 0
    with pytest.raises(DeadlineExceeded):
        await suite.infer(timeout=1)  # 1 us: gone before it is sent
    assert replica.batches == 0 and replica.seen_timeouts == []
    assert REGISTRY.get_sample_value("aiworks_scheduler_timeouts_total", labels) == before + 1


def test_a_new_replica_gets_one_request_at_a_time_until_it_answers():
    clock = FakeClock()
    suite = make({"old": FakeReplica("old"), "new": FakeReplica("new")}, clock=clock)
    router = suite.dispatcher.router
    old, new = suite.replica("old"), suite.replica("new")
    key = ("m", "1")
    router.succeeded(old, key, 0.010)
    for _ in range(5):
        router.sent(old)
    assert router.pick(key) is new  # unmeasured: tried first...
    router.sent(new)
    assert {router.pick(key).replica_id for _ in range(20)} == {"old"}  # ...but one at a time
    router.answered(new)
    router.succeeded(new, key, 0.004)
    router.sent(new)
    assert router.pick(key) is new  # measured and fast: several in flight are fine now


def test_a_replica_avoided_for_being_slow_is_tried_again_once_its_average_fades():
    clock = FakeClock()
    suite = make({"a": FakeReplica("a"), "b": FakeReplica("b")}, clock=clock)
    router = suite.dispatcher.router
    a, b = suite.replica("a"), suite.replica("b")
    key = ("m", "1")
    router.succeeded(a, key, 0.010)
    router.failed(b, DeadlineExceeded("per-try timeout"), key, waited_s=1.0)  # it hung once: 1 s on record
    router.sent(a)
    assert {router.pick(key).replica_id for _ in range(20)} == {"a"}
    clock.now += 20  # ten half-lives without news of b; a keeps answering
    router.answered(a)
    router.succeeded(a, key, 0.010)
    router.sent(a)
    assert router.pick(key) is b  # b's record has faded: it gets a (single) request to prove itself
