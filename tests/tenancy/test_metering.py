"""Usage metering: two replicas' usage adds up in Redis, survives an outage, and shows in Prometheus."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from aiworks.core.errors import InvalidArgument
from aiworks.gateway.metering import UsageMeter

WINDOW_S = 3600
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z, a window boundary


class Clock:
    def __init__(self, now: float = T0 + 10):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sample(name: str, tenant: str, model: str) -> float:
    return REGISTRY.get_sample_value(name, {"tenant": tenant, "model": model}) or 0.0


async def test_two_replicas_usage_adds_up(redis_server):
    clock = Clock()
    a = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=0.02, timeout_s=0.5, clock=clock)
    b = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=0.02, timeout_s=0.5, clock=clock)
    await a.start()
    await b.start()
    for _ in range(7):
        a.record("acme", "iris", rows=2, compute_s=0.01)
    for _ in range(5):
        b.record("acme", "iris", rows=1, compute_s=0.02, cache_hit=True)
    b.record("lab", "digits", rows=4, compute_s=0.5)
    clock.now += WINDOW_S  # the next hour
    a.record("acme", "iris", rows=3, compute_s=0.1)
    await asyncio.sleep(0.1)  # the background flushes run

    report = await a.report(T0, T0 + 2 * WINDOW_S)
    assert report.source == "redis"
    windows = {(r.tenant, r.model, r.window_start): r for r in report.windows}
    first = windows[("acme", "iris", T0)]
    assert (first.requests, first.rows, first.cache_hits) == (12, 19, 5)
    assert first.compute_seconds == pytest.approx(0.17)
    second = windows[("acme", "iris", T0 + WINDOW_S)]
    assert (second.requests, second.rows, second.window_end) == (1, 3, T0 + 2 * WINDOW_S)
    totals = {(r.tenant, r.model): r for r in report.totals}
    assert totals[("acme", "iris")].requests == 13 and totals[("lab", "digits")].rows == 4

    doc = (await b.report(T0, T0 + WINDOW_S, tenant="acme")).to_dict()
    assert doc["source"] == "redis" and doc["window_s"] == WINDOW_S
    assert doc["usage"] == [
        {
            "tenant": "acme",
            "model": "iris",
            "window_start": "2026-01-01T00:00:00Z",
            "window_end": "2026-01-01T01:00:00Z",
            "requests": 12,
            "rows": 19,
            "compute_seconds": 0.17,
            "cache_hits": 5,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }
    ]
    await a.close()
    await b.close()


async def test_generation_tokens_add_up_across_replicas(redis_server):
    clock = Clock()
    a = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=0.02, timeout_s=0.5, clock=clock)
    b = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=0.02, timeout_s=0.5, clock=clock)
    await a.start()
    await b.start()
    a.record("acme", "codegen", prompt_tokens=11, completion_tokens=7)
    b.record("acme", "codegen", prompt_tokens=5, completion_tokens=3)
    b.record("acme", "codegen", requests=0, rows=0, prompt_tokens=4, completion_tokens=2)  # a cancelled stream
    a.record("acme", "minilm", rows=2, prompt_tokens=9)
    await asyncio.sleep(0.1)
    report = await b.report(T0, T0 + WINDOW_S, tenant="acme")
    assert report.source == "redis"
    totals = {r.model: r for r in report.totals}
    assert (totals["codegen"].requests, totals["codegen"].prompt_tokens, totals["codegen"].completion_tokens) == (
        2, 20, 12
    )  # fmt: skip
    assert (totals["minilm"].prompt_tokens, totals["minilm"].completion_tokens) == (9, 0)
    await a.close()
    await b.close()


async def test_report_flushes_first(redis_server):
    meter = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=60, clock=Clock())
    await meter.start()
    meter.record("acme", "iris")
    report = await meter.report(T0, T0 + WINDOW_S)
    assert [r.requests for r in report.windows] == [1]
    await meter.close()


async def test_usage_is_kept_through_a_redis_outage(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="aiworks.gateway.metering")
    meter = UsageMeter(redis_server.url, window_s=WINDOW_S, flush_interval_s=0.02, timeout_s=0.2, clock=Clock())
    await meter.start()
    meter.record("acme", "iris", rows=1)
    await asyncio.sleep(0.1)
    redis_server.kill()
    for _ in range(4):
        meter.record("acme", "iris", rows=2)
    await asyncio.sleep(0.2)
    report = await meter.report(T0, T0 + WINDOW_S)
    assert report.source == "local"  # this replica's own count while Redis is away
    assert [(r.requests, r.rows) for r in report.windows] == [(5, 9)]
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1

    redis_server.start()  # empty: the outage's usage must arrive from memory, the first flush's is lost with it
    await asyncio.sleep(0.2)
    assert len([r for r in caplog.records if "answers again" in r.getMessage()]) == 1
    report = await meter.report(T0, T0 + WINDOW_S)
    assert report.source == "redis"
    assert [(r.requests, r.rows) for r in report.windows] == [(4, 8)]
    await meter.close()


async def test_without_redis_the_meter_is_local():
    meter = UsageMeter(None, window_s=60, clock=Clock())
    await meter.start()
    meter.record("", "iris", rows=3)
    report = await meter.report(T0, T0 + 60)
    assert report.source == "local" and [(r.tenant, r.rows) for r in report.windows] == [("", 3)]
    assert (await meter.report(T0, T0 + 60, model="digits")).windows == []
    await meter.close()


def test_prometheus_counters():
    before = [
        sample(f"aiworks_tenant_{n}_total", "prom", "iris")
        for n in ("requests", "rows", "compute_seconds", "cache_hits")
    ]
    meter = UsageMeter(None)
    meter.record("prom", "iris", rows=4, compute_s=0.25, cache_hit=True)
    meter.record("prom", "iris", rows=1)
    after = [
        sample(f"aiworks_tenant_{n}_total", "prom", "iris")
        for n in ("requests", "rows", "compute_seconds", "cache_hits")
    ]
    assert [x - y for x, y in zip(after, before)] == [2, 5, 0.25, 1]


async def test_report_range_is_checked():
    meter = UsageMeter(None, window_s=1, clock=Clock())
    with pytest.raises(InvalidArgument, match="end .* must be after start"):
        await meter.report(T0, T0)
    with pytest.raises(InvalidArgument, match="at most 10000"):
        await meter.report(T0, T0 + 20_000)
