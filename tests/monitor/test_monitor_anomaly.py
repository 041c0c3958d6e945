"""Anomalies against learned baselines, and the health score's bounds and ordering."""

from __future__ import annotations

import itertools

import pytest
from monitor_support import make_settings

from aiworks.monitor.anomaly import (
    ERROR_SURGE,
    LATENCY_SPIKE,
    MEMORY_GROWTH,
    AnomalyDetector,
    Baseline,
    ErrorWindow,
    memory_trend,
)
from aiworks.monitor.discovery import DEAD, STARTING
from aiworks.monitor.health import health_score
from aiworks.monitor.signals import ReplicaView

MIB = 2**20


def run(detector: AnomalyDetector, views, window: ErrorWindow | None = None, start_s: float = 0.0):
    """Feed one view per second; returns (time, anomaly) for each anomaly that started."""
    window = window or ErrorWindow(10.0)
    found = []
    for t, view in zip(itertools.count(start_s), views):
        window.add(t, view.ok, view.failed)
        found += [(t, a) for a in detector.observe(view, window, t)]
    return found


def view(**fields) -> ReplicaView:
    return ReplicaView("runtime-0", "runtime-0", "runtime", up=True, **fields)


# ---- baseline --------------------------------------------------------------------------------------


def test_baseline_learns_mean_and_spread_and_is_ready_after_min_samples():
    b = Baseline(alpha=0.2, min_samples=5)
    for x in [10, 12, 10, 12]:
        b.update(x)
    assert not b.ready
    for x in [10, 12, 10, 12] * 10:
        b.update(x)
    assert b.ready and 10 < b.mean < 12 and 0.5 < b.std < 1.5


# ---- latency spike ---------------------------------------------------------------------------------


def test_latency_spike_against_the_replicas_own_baseline():
    d = AnomalyDetector(make_settings())
    normal = [view(latency_s=0.020 + 0.002 * (i % 3)) for i in range(20)]
    assert run(d, normal) == []
    assert d.baseline_latency_s("runtime-0") == pytest.approx(0.022, abs=0.002)
    found = run(d, [view(latency_s=0.090)] * 3, start_s=20)
    assert [(t, a.kind) for t, a in found] == [(20, LATENCY_SPIKE)]  # once, when it starts
    assert found[0][1].details["ratio"] >= 3
    assert d.active("runtime-0") == {LATENCY_SPIKE}
    # The spike did not become the baseline; back to normal, it clears and may fire again.
    assert d.baseline_latency_s("runtime-0") < 0.03
    assert run(d, [view(latency_s=0.021)], start_s=23) == []
    assert d.active("runtime-0") == set()
    assert [a.kind for _, a in run(d, [view(latency_s=0.1)], start_s=24)] == [LATENCY_SPIKE]


def test_no_latency_judgement_before_the_baseline_is_learned_or_below_the_floor():
    d = AnomalyDetector(make_settings(baseline_min_samples=10, latency_floor_s=0.001))
    assert run(d, [view(latency_s=0.010)] * 3 + [view(latency_s=1.0)]) == []  # 3 samples: not ready
    tiny = AnomalyDetector(make_settings())
    assert run(tiny, [view(latency_s=0.00001)] * 20 + [view(latency_s=0.0005)]) == []  # 50x, but under 1 ms


def test_rounds_without_batches_leave_the_latency_state_alone():
    d = AnomalyDetector(make_settings())
    run(d, [view(latency_s=0.02)] * 20)
    run(d, [view(latency_s=0.1)], start_s=20)
    assert run(d, [view()] * 5, start_s=21) == []
    assert d.active("runtime-0") == {LATENCY_SPIKE}


# ---- error surge -----------------------------------------------------------------------------------


