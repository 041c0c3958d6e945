"""Limits shared by gateway replicas through a real (private) Redis, and the local fallback when it dies.

Two ``TenantLimiter`` instances stand for two gateway replicas: each has its
own connection pool and state, and only Redis joins them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from aiworks.core.errors import AIWorksError, Status
from aiworks.gateway.limit_rules import LocalLimits
from aiworks.gateway.limits import TenantLimiter
from aiworks.gateway.tenancy import ComputeQuota, Tenant

# Generous for a shared 2-core machine: these tests are about behaviour, not the production 5 ms budget.
TIMEOUT_S = 0.25


def tenant(**limits) -> Tenant:
    return Tenant(id=limits.pop("id", "acme"), **limits)


async def replicas(url: str, count: int = 2, **options) -> list[TenantLimiter]:
    options.setdefault("timeout_s", TIMEOUT_S)
    limiters = [TenantLimiter(url, **options) for _ in range(count)]
    for limiter in limiters:
        await limiter.start()
    return limiters


async def close(*limiters: TenantLimiter) -> None:
    for limiter in limiters:
        await limiter.close()


async def refused(coro) -> AIWorksError:
    with pytest.raises(AIWorksError) as info:
        await coro
    assert info.value.status is Status.RESOURCE_EXHAUSTED and info.value.status.http == 429
    return info.value


# ---- rate ----------------------------------------------------------------------------------------------------


async def test_two_replicas_share_one_rate_limit(redis_server):
    a, b = await replicas(redis_server.url)
    acme = tenant(requests_per_second=0.5, burst=10)  # refills one token per 2 s: none during the burst
    admitted = {"a": 0, "b": 0}
    errors = []
    for i in range(30):
        name, limiter = ("a", a) if i % 2 == 0 else ("b", b)
        try:
            await limiter.release(await limiter.admit(acme))
            admitted[name] += 1
        except AIWorksError as exc:
            errors.append(exc)
    assert sum(admitted.values()) == 10, admitted  # one bucket of 10 for both replicas, not 10 each
    assert admitted["a"] > 0 and admitted["b"] > 0
    assert len(errors) == 20
    err = errors[0]
    assert err.status is Status.RESOURCE_EXHAUSTED
    assert "tenant 'acme' exceeded its rate limit of 0.5 requests/s (burst 10)" in err.message
    assert 0 < err.retry_after_s <= 2.0
    assert not a.fallback and not b.fallback
    # Another tenant has its own bucket.
    await a.release(await a.admit(tenant(id="other", requests_per_second=0.5, burst=1)))
    await close(a, b)


async def test_the_retry_after_hint_is_honest(redis_server):
    (a,) = await replicas(redis_server.url, 1)
    acme = tenant(requests_per_second=1, burst=1)
    await a.release(await a.admit(acme))
    err = await refused(a.admit(acme))
    assert 0.5 < err.retry_after_s <= 1.0
    await asyncio.sleep(err.retry_after_s + 0.02)
    await a.release(await a.admit(acme))
    await close(a)


# ---- concurrency ----------------------------------------------------------------------------------------------


async def test_two_replicas_share_one_concurrency_limit(redis_server):
    a, b = await replicas(redis_server.url)
    acme = tenant(max_concurrent_requests=3)
    held = [await a.admit(acme), await b.admit(acme), await a.admit(acme)]
    err = await refused(b.admit(acme))
    assert err.message == "tenant 'acme' has 3 requests in flight, its limit of 3 concurrent requests"
    await refused(a.admit(acme))
    await a.release(held[0])
    held[0] = await b.admit(acme)  # a slot freed on one replica is usable on the other
    for admission, limiter in zip(held, (b, b, a)):
        await limiter.release(admission)
    await a.release(held[2])  # releasing twice is harmless
    async with b.hold(acme):
        async with a.hold(acme):
            pass
    await close(a, b)


async def test_a_crashed_replicas_slots_expire(redis_server):
    a, b = await replicas(redis_server.url, lease_ttl_s=0.6)
    acme = tenant(max_concurrent_requests=2)
    await a.admit(acme)
    await a.admit(acme)
    await close(a)  # "crashes": never releases, stops renewing
    await refused(b.admit(acme))
    await asyncio.sleep(0.7)
    await b.release(await b.admit(acme))
    await close(b)


async def test_live_leases_are_renewed_past_their_ttl(redis_server):
    a, b = await replicas(redis_server.url, lease_ttl_s=0.6)
    acme = tenant(max_concurrent_requests=1)
    slot = await a.admit(acme)
    await asyncio.sleep(1.5)  # two and a half TTLs: a's renewals keep the slot taken
    await refused(b.admit(acme))
    await a.release(slot)
    await b.release(await b.admit(acme))
    await close(a, b)


async def test_release_soon_frees_the_slot_within_a_round_trip(redis_server):
    """What the gateway calls: the answer leaves at once, the Redis release follows in the background."""
    a, b = await replicas(redis_server.url)
    acme = tenant(max_concurrent_requests=1, compute_quota=ComputeQuota(seconds=100.0, window_s=86400))
    slot = await a.admit(acme)
    a.release_soon(slot, 0.25)
    a.release_soon(slot, 0.25)  # once only, like release()
    deadline = time.monotonic() + 2
    while True:
        try:
            again = await b.admit(acme)
            break
        except AIWorksError:
            assert time.monotonic() < deadline, "the slot was never released"
            await asyncio.sleep(0.005)
    store = redis.Redis.from_url(redis_server.url)
    assert float(store.hget("aiworks:limits:v1:{acme}:quota", "used")) == pytest.approx(0.25)
    b.release_soon(again, 0.25)
    await close(a, b)  # waits for the release on its way
    assert float(store.hget("aiworks:limits:v1:{acme}:quota", "used")) == pytest.approx(0.5)


async def test_a_rate_limit_alone_needs_no_release_call(redis_server):
    (a,) = await replicas(redis_server.url, 1)
    acme = tenant(requests_per_second=100.0)
    slot = await a.admit(acme)
    assert slot.backend == "redis"
    redis_server.kill()
    await a.release(slot, compute_s=1.0)  # nothing to give back: Redis is not asked, so its death goes unnoticed
    assert not a.fallback
    await close(a)


# ---- the pipelined connection -----------------------------------------------------------------------------------


async def test_scripts_flushed_from_redis_are_loaded_again(redis_server):
    (a,) = await replicas(redis_server.url, 1)
    acme = tenant(requests_per_second=100.0, max_concurrent_requests=5)
    await a.release(await a.admit(acme))
    redis.Redis.from_url(redis_server.url).script_flush()  # as a restarted Redis forgets them
    slot = await a.admit(acme)
    assert slot.backend == "redis" and not a.fallback
    await a.release(slot)
    await close(a)


async def test_the_pipelined_connection_authenticates_and_selects_its_database(redis_server):
    redis.Redis.from_url(redis_server.url).config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/3"
    (a,) = await replicas(url, 1)
    slot = await a.admit(tenant(max_concurrent_requests=5))
    assert slot.backend == "redis" and not a.fallback
    assert redis.Redis.from_url(url).zcard("aiworks:limits:v1:{acme}:leases") == 1
    await a.release(slot)
    await close(a)
    (wrong,) = await replicas(f"redis://:wrong@127.0.0.1:{redis_server.port}/3", 1)
    assert (await wrong.admit(tenant(max_concurrent_requests=5))).backend == "local" and wrong.fallback
    await close(wrong)


async def test_concurrent_calls_share_the_connection_and_get_their_own_answers(redis_server):
    a, b = await replicas(redis_server.url)
    tenants = [tenant(id=f"t{i}", max_concurrent_requests=i + 1) for i in range(6)]
    held = await asyncio.gather(*(a.admit(t) for t in tenants for _ in range(t.max_concurrent_requests)))
    for t in tenants:  # each tenant's slots are exactly full: the replies were not mixed up
        await refused(b.admit(t))
    await asyncio.gather(*(a.release(slot) for slot in held))
    await close(a, b)


# ---- compute quota ----------------------------------------------------------------------------------------------


async def wait_for_fresh_window(window_s: float) -> None:
    """Sleep to just after the next window boundary, so a test's charges fall in one window."""
    await asyncio.sleep(window_s - time.time() % window_s + 0.02)


