"""The judgement, the p99 from histogram buckets, and window deltas scraped from real /metrics endpoints."""

from __future__ import annotations

import math

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from aiworks.core import metrics as m
from aiworks.core.errors import Unavailable
from aiworks.monitor.rollout_judge import (
    LATENCY_BUCKET,
    REQUESTS,
    SLO,
    PrometheusSource,
    ScrapeSource,
    VersionStats,
    histogram_quantile,
    judge,
)


def test_histogram_quantile_interpolates_like_prometheus():
    inf = math.inf
    # 100 observations: 50 in (0, 0.01], 45 in (0.01, 0.025], 5 in (0.025, 0.05].
    buckets = {0.01: 50, 0.025: 95, 0.05: 100, inf: 100}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.025 + 0.025 * 4 / 5)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.005)  # the lowest bucket starts at 0
    assert histogram_quantile(0.99, {0.01: 0, 0.1: 0, inf: 10}) == pytest.approx(0.1)  # in +Inf: highest bound
    assert histogram_quantile(0.99, {0.01: 0, inf: 0}) is None
    assert histogram_quantile(0.99, {}) is None


def test_judge_messages_carry_the_numbers():
    slo = SLO(max_error_rate_increase=0.01, max_p99_ratio=1.5, min_requests=50, p99_floor_s=0.005)
    stable = VersionStats(1000, 0, 0.010)
    failing = judge(VersionStats(100, 21, 0.010), stable, slo, window_s=60)
    assert failing.verdict == "fail" and failing.reason == "error_rate"
    assert failing.message == "canary error rate 21% vs stable 0% (allowed +1 point)"
    slow = judge(VersionStats(100, 0, 0.031), stable, slo, window_s=60)
    assert slow.verdict == "fail" and slow.reason == "p99_latency"
    assert slow.message == "canary p99 3.1x stable (31 ms vs 10 ms; allowed 1.5x)"
    ok = judge(VersionStats(100, 1, 0.012), VersionStats(1000, 5, 0.010), slo, window_s=60)
    assert ok.verdict == "pass" and ok.reason == "within_slo" and "(1.20x)" in ok.message
    short = judge(VersionStats(49, 49, 9.0), stable, slo, window_s=30)
    assert short.verdict == "insufficient" and short.message == "49 canary request(s) in 30 s (need 50)"
    unbased = judge(VersionStats(100, 0, 0.5), None, slo, window_s=60)  # no baseline: no latency comparison
    assert unbased.verdict == "pass" and unbased.baseline == "none"
    earlier = judge(VersionStats(100, 0, 0.5), stable, slo, window_s=60, baseline="earlier")
    assert earlier.verdict == "pass" and earlier.p99_ratio is None and "not compared" in earlier.message
    assert judge(VersionStats(100, 5, 0.01), stable, slo, window_s=60, baseline="earlier").verdict == "fail"
    two_points = judge(VersionStats(100, 5, 0.01), stable, SLO(0.02), window_s=60)
    assert two_points.message.endswith("(allowed +2 points)")
    doc = failing.to_json()
    assert doc["canary"] == {"requests": 100, "errors": 21, "error_rate": 0.21, "p99_s": 0.01}
    assert doc["limits"]["max_p99_ratio"] == 1.5


class Exporter:
    """A real /metrics endpoint with the gateway's metric names, in a private registry."""

    def __init__(self):
        self.restart()
        self.runner: web.AppRunner | None = None
        self.address = ""

    def restart(self) -> None:
        """Counters from zero, as after a process restart."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aiworks_gateway_requests", "test", ["model", "version", "tenant", "protocol", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "aiworks_gateway_request_duration_seconds",
            "test",
            ["model", "version", "tenant", "protocol"],
            buckets=m.LATENCY_BUCKETS_S,
            registry=self.registry,
        )

    def serve(self, model: str, version: str, ok: int, failed: int, seconds: float) -> None:
        self.requests.labels(model, version, "", "grpc", "ok").inc(ok)
        if failed:
            self.requests.labels(model, version, "", "grpc", "internal").inc(failed)
        for _ in range(ok):
            self.latency.labels(model, version, "", "grpc").observe(seconds)

    async def start(self) -> None:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.address = f"{host}:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def exporters():
    found = [Exporter(), Exporter()]
    for e in found:
        await e.start()
    yield found
    for e in found:
        await e.stop()


@pytest.mark.loopback
async def test_scrape_source_counts_only_the_window_across_targets(exporters):
    gateway_a, gateway_b = exporters
    gateway_a.serve("m", "1", ok=500, failed=3, seconds=0.004)  # before the window: not counted
    gateway_a.serve("other", "2", ok=50, failed=50, seconds=1.0)
    source = ScrapeSource(lambda: [e.address for e in exporters])
    try:
        token = await source.begin("m")
        gateway_a.serve("m", "1", ok=90, failed=0, seconds=0.004)
        gateway_b.serve("m", "1", ok=100, failed=10, seconds=0.004)
        gateway_b.serve("m", "2", ok=40, failed=10, seconds=0.03)
        stats = await source.read("m", ["1", "2", "3"], token)
    finally:
        await source.close()
    assert stats["1"].requests == 200 and stats["1"].errors == 10
    assert stats["2"].requests == 50 and stats["2"].errors == 10 and stats["2"].error_rate == pytest.approx(0.2)
    assert stats["3"] == VersionStats(0, 0, None)
    assert 0.0025 < stats["1"].p99_s <= 0.005  # in the (2.5 ms, 5 ms] bucket
    assert 0.025 < stats["2"].p99_s <= 0.05


@pytest.mark.loopback
async def test_scrape_source_handles_restarts_late_targets_and_outages(exporters):
    first, second = exporters
    targets = [first.address]
    first.serve("m", "1", ok=1000, failed=0, seconds=0.004)
    source = ScrapeSource(lambda: list(targets))
    try:
        token = await source.begin("m")
        first.restart()  # its counters start again from zero, below what the window began with
        first.serve("m", "1", ok=30, failed=0, seconds=0.004)
        # A second gateway appears mid-window: it counts from its first scrape on.
        second.serve("m", "1", ok=400, failed=0, seconds=0.004)
        targets.append(second.address)
        stats = await source.read("m", ["1"], token)
        assert stats["1"].requests == 30
        second.serve("m", "1", ok=20, failed=0, seconds=0.004)
        stats = await source.read("m", ["1"], token)  # reading again extends the same window
        assert stats["1"].requests == 50
        targets[:] = ["127.0.0.1:9"]
        with pytest.raises(Unavailable):
            await source.read("m", ["1"], token)
    finally:
        await source.close()


def test_prometheus_queries_name_the_window_and_the_metrics():
    requests, p99 = PrometheusSource("http://prometheus:9090/").queries('we"ird', 90)
    assert requests == f'sum by (version, status) (increase({REQUESTS}{{model="we\\"ird"}}[90s]))'
    assert p99 == (
        f'histogram_quantile(0.99, sum by (version, le) (increase({LATENCY_BUCKET}{{model="we\\"ird"}}[90s])))'
    )
    assert REQUESTS == m.GATEWAY_REQUESTS._name + "_total"
    assert LATENCY_BUCKET == m.GATEWAY_REQUEST_DURATION._name + "_bucket"
