"""The one way the suite opens Redis: a bounded pool that fails fast.

The result cache, the gateway's shared limits and its usage meter all treat
Redis as something that may be slow or gone: every call has a short timeout,
nothing is retried inside redis-py (the callers bypass, fall back or try
later themselves), and callers wait for a free connection no longer than the
timeout either.
"""

from __future__ import annotations

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def fail_fast_redis(url: str, *, max_connections: int, timeout_s: float, decode_responses: bool = False) -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=decode_responses,
    )
    return redis.Redis(connection_pool=pool)