async def test_compute_quota_exhausts_and_resets_with_the_window(redis_server):
    a, b = await replicas(redis_server.url)
    acme = tenant(compute_quota=ComputeQuota(seconds=1.0, window_s=2))
    await wait_for_fresh_window(2)
    async with a.hold(acme) as slot:
        slot.compute_s = 0.6
    await b.release(await b.admit(acme), compute_s=0.5)  # 1.1 s used, across both replicas
    err = await refused(a.admit(acme))
    assert err.message.startswith(
        "tenant 'acme' used its compute quota of 1 runtime-seconds per 2 s window (1.100 s used); it resets in"
    )
    assert 0 < err.retry_after_s <= 2
    await refused(b.admit(acme))
    await asyncio.sleep(err.retry_after_s + 0.05)
    await a.release(await a.admit(acme), compute_s=0.1)  # a new window
    await close(a, b)


# ---- fallback ----------------------------------------------------------------------------------------------------


async def test_fallback_when_redis_dies_and_recovery_when_it_returns(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="aiworks.gateway.limits")
    (a,) = await replicas(redis_server.url, 1, expected_replicas=2, retry_after_s=0.3)
    acme = tenant(requests_per_second=0.5, burst=10, compute_quota=ComputeQuota(seconds=1000, window_s=3600))
    first = await a.admit(acme)
    assert first.backend == "redis"
    await a.release(first, compute_s=1.0)

    redis_server.kill()
    started = time.perf_counter()
    admitted = []
    for _ in range(8):
        try:
            admitted.append(await a.admit(acme))
        except AIWorksError as exc:
            err = exc
    assert time.perf_counter() - started < 1.0  # fails fast, never waits on the dead server
    assert a.fallback
    assert [x.backend for x in admitted] == ["local"] * 5  # this replica's share: a bucket of 10 / 2
    assert err.status is Status.RESOURCE_EXHAUSTED and "1/2 share while Redis is unreachable" in err.message
    for admission in admitted:
        await a.release(admission, compute_s=2.0)  # charged while Redis is away: sent on recovery
    entering = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(entering) == 1  # logged once, not per request

    redis_server.start()  # same port, empty: a restarted Redis
    await asyncio.sleep(0.35)
    back = await a.admit(acme)
    assert back.backend == "redis" and not a.fallback
    await a.release(back, compute_s=0.5)
    assert len([r for r in caplog.records if "answers again" in r.getMessage()]) == 1
    for _ in range(50):
        used = redis.Redis.from_url(redis_server.url).hget("aiworks:limits:v1:{acme}:quota", "used")
        if used is not None and float(used) == pytest.approx(10.5):
            break
        await asyncio.sleep(0.02)
    assert float(used) == pytest.approx(10.5)  # 5 x 2.0 from the outage + 0.5 after it
    await close(a)


