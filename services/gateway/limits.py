"""Per-tenant limits that hold across all gateway replicas: rate, concurrency, compute quota, tokens per minute.

Counters live in Redis so that N gateway replicas enforce one limit, not N.
Each tenant has four keys, sharing a hash tag so a Redis Cluster keeps them
in one slot::

    <prefix>{<tenant>}:bucket   token bucket: tokens, last refill (ms)
    <prefix>{<tenant>}:leases   sorted set: one member per request in flight, scored by lease expiry (ms)
    <prefix>{<tenant>}:quota    compute quota: current window number, runtime-seconds used in it
    <prefix>{<tenant>}:tokens   tokens-per-minute bucket: tokens left (may be below 0), last refill (ms)

Admission is one Lua script (one round trip): it checks the quota, drops
expired leases and counts the live ones, refills and takes a token, and adds
the request's lease, atomically, with Redis' own clock (``TIME``) so replicas
with skewed clocks still agree. Release is a second script: it removes the
lease and charges the request's compute time to the current quota window;
it is skipped when there is nothing to give back (a rate limit alone), and
the gateway sends it without waiting (:meth:`TenantLimiter.release_soon`), so
a request's latency carries one round trip. Both scripts travel on one
pipelined connection per replica (:class:`RedisPipe`), not redis-py's pool: the
pool's bookkeeping cost more CPU than the round trip itself. They are loaded
into Redis at start, so that calls keep their order on the pipe (a script
Redis does not know is sent again, behind the calls made meanwhile).

- **Rate**: a token bucket of ``burst`` tokens refilled at
  ``requests_per_second``; an empty bucket answers 429 with the time until
  the next token as the retry-after hint.
- **Concurrency**: a lease per request, expiring after ``lease_ttl_s``. While
  a request runs, this replica renews its leases every ``lease_ttl_s / 3``;
  a crashed replica stops renewing and its slots free themselves.
- **Compute quota**: runtime-seconds per window, windows aligned to
  multiples of ``window_s`` since the epoch. A request is admitted while the
  window's total is under the quota and charged when it ends, so the last
  request of a window may overshoot it; the next one gets 429 until the
  window ends.
- **Tokens per minute** (generation, ``max_tokens_per_minute``): a bucket of
  that many tokens, refilled continuously at a sixtieth of it per second.
  Admission reserves the generation's estimated prompt plus its
  ``max_tokens`` (see :func:`aiworks.gateway.token_budget.token_reserve`) and
  refuses it (429, with the time until that many tokens are back) when fewer
  are left; a reserve larger than the whole bucket waits for a full bucket.
  When the generation ends, its release settles the reserve to the tokens
  the model counted (prompt plus completion): the difference goes back, or
  is taken, leaving the bucket in debt that later requests wait out. A text
  model that counts its input's tokens (``token_count``: embeddings) draws on
  the same bucket: an estimate of its text at admission, settled to its count.

  The 429 names what the request reserved (``RESERVES``: a generation's prompt
  and ``max_tokens``, or a text's estimate).

**Fallback.** Every Redis call is bounded by ``timeout_s`` (a few ms). When
one fails, a circuit breaker switches this replica to in-process counters
with each limit divided by ``expected_replicas`` (so the replicas together
still admit about the configured total), logged once; after
``retry_after_s`` one request probes Redis again, and its success switches
back, logged once. Compute charged while Redis was away is kept and added to
Redis on return. Leases taken in Redis before an outage expire by their TTL.
A call that times out after Redis ran the script leaves a token spent and a
lease that expires by its TTL: the error is on the safe side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict
from collections.abc import AsyncIterator

import redis.asyncio as redis
from redis.exceptions import NoScriptError, RedisError

from aiworks.core.breaker import CircuitBreaker
from aiworks.core.logging import redact_url
from aiworks.core.redis_client import fail_fast_redis
from aiworks.gateway.limit_rules import (
    CONCURRENCY_RETRY_AFTER_S,
    Admission,
    LocalLimits,
    concurrency_message,
    quota_message,
    rate_message,
    resource_exhausted,
    tokens_message,
)
from aiworks.gateway.redis_pipe import RedisPipe
from aiworks.gateway.tenancy import Tenant

log = logging.getLogger(__name__)


_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A token bucket's (tokens, ts) refilled to now: full and new when absent. Holds the rate and tokens-per-minute
# buckets alike (cap tokens, per_ms tokens a millisecond).
_REFILL = """
local function refill(key, cap, per_ms)
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  local left, ts = tonumber(b[1]), tonumber(b[2])
  if left == nil or ts == nil then
    return cap, now
  end
  if now > ts then
    left, ts = math.min(cap, left + (now - ts) * per_ms), now
  end
  return left, ts
