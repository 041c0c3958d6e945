"""EjectReplica: the monitor takes a replica out of every gateway's routing for a while, within maxEjectionPercent."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from routing_support import FakeClock, FakeReplica, make

from aiworks.core.errors import Internal, InvalidArgument, NotFound
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy, ReplicaHealth


def suite_of(names: list[str], clock: FakeClock, **settings):
    replicas = {n: FakeReplica(n) for n in names}
    defaults = {"outlier_base_ejection_s": 30.0, "outlier_max_ejection_percent": 50.0}
    return make(replicas, clock=clock, **{**defaults, **settings}), replicas


def ejections(replica: str, reason: str) -> float:
    return REGISTRY.get_sample_value("aiworks_scheduler_ejections_total", {"replica": replica, "reason": reason}) or 0


async def test_an_ejected_replica_gets_no_requests_until_its_time_is_up():
    clock = FakeClock()
    suite, replicas = suite_of(["ej-a", "ej-b"], clock)
    before = ejections("ej-a", "monitor")
    result = suite.scheduler.eject_replica("ej-a", 12.5, "p99 over the SLO for 5 minutes")
    assert result.ejected and result.ejected_for_s == 12.5 and "p99 over the SLO" in result.message
    assert ejections("ej-a", "monitor") == before + 1
    suite.sync()
    view = {r.replica_id: r for r in suite.status().replicas}
    assert view["ej-a"].ejected and view["ej-a"].ejected_for_s == 12.5 and not view["ej-b"].ejected
    assert suite.replica("ej-a").health.ejection_reason == "p99 over the SLO for 5 minutes"
    for _ in range(20):
        await suite.infer()
    assert (replicas["ej-a"].batches, replicas["ej-b"].batches) == (0, 20)
    clock.now += 12.5
    assert not {r.replica_id: r for r in suite.status().replicas}["ej-a"].ejected
    for _ in range(40):
        await suite.infer()
    assert replicas["ej-a"].batches > 0  # back in routing


def test_duration_zero_means_the_base_ejection_time_and_a_longer_ejection_is_kept():
    clock = FakeClock()
    suite, _ = suite_of(["ej-c", "ej-d"], clock, outlier_base_ejection_s=45.0)
    assert suite.scheduler.eject_replica("ej-c", 0, "asked").ejected_for_s == 45.0
    clock.now += 5
    again = suite.scheduler.eject_replica("ej-c", 10, "asked again")
    assert again.ejected and again.ejected_for_s == 40.0  # the earlier, longer ejection stands


def test_ejection_that_would_exceed_max_ejection_percent_is_refused():
    clock = FakeClock()
    suite, _ = suite_of(["ej-e", "ej-f", "ej-g", "ej-h"], clock, outlier_max_ejection_percent=50.0)
    scheduler = suite.scheduler
    assert scheduler.eject_replica("ej-e", 10, "x").ejected
    assert scheduler.eject_replica("ej-f", 10, "x").ejected
    before = ejections("ej-g", "monitor")
    refused = scheduler.eject_replica("ej-g", 10, "x")
    assert not refused.ejected and refused.ejected_for_s == 0
    assert "50%" in refused.message and "outlier_max_ejection_percent" in refused.message
    assert ejections("ej-g", "monitor") == before
    suite.sync()
    assert not suite.dispatcher.outliers.ejected(suite.replica("ej-g").health)
    # One replica may always be ejected, as in Envoy, even with a tiny percentage.
    lone, _ = suite_of(["ej-i", "ej-j"], clock, outlier_max_ejection_percent=1.0)
    assert lone.scheduler.eject_replica("ej-i", 10, "x").ejected
    assert not lone.scheduler.eject_replica("ej-j", 10, "x").ejected


def test_unknown_replica_is_not_found_and_a_negative_or_infinite_duration_invalid():
    suite, _ = suite_of(["ej-k"], FakeClock())
    with pytest.raises(NotFound, match="unknown replica 'nope'"):
        suite.scheduler.eject_replica("nope", 10, "x")
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument):
            suite.scheduler.eject_replica("ej-k", bad, "x")


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
    suite, replicas = suite_of(["ej-bad", "ej-good"], clock, outlier_consecutive_errors=2)
    replicas["ej-bad"].fail_next = 100
    replicas["ej-bad"].fail_with = Internal("model crashed")
    suite.replica("ej-good").health.latency_s[("m", "1")] = 1.0  # prefer ej-bad until it is out
    before = ejections("ej-bad", "outlier")
    for _ in range(6):
        try:
            await suite.infer()
        except Internal:
            pass
    assert ejections("ej-bad", "outlier") == before + 1
    assert ejections("ej-bad", "monitor") == 0