async def test_a_hung_redis_costs_at_most_the_timeout(redis_server):
    (a,) = await replicas(redis_server.url, 1, timeout_s=0.2, retry_after_s=5)
    acme = tenant(requests_per_second=100)
    await a.release(await a.admit(acme))
    redis_server.process.send_signal(19)  # SIGSTOP: the connection stays open, answers stop
    try:
        started = time.perf_counter()
        admission = await a.admit(acme)
        assert time.perf_counter() - started < 0.5
        assert admission.backend == "local" and a.fallback
        started = time.perf_counter()
        assert (await a.admit(acme)).backend == "local"  # the breaker is open: no wait at all
        assert time.perf_counter() - started < 0.05
    finally:
        redis_server.process.send_signal(18)  # SIGCONT
    await close(a)


async def test_unlimited_tenants_never_touch_redis(redis_server):
    (a,) = await replicas(redis_server.url, 1)
    redis_server.kill()
    admission = await a.admit(tenant())
    assert admission.backend == "none" and not a.fallback
    await a.release(admission, compute_s=3.0)
    await close(a)


# ---- without Redis ---------------------------------------------------------------------------------------------


async def test_without_redis_the_limits_are_this_processs():
    limiter = TenantLimiter(None)
    await limiter.start()
    acme = tenant(requests_per_second=0.5, burst=2, max_concurrent_requests=1)
    slot = await limiter.admit(acme)
    assert slot.backend == "local"
    err = await refused(limiter.admit(acme))
    assert "concurrent" in err.message and "share" not in err.message
    await limiter.release(slot)
    await limiter.release(await limiter.admit(acme))
    err = await refused(limiter.admit(acme))
    assert "rate limit" in err.message
    await limiter.close()


def test_local_limits_divide_by_the_replica_count():
    now = [1000.0]
    wall = [7200.0]
    local = LocalLimits(3, clock=lambda: now[0], wall_clock=lambda: wall[0])
    acme = tenant(
        requests_per_second=30, burst=30, max_concurrent_requests=4, compute_quota=ComputeQuota(seconds=9, window_s=60)
    )
    held = [local.admit(acme), local.admit(acme)]  # ceil(4 / 3) = 2 slots
    with pytest.raises(AIWorksError, match="2 requests in flight"):
        local.admit(acme)
    for admission in held:
        local.release(admission, 1.5)  # 3 s = the 9 / 3 share of the quota
    with pytest.raises(AIWorksError, match="compute quota of 9 runtime-seconds per 60 s window") as info:
        local.admit(acme)
    assert info.value.retry_after_s == pytest.approx(60)
    wall[0] += 60  # next window
    for _ in range(8):  # 10 tokens in total (30 / 3), 2 spent above
        local.release(local.admit(acme), 0)
    with pytest.raises(AIWorksError, match="rate limit"):
        local.admit(acme)
    now[0] += 0.1  # 10 tokens/s for this replica: one more
    local.release(local.admit(acme), 0)
