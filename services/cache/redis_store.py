"""Cache entries in a Redis server (redis-py's asyncio client, with hiredis parsing).

Keys of one model share a hash tag, so they live in one slot of a Redis
Cluster too::

    <prefix>{<model>}:epoch            the model's epoch (an integer, no TTL)
    <prefix>{<model>}:<epoch>:<key>    one entry (always with a TTL)

A lookup and a store are one Lua script each, which reads the epoch and the
entry under it together; the scripts of all lookups and stores waiting at the
same moment go to Redis as one pipeline, one round trip for the lot. Invalidation increments the epoch, which makes the
old entries unreachable at once, then deletes them with SCAN/UNLINK. Run Redis
with ``maxmemory`` and ``maxmemory-policy volatile-lru``: entries carry a TTL
and are evicted, the epoch keys carry none and are kept.

redis-py's own retries are off: the cache's logic bounds every call with a
timeout of a few milliseconds and bypasses Redis while it fails. Connections
come from a bounded, blocking pool: under a burst of lookups, commands wait
for one of ``max_connections`` warm connections instead of each opening its own.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from aiworks.cache.store import STALE_EPOCH, STORED, StoreError, StoreUsage
from aiworks.core.redis_client import fail_fast_redis

_GET = """
local epoch = redis.call('GET', KEYS[1]) or '0'
return {epoch, redis.call('GET', ARGV[1] .. epoch .. ':' .. ARGV[2])}
"""

_PUT = """
local epoch = redis.call('GET', KEYS[1]) or '0'
if epoch ~= ARGV[3] then return 0 end
local key = ARGV[1] .. epoch .. ':' .. ARGV[2]
if tonumber(ARGV[5]) > 0 then
  redis.call('SET', key, ARGV[4], 'PX', ARGV[5])
else
  redis.call('SET', key, ARGV[4])
end
return 1
"""

_GLOB_SPECIALS = str.maketrans({c: "\\" + c for c in "*?[]\\"})


class RedisStore:
    """The :class:`aiworks.cache.store.Store` interface over one Redis database."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "aiworks:cache:v1:",
        connect_timeout_s: float = 1.0,
        max_connections: int = 32,
    ):
        self.url = url
        self.prefix = prefix
        self._redis = fail_fast_redis(url, max_connections=max_connections, timeout_s=connect_timeout_s)
        self._pending: list[tuple[str, list, asyncio.Future]] = []
        self._flushes: set[asyncio.Task] = set()

    def _model_prefix(self, model: str) -> str:
        return f"{self.prefix}{{{model}}}:"

    async def get(self, model: str, key: bytes) -> tuple[int, bytes | None]:
        base = self._model_prefix(model)
        try:
            epoch, value = await self._script(_GET, [base + "epoch", base, key.hex()])
        except RedisError as exc:
            raise StoreError(f"redis: {exc}") from None
        return int(epoch), value

    async def put(self, model: str, key: bytes, value: bytes, epoch: int, ttl_s: float) -> str:
        base = self._model_prefix(model)
        ttl_ms = int(ttl_s * 1000) if ttl_s > 0 else 0
        try:
            stored = await self._script(_PUT, [base + "epoch", base, key.hex(), str(epoch), value, ttl_ms])
        except RedisError as exc:
            raise StoreError(f"redis: {exc}") from None
        return STORED if stored else STALE_EPOCH

    # ---- scripts, pipelined ------------------------------------------------------------------------

    def _script(self, script: str, keys_and_args: list) -> asyncio.Future:
        """Run ``script`` (first item a key, the rest arguments) in the next pipeline."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((script, keys_and_args, future))
        if len(self._pending) == 1:  # the first waiter schedules the flush; the rest ride along
            asyncio.get_running_loop().call_soon(self._flush)
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _run(self, batch: list[tuple[str, list, asyncio.Future]]) -> None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for script, (key, *args), _ in batch:
                    pipe.eval(script, 1, key, *args)  # EVAL, not EVALSHA: nothing to reload after a restart
                results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else RedisError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    # ---- administration ---------------------------------------------------------------------------

    async def invalidate(self, model: str) -> tuple[int, int]:
        base = self._model_prefix(model)
        try:
            epoch = int(await self._redis.incr(base + "epoch"))
            keep = f"{base}{epoch}:".encode()
            epoch_key = (base + "epoch").encode()
            removed = 0
            batch: list[bytes] = []
            async for k in self._redis.scan_iter(match=base.translate(_GLOB_SPECIALS) + "*", count=1000):
                if k == epoch_key or k.startswith(keep):
                    continue
                batch.append(k)
                if len(batch) >= 1000:
                    removed += await self._redis.unlink(*batch)
                    batch.clear()
            if batch:
                removed += await self._redis.unlink(*batch)
        except RedisError as exc:
            raise StoreError(f"redis: {exc}") from None
        return removed, epoch

    async def usage(self) -> StoreUsage:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.dbsize()
                pipe.info("memory")
                pipe.info("stats")
                entries, memory, stats = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis: {exc}") from None
        return StoreUsage(
            entries=int(entries),
            bytes=int(memory.get("used_memory", 0)),
            max_bytes=int(memory.get("maxmemory", 0)),
            evictions=int(stats.get("evicted_keys", 0)),
            expired=int(stats.get("expired_keys", 0)),
        )

    async def close(self) -> None:
        for task in list(self._flushes):
            task.cancel()
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
