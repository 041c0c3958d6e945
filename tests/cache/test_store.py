"""The two stores and the cache's logic: bounds, TTL, epochs, and a Redis that dies or hangs."""

from __future__ import annotations

import asyncio
import os
import time
import tracemalloc

import pytest

from aiworks.cache.dataplane import CacheDataPlane
from aiworks.cache.redis_store import RedisStore
from aiworks.cache.store import STALE_EPOCH, STORED, TOO_LARGE, MemoryStore


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the in-process store --------------------------------------------------------------------


async def test_memory_store_stays_within_its_byte_bound_evicting_the_least_recently_used():
    store = MemoryStore(64 * 1024)
    await store.put("m", b"first", b"x" * 1000, 0, 0)
    for i in range(500):
        assert await store.put("m", f"k{i}".encode(), os.urandom(100 + i % 900), 0, 0) == STORED
        assert store.bytes <= store.max_bytes
        await store.get("m", b"first")  # keep it recently used
    usage = await store.usage()
    assert usage.evictions > 0 and usage.bytes <= 64 * 1024
    assert (await store.get("m", b"first"))[1] is not None
    assert (await store.get("m", b"k0"))[1] is None  # the oldest untouched entries went first
    assert await store.put("m", b"huge", b"x" * 65 * 1024, 0, 0) == TOO_LARGE


async def test_memory_store_accounting_covers_the_memory_it_really_takes():
    store = MemoryStore(1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3000):
            # Fresh bytes objects, as values arriving in protobuf messages are.
            await store.put("model", os.urandom(20), os.urandom(10 + i % 300), 0, 60)
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert taken <= store.bytes, f"{taken} bytes taken, {store.bytes} accounted"


async def test_memory_store_ttl_and_epochs():
    clock = FakeClock()
    store = MemoryStore(1 << 20, clock=clock)
    assert await store.put("m", b"k", b"v", 0, ttl_s=10) == STORED
    assert await store.get("m", b"k") == (0, b"v")
    clock.now += 10.5
    assert await store.get("m", b"k") == (0, None)
    assert (await store.usage()).expired == 1
    await store.put("m", b"k", b"v", 0, 0)
    await store.put("other", b"k", b"w", 0, 0)
    assert await store.invalidate("m") == (1, 1)
    assert await store.get("m", b"k") == (1, None)
    assert await store.get("other", b"k") == (0, b"w")  # other models keep theirs
    assert await store.put("m", b"k", b"late", 0, 0) == STALE_EPOCH  # looked up before the invalidation
    assert await store.put("m", b"k", b"new", 1, 0) == STORED


# ---- the Redis store -------------------------------------------------------------------------


@pytest.fixture
async def redis_store(redis_server):
    store = RedisStore(redis_server.url, prefix=f"test:{time.monotonic_ns()}:")
    yield store
    await store.close()


async def test_redis_store_get_put_ttl_and_invalidation(redis_store):
    assert await redis_store.get("m", b"k") == (0, None)
    assert await redis_store.put("m", b"k", b"\x00value", 0, ttl_s=0.3) == STORED
    assert await redis_store.get("m", b"k") == (0, b"\x00value")
    await asyncio.sleep(0.45)
    assert await redis_store.get("m", b"k") == (0, None)  # expired in Redis
    for i in range(50):
        await redis_store.put("m.v-1", f"k{i}".encode(), b"v", 0, 60)
    await redis_store.put("other", b"k", b"w", 0, 60)
    removed, epoch = await redis_store.invalidate("m.v-1")
    assert (removed, epoch) == (50, 1)
    assert await redis_store.get("m.v-1", b"k1") == (1, None)
    assert await redis_store.put("m.v-1", b"k1", b"late", 0, 60) == STALE_EPOCH
    assert await redis_store.put("m.v-1", b"k1", b"new", 1, 60) == STORED
    assert await redis_store.get("other", b"k") == (0, b"w")
    usage = await redis_store.usage()
    assert usage.entries >= 2 and usage.max_bytes == 64 * 1024 * 1024


# ---- the cache's logic in front of a failing Redis --------------------------------------------


async def test_a_dead_redis_is_bypassed_counted_and_caching_resumes(make_redis):
    redis = make_redis()
    cache = CacheDataPlane(RedisStore(redis.url), store_timeout_s=0.2, retry_after_s=0.1, failure_threshold=3)
    try:
        await cache.put("m", b"k", b"v", 0)
        assert (await cache.get("m", b"k")).value == b"v"
        redis.kill()
        started = time.perf_counter()
        for _ in range(20):
            found = await cache.get("m", b"k")
            assert found.bypassed and not found.found
            assert (await cache.put("m", b"k2", b"v", 0)) == (False, "bypassed")
        assert time.perf_counter() - started < 2.0  # the breaker skips Redis instead of waiting on it
        assert cache.counters.store_errors >= 1 and cache.counters.bypassed == 40
        assert cache.counters.store_errors < 20  # not one failure per request: the breaker is open
        assert not (await cache.stats()).store_available
        # An invalidation during the outage is kept and replayed once Redis is back.
        with pytest.raises(Exception, match="pending"):
            await cache.invalidate("m")
        redis.start()
        deadline = time.monotonic() + 5
        while (await cache.get("m", b"k")).bypassed:
            assert time.monotonic() < deadline, "caching did not resume"
            await asyncio.sleep(0.05)
        assert not cache._pending_invalidations
        epoch = (await cache.get("m", b"k")).epoch
        assert (await cache.put("m", b"k", b"v2", epoch)) == (True, "")
        assert (await cache.get("m", b"k")).value == b"v2"
    finally:
        await cache.close()


async def test_a_hung_redis_costs_a_lookup_no_more_than_the_store_timeout(make_redis):
    redis = make_redis()
    cache = CacheDataPlane(RedisStore(redis.url), store_timeout_s=0.05, retry_after_s=0.3, failure_threshold=2)
    try:
        await cache.put("m", b"k", b"v", 0)
        redis.pause()
        started = time.perf_counter()
        first = await cache.get("m", b"k")
        first_s = time.perf_counter() - started
        assert first.bypassed and first_s < 0.5
        started = time.perf_counter()
        for _ in range(50):
            assert (await cache.get("m", b"k")).bypassed
        assert time.perf_counter() - started < 0.5  # the breaker answers at once while open
        redis.resume()
        deadline = time.monotonic() + 5
        while (await cache.get("m", b"k")).value != b"v":
            assert time.monotonic() < deadline, "caching did not resume"
            await asyncio.sleep(0.05)
    finally:
        redis.resume()
        await cache.close()