end
"""

# KEYS: bucket, leases, quota, tokens. ARGV: rate, burst, max_concurrent, lease, lease_ttl_ms, quota_s, window_ms,
# tokens_per_minute, reserve. Checks first, effects after, so a refused request consumes nothing.
_ADMIT = (
    _NOW_MS
    + _REFILL
    + """
local rate, burst, max_conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease_ttl, quota, window_ms = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local rate_left, rate_ts, gen_left, gen_ts
if quota > 0 then
  local window = math.floor(now / window_ms)
  local q = redis.call('HMGET', KEYS[3], 'window', 'used')
  if tonumber(q[1]) == window then
    local used = tonumber(q[2]) or 0
    if used >= quota then
      return {'quota', (window + 1) * window_ms - now, tostring(used)}
    end
  end
end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local active = redis.call('ZCARD', KEYS[2])
  if active >= max_conc then
    return {'concurrency', 0, tostring(active)}
  end
end
if rate > 0 then
  local tokens, ts = refill(KEYS[1], burst, rate / 1000)
  if tokens < 1 then
    return {'rate', math.ceil((1 - tokens) * 1000 / rate), ''}
  end
  rate_left, rate_ts = tokens - 1, ts
end
local tpm, reserve = tonumber(ARGV[8]), tonumber(ARGV[9])
if tpm > 0 and reserve > 0 then
  local left, gts = refill(KEYS[4], tpm, tpm / 60000)
  local need = math.min(reserve, tpm)
  if left < need then
    return {'tokens', math.ceil((need - left) * 60000 / tpm), tostring(math.floor(left))}
  end
  gen_left, gen_ts = left - reserve, gts
end
if rate_left ~= nil then
  redis.call('HSET', KEYS[1], 'tokens', tostring(rate_left), 'ts', tostring(rate_ts))
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
end
if gen_left ~= nil then
  redis.call('HSET', KEYS[4], 'tokens', tostring(gen_left), 'ts', tostring(gen_ts))
  redis.call('PEXPIRE', KEYS[4], math.ceil((tpm - gen_left) * 60000 / tpm) + 1000)
end
if max_conc > 0 then
  redis.call('ZADD', KEYS[2], now + lease_ttl, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], lease_ttl * 2)
end
return {'ok', 0, ''}
"""
)

# KEYS: leases, quota, tokens. ARGV: lease ('' for none), seconds, quota_s, window_ms, tokens_per_minute, refund
# (tokens given back to the bucket: the reserve less the tokens used; below 0 takes more).
_RELEASE = (
    _NOW_MS
    + _REFILL
    + """
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
local seconds, quota, window_ms = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if seconds > 0 and quota > 0 then
  local window = math.floor(now / window_ms)
  if tonumber(redis.call('HGET', KEYS[2], 'window')) ~= window then
    redis.call('HSET', KEYS[2], 'window', tostring(window), 'used', tostring(seconds))
  else
    redis.call('HINCRBYFLOAT', KEYS[2], 'used', tostring(seconds))
  end
  redis.call('PEXPIRE', KEYS[2], window_ms * 2)