def test_error_surge_above_the_usual_share():
    d = AnomalyDetector(make_settings(error_surge_ratio=0.2, error_min_requests=10))
    usual = [view(ok=19, failed=1)] * 30  # 5% errors is this replica's normal
    assert run(d, usual) == []
    window = ErrorWindow(10.0)
    run(d, usual, window)
    found = run(d, [view(ok=10, failed=10)] * 10, window, start_s=30)
    assert [a.kind for _, a in found] == [ERROR_SURGE]
    t, surge = found[0]
    assert surge.details["ratio"] >= 0.25 and "batches failed" in surge.message


def test_error_surge_needs_enough_batches():
    d = AnomalyDetector(make_settings(error_min_requests=10))
    window = ErrorWindow(10.0)
    assert run(d, [view(ok=0, failed=1)] * 5, window) == []  # all failed, but only 5 batches in the window
    assert [t for t, _ in run(d, [view(ok=0, failed=1)] * 6, window, start_s=5)] == [9]  # the 10th batch


# ---- memory growth ---------------------------------------------------------------------------------


def test_steady_memory_growth_is_an_anomaly():
    d = AnomalyDetector(make_settings(memory_window_s=100, memory_growth_ratio=0.2))
    leak = [view(rss_bytes=200 * MIB + i * 1 * MIB) for i in range(101)]  # +1 MiB/s on 200 MiB
    found = run(d, leak)
    assert [a.kind for _, a in found] == [MEMORY_GROWTH]
    t, growth = found[0]
    assert t >= 50  # needs half the window of samples
    assert growth.details["slope_bytes_per_s"] == pytest.approx(MIB, rel=0.01)


def test_a_sawtooth_or_flat_memory_is_not_growth():
    d = AnomalyDetector(make_settings(memory_window_s=100, memory_growth_ratio=0.2))
    sawtooth = [view(rss_bytes=200 * MIB + (i % 10) * 8 * MIB) for i in range(200)]
    flat = [view(rss_bytes=200 * MIB + (i % 2) * MIB) for i in range(200)]
    assert run(d, sawtooth) == []
    assert run(AnomalyDetector(make_settings(memory_window_s=100)), flat) == []


def test_memory_trend_fits_a_line():
    slope, start, up = memory_trend([(t, 100.0 + 2.0 * t) for t in range(10)])
    assert slope == pytest.approx(2.0) and start == pytest.approx(100.0) and up == 1.0


# ---- health score ----------------------------------------------------------------------------------


def score(v: ReplicaView, errors: float = 0.0, baseline: float | None = None) -> float:
    return health_score(v, error_ratio=errors, baseline_latency_s=baseline, saturation_batches=4).score


def test_health_score_bounds():
    worst = view(latency_s=100.0, inflight=1000)
    assert score(view()) == 100.0
    assert 0.0 <= score(worst, errors=1.0, baseline=0.001) <= 100.0
    assert score(worst, errors=5.0, baseline=0.001) == score(worst, errors=1.0, baseline=0.001)  # clipped
    assert score(ReplicaView("r", state=DEAD)) == 0.0
    assert score(ReplicaView("r", up=False)) == 0.0  # the scheduler says it is not live


def test_health_score_ordering():
    healthy = score(view(latency_s=0.02), baseline=0.02)
    ejected = score(view(ejected=True))
    starting = score(ReplicaView("r", state=STARTING))
    unregistered = score(ReplicaView("r"))
    assert healthy == 100.0 and ejected == 50.0 and starting == unregistered == 25.0
    # Each factor lowers the score, and more of it lowers it more.
    assert score(view(), errors=0.1) > score(view(), errors=0.5) > score(view(), errors=1.0)
    assert score(view(latency_s=0.04), baseline=0.02) > score(view(latency_s=0.08), baseline=0.02)
    assert score(view(latency_s=0.08), baseline=0.02) == score(view(latency_s=0.5), baseline=0.02)  # 4x: floor
    assert score(view(inflight=1)) > score(view(inflight=3)) > score(view(inflight=4)) == score(view(inflight=40))
    # Errors weigh most, then slowness, then saturation.
    assert score(view(), errors=1.0) < score(view(latency_s=1.0), baseline=0.01) < score(view(inflight=4))
