"""The Redis home of the traffic policies, against a private redis-server (never the system's, never 6379)."""

from __future__ import annotations

import asyncio

import pytest
from cache.support import RedisServer

from aiworks.core.errors import Unavailable
from aiworks.scheduler.traffic_state import ShadowPolicy, TrafficPolicy
from aiworks.scheduler.traffic_store import RedisTrafficStore

CANARY = TrafficPolicy("m", {"1": 90, "2": 10}, ShadowPolicy("2", 0.5, "argmax", 0.0))


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


async def test_two_redis_stores_agree_through_the_revision(redis_server):
    one = RedisTrafficStore(redis_server.url, poll_s=0.05)
    two = RedisTrafficStore(redis_server.url, poll_s=0.05)
    assert await two.load() == {}
    seen = []
    watch = asyncio.create_task(two.watch(seen.append))
    try:
        await one.save(CANARY)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.02)
        assert seen[-1] == {"m": CANARY}
        await one.save(TrafficPolicy("m"))
        for _ in range(100):
            if seen[-1] == {}:
                break
            await asyncio.sleep(0.02)
        assert seen[-1] == {}
        assert await RedisTrafficStore(redis_server.url).load() == {}
    finally:
        watch.cancel()
        await one.close()
        await two.close()


async def test_redis_away_start_empty_refuse_writes_then_catch_up(redis_server):
    url = redis_server.url
    redis_server.stop()
    store = RedisTrafficStore(url, poll_s=0.05, timeout_s=0.2)
    assert await store.load() == {}  # the control plane starts anyway
    with pytest.raises(Unavailable, match="cannot store the traffic policy in Redis"):
        await store.save(CANARY)
    seen = []
    watch = asyncio.create_task(store.watch(seen.append))
    try:
        redis_server.start()
        writer = RedisTrafficStore(url)
        await writer.save(CANARY)
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.02)
        assert seen[-1] == {"m": CANARY}
        await writer.close()
    finally:
        watch.cancel()
        await store.close()