end
local tpm, refund = tonumber(ARGV[5]), tonumber(ARGV[6])
if tpm > 0 and refund ~= 0 then
  local left, gts = refill(KEYS[3], tpm, tpm / 60000)
  left = math.min(tpm, left + refund)
  redis.call('HSET', KEYS[3], 'tokens', tostring(left), 'ts', tostring(gts))
  redis.call('PEXPIRE', KEYS[3], math.ceil((tpm - left) * 60000 / tpm) + 1000)
end
return 1
"""
)

# KEYS: leases. ARGV: lease_ttl_ms, lease... Extends leases still held (XX: never revives an expired one).
_RENEW = (
    _NOW_MS
    + """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return 1
"""
)


class TenantLimiter:
    """Admits or refuses requests by their tenant's limits; Redis-backed when ``redis_url`` is set.

    Call :meth:`start` once (it warms the connection and starts lease
    renewal) and :meth:`close` at shutdown. Without ``redis_url`` the limits
    are this process's alone (the embedded, single-gateway default).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        timeout_s: float = 0.005,
        connect_timeout_s: float = 0.5,
        expected_replicas: int = 1,
        lease_ttl_s: float = 30.0,
        retry_after_s: float = 1.0,
        prefix: str = "aiworks:limits:v1:",
        max_connections: int = 32,
    ):
        self.redis_url = redis_url
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.prefix = prefix
        self.local = LocalLimits(expected_replicas if redis_url else 1)
        self._breaker = CircuitBreaker(failure_threshold=1, retry_after_s=retry_after_s)
        self._fallback = False
        self._held: dict[str, Admission] = {}
        self._unsent_s: dict[str, float] = defaultdict(float)  # compute charged while Redis was away
        self._tenants: dict[str, Tenant] = {}
        self._tasks: set[asyncio.Task] = set()
        self._releasing: set[asyncio.Task] = set()
        self._renewer: asyncio.Task | None = None
        self._redis: redis.Redis | None = None
        self._pipe: RedisPipe | None = None
        if redis_url:
            self._redis = fail_fast_redis(redis_url, max_connections=max_connections, timeout_s=connect_timeout_s)
            options = RedisPipe.options(redis_url)
            self._pipe = RedisPipe(options, connect_timeout_s) if options is not None else None
            self._admit = self._redis.register_script(_ADMIT)
            self._release = self._redis.register_script(_RELEASE)
            self._renew = self._redis.register_script(_RENEW)

    @property
    def fallback(self) -> bool:
        """Whether limits are enforced locally now because Redis is unreachable."""
        return self._fallback

    async def start(self) -> None:
        if self._redis is None:
            return
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self._redis.ping()
                if self._pipe is not None:
                    await self._pipe.call("PING")
                    # Loaded now, so that a script's first EVALSHA does not come back NOSCRIPT and go again
                    # behind calls sent after it (a release overtaken by the next admission).
                    for script in (self._admit, self._release, self._renew):
                        await self._pipe.call("SCRIPT", "LOAD", script.script)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def close(self) -> None:
        if self._releasing:  # let releases already on their way reach Redis (a lease left behind expires anyway)
            await asyncio.wait(list(self._releasing), timeout=max(1.0, self.timeout_s))
        tasks = [t for t in (self._renewer, *self._tasks, *self._releasing) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pipe is not None:
            await self._pipe.close()
        if self._redis is not None:
            await self._redis.aclose()
            await self._redis.connection_pool.disconnect()

    def _keys(self, tenant_id: str) -> tuple[str, str, str, str]:
        base = f"{self.prefix}{{{tenant_id}}}:"
        return base + "bucket", base + "leases", base + "quota", base + "tokens"

    # ---- state of the Redis connection --------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        self._breaker.failure()
        if not self._fallback:
            self._fallback = True
            log.warning(
                "limits: Redis at %s unreachable (%s); enforcing 1/%d of each limit in this replica until it answers",
                redact_url(self.redis_url), exc or type(exc).__name__, self.local.share,
            )  # fmt: skip

    def _succeeded(self) -> None:
        self._breaker.success()
        if self._fallback:
            self._fallback = False
            log.warning(
                "limits: Redis at %s answers again; limits are shared across replicas", redact_url(self.redis_url)
            )
            if self._unsent_s:
                self._spawn(self._send_unsent())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, script, keys: list[str], args: list) -> object:
        async with asyncio.timeout(self.timeout_s):
            if self._pipe is None:
                return await script(keys=keys, args=args)
            try:
                return await self._pipe.call("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:  # Redis restarted and forgot its scripts: EVAL loads it again
                return await self._pipe.call("EVAL", script.script, len(keys), *keys, *args)

    # ---- admission ---------------------------------------------------------------------------------

    async def admit(self, tenant: Tenant, reserve: int = 0, kind: str = "generation") -> Admission:
        """Let one request of ``tenant`` in, or raise RESOURCE_EXHAUSTED (429) naming the limit.

        ``reserve``: the tokens the request takes from its tenant's tokens-per-minute bucket now (0: none);
        ``kind`` (a key of :data:`RESERVES`) says what they are for in the 429's message.
        """
        reserve = max(0, int(reserve)) if tenant.max_tokens_per_minute else 0
        if not tenant.limited or (not reserve and not tenant.limits_requests):
            return Admission(tenant, "none")  # nothing to check: no round trip
        if self._redis is None or not self._breaker.allow():
            return self.local.admit(tenant, reserve, kind)
        self._tenants[tenant.id] = tenant
        lease = os.urandom(9).hex() if tenant.max_concurrent_requests else ""
        quota = tenant.compute_quota
        bucket, leases, quota_key, tokens_key = self._keys(tenant.id)
        args = [
            repr(float(tenant.requests_per_second or 0)),
            tenant.bucket_size,
            tenant.max_concurrent_requests or 0,
            lease,
            int(self.lease_ttl_s * 1000),
            repr(float(quota.seconds)) if quota else "0",
            int(quota.window_s * 1000) if quota else 1,
            tenant.max_tokens_per_minute or 0,
            reserve,
        ]
        try:
            verdict, retry_ms, detail = await self._call(self._admit, [bucket, leases, quota_key, tokens_key], args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            return self.local.admit(tenant, reserve, kind)
        self._succeeded()
        if verdict == b"ok":
            admission = Admission(tenant, "redis", lease, reserved_tokens=reserve)
            if lease:
                self._held[lease] = admission
            return admission
        if verdict == b"rate":
            retry = int(retry_ms) / 1000
            raise resource_exhausted(rate_message(tenant, retry, ""), retry)
        if verdict == b"concurrency":
            raise resource_exhausted(concurrency_message(tenant, int(detail), ""), CONCURRENCY_RETRY_AFTER_S)
        if verdict == b"tokens":
            retry = int(retry_ms) / 1000
            raise resource_exhausted(tokens_message(tenant, reserve, float(detail), retry, "", kind), retry)
        reset = int(retry_ms) / 1000
        raise resource_exhausted(quota_message(tenant, float(detail), reset, ""), reset)

    async def release(self, admission: Admission, compute_s: float | None = None) -> None:
        """End an admitted request: free its slot and charge ``compute_s`` runtime-seconds to its quota."""
        if admission.released:
            return
        admission.released = True
        seconds = max(0.0, admission.compute_s if compute_s is None else compute_s)
        tenant = admission.tenant
        if admission.backend == "none":
            return
        if admission.backend == "local":
            self.local.release(admission, seconds)
            self._send_later(tenant, seconds)
            return
        self._held.pop(admission.lease, None)
        refund = admission.token_refund
        if not admission.lease and (tenant.compute_quota is None or seconds <= 0) and not refund:
            return  # a rate limit alone: nothing to give back
        if self._breaker.is_open:  # Redis is away: the lease expires by its TTL, the charge waits
            self.local.charge(tenant, seconds)
            self.local.settle_tokens(tenant, refund)  # Redis' bucket keeps the reserve: the safe side
            self._send_later(tenant, seconds)
            return
        try:
            args = self._release_args(tenant, admission.lease, seconds, refund)
            await self._call(self._release, self._release_keys(tenant), args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            self.local.charge(tenant, seconds)
            self.local.settle_tokens(tenant, refund)
            self._send_later(tenant, seconds)
            return
        self._succeeded()

    def release_soon(self, admission: Admission, compute_s: float | None = None) -> None:
        """:meth:`release` without waiting for Redis: the caller answers now, the slot frees one round trip later.

        Keeps the Redis round trip of a release off the request's latency. In
        this process the slot and the charge are given back at once; in Redis
        within a round trip, before a client could have read the answer and
        sent its next request on most networks.
        """
        if admission.released:
            return
        if admission.backend != "redis":
            admission.released = True
            seconds = max(0.0, admission.compute_s if compute_s is None else compute_s)
            if admission.backend == "local":
                self.local.release(admission, seconds)
                self._send_later(admission.tenant, seconds)
            return
        task = asyncio.get_running_loop().create_task(self.release(admission, compute_s))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _send_later(self, tenant: Tenant, seconds: float) -> None:
        """Keep compute charged away from Redis, to add to the shared quota when Redis answers again."""
        if self._redis is not None and tenant.compute_quota is not None and seconds > 0:
            self._unsent_s[tenant.id] += seconds
            self._tenants[tenant.id] = tenant

    @contextlib.asynccontextmanager
    async def hold(self, tenant: Tenant) -> AsyncIterator[Admission]:
        """``async with limiter.hold(tenant) as slot: ...; slot.compute_s = seconds`` admits and releases."""
        admission = await self.admit(tenant)
        try:
            yield admission
        finally:
            await self.release(admission)

    def _release_keys(self, tenant: Tenant) -> list[str]:
        _, leases, quota, tokens = self._keys(tenant.id)
        return [leases, quota, tokens]

    @staticmethod
    def _release_args(tenant: Tenant, lease: str, seconds: float, refund: int = 0) -> list:
        quota = tenant.compute_quota
        return [
            lease,
            repr(float(seconds)),
            repr(float(quota.seconds)) if quota else "0",
            int(quota.window_s * 1000) if quota else 1,
            tenant.max_tokens_per_minute or 0,
            int(refund),
        ]

    async def _send_unsent(self) -> None:
        """Add the compute charged during an outage to the shared quotas."""
        unsent, self._unsent_s = self._unsent_s, defaultdict(float)
        pending = list(unsent.items())
        while pending:
            tenant_id, seconds = pending[0]
            tenant = self._tenants[tenant_id]
            try:
                await self._call(self._release, self._release_keys(tenant), self._release_args(tenant, "", seconds))
            except (RedisError, OSError, TimeoutError) as exc:
                for tenant_id, seconds in pending:  # all that is not sent yet waits for the next return
                    self._unsent_s[tenant_id] += seconds
                self._failed(exc)
                return
            pending.pop(0)

    # ---- lease renewal -----------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        interval = max(0.05, self.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            if not self._held or self._breaker.is_open:
                continue
            by_tenant: dict[str, list[str]] = defaultdict(list)
            for lease, admission in list(self._held.items()):
                by_tenant[admission.tenant.id].append(lease)
            try:
                async with asyncio.timeout(max(self.timeout_s, 0.05)):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for tenant_id, held in by_tenant.items():
                            await self._renew(
                                keys=[self._keys(tenant_id)[1]], args=[int(self.lease_ttl_s * 1000), *held], client=pipe
                            )
                        await pipe.execute()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("limits: lease renewal failed: %s", exc)
