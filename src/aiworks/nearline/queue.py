"""Asynchronous requests on a Redis Stream: enqueue, take in order, store results for a TTL.

Keys (prefix ``aiworks:async:``):

- ``requests``: the stream (one entry per request: id, path, body, credential (the request's work token,
  sealed under the
  installation's credential key where the queue has one: :mod:`aiworks.security.sealing`), the deadline
  and the callback URL), read by the
  consumer group ``workers``; an entry is deleted once its result is stored;
- ``req:{id}``: hash, the request's record (tenant, status, result), expiring ``ttl_s`` after its
  last change;
- ``tenant:{tenant}``: sorted set of the tenant's queued request ids, scored by when they were queued:
  its backlog, which the gateway bounds per tenant. A request leaves it when its result is stored (ZREM:
  a request answered twice leaves once), and one older than ``ttl_s`` is dropped when the tenant queues
  again, so a worker that never removes (an older version, one that died) cannot wedge a tenant.

A worker that dies leaves its entries pending in the group; another takes
them over after ``claim_idle_s`` (XAUTOCLAIM), so a burst is absorbed and no
accepted request is lost while one worker lives.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import redis.asyncio as redis
from redis.exceptions import ResponseError

from aiworks.security.sealing import Sealer, seal, unseal

PREFIX = "aiworks:async:"
GROUP = "workers"


@dataclass
class Queued:
    """One stream entry, as a worker sees it."""

    entry: str
    id: str
    path: str
    body: bytes
    credential: str  # as stored: sealed, or in clear (AsyncQueue.credential opens it)
    created_at: float
    content_type: str = "application/json"
    header_length: str = ""
    deadline_at: float = 0.0  # Unix time after which it is not run (0: none, from a gateway without deadlines)
    callback: str = ""
    tenant: str = ""


class AsyncQueue:
    """The request stream and the records, over ``redis.asyncio`` (raw bytes)."""

    def __init__(self, client: redis.Redis, *, ttl_s: float = 3600.0, max_len: int = 100_000, prefix: str = PREFIX,
                 sealer: Sealer | None = None):  # fmt: skip
        self.redis = client
        self.sealer = sealer  # seals credentials as requests are queued, opens them for the worker
        self.ttl_s = ttl_s
        self.max_len = max_len
        self.prefix = prefix
        self.stream = prefix + "requests"

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 64, **kwargs) -> AsyncQueue:
        """A queue on a bounded pool: a burst of callers waits (up to 10 s) for a connection rather than failing.

        (redis-py's default pool raises MaxConnectionsError past 100 connections in use: a gateway under
        a burst of asynchronous submissions answered 500 with it; bench/tiers.py's nearline phase.)
        """
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=10,
                                                     socket_timeout=10, socket_connect_timeout=5)  # fmt: skip
        return cls(redis.Redis(connection_pool=pool), **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    def _record(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{tenant}"

    async def backlog(self) -> int:
        return int(await self.redis.xlen(self.stream))

    async def depth(self, tenant: str) -> tuple[int, int]:
        """``(requests queued, of them the tenant's)``, in one round trip; the tenant's stale ids dropped first."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(self.stream)
            pipe.zremrangebyscore(self._tenant(tenant), "-inf", time.time() - self.ttl_s)
            pipe.zcard(self._tenant(tenant))
            total, _, own = await pipe.execute()
        return int(total), int(own)

    async def enqueue(self, tenant: str, path: str, body: bytes, credential: str | None, *,
                      content_type: str = "application/json", header_length: str = "", deadline_s: float = 0.0,
                      callback: str = "") -> tuple[str, int]:  # fmt: skip
        """Queue one request: ``(request id, backlog after it)``; to be taken within ``deadline_s`` (0: no limit)."""
        request_id = "req_" + secrets.token_hex(12)
        now = time.time()
        deadline_at = now + deadline_s if deadline_s > 0 else 0.0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._record(request_id), mapping={"tenant": tenant, "status": "queued", "created_at": now})
            pipe.pexpire(self._record(request_id), int(self.ttl_s * 1000))
            stored = seal(self.sealer, credential, f"request {request_id}") or ""
            pipe.xadd(self.stream, {"id": request_id, "path": path, "body": body, "credential": stored,
                                    "created_at": now, "content_type": content_type,
                                    "header_length": header_length, "deadline_at": deadline_at,
                                    "callback": callback, "tenant": tenant})  # fmt: skip
            pipe.zadd(self._tenant(tenant), {request_id: now})
            pipe.pexpire(self._tenant(tenant), int(self.ttl_s * 1000))
            pipe.xlen(self.stream)
            *_, length = await pipe.execute()
        return request_id, int(length)

    def credential(self, item: Queued) -> str | None:
        """The caller's credential of ``item``, opened (:class:`~aiworks.security.sealing.SealError` when it
        cannot be)."""
        return unseal(self.sealer, item.credential, f"request {item.id}")

    async def get(self, request_id: str) -> dict | None:
        doc = await self.redis.hgetall(self._record(request_id))
        return {k.decode(): v for k, v in doc.items()} if doc else None

    async def note(self, request_id: str, **fields) -> None:
        """Add fields to a request's record (the callback's outcome), if it still exists."""
        record = self._record(request_id)
        if not await self.redis.exists(record):
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(record, mapping=fields)
            pipe.pexpire(record, int(self.ttl_s * 1000))
            await pipe.execute()

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def take(self, consumer: str, count: int, block_ms: int, claim_idle_s: float) -> list[Queued]:
        """Entries for ``consumer``: first any a dead worker left pending too long, then new ones, in order."""
        taken = []
        _, claimed, *_ = await self.redis.xautoclaim(
            self.stream, GROUP, consumer, min_idle_time=int(claim_idle_s * 1000), start_id="0-0", count=count
        )
        taken.extend(claimed)
        if len(taken) < count:
            reply = await self.redis.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=count - len(taken),
                                                block=block_ms if not taken else None)  # fmt: skip
            for _, entries in reply or []:
                taken.extend(entries)
        return [_queued(entry, fields) for entry, fields in taken if fields]

    async def complete(self, item: Queued, status: str, http_status: int, body: bytes, *,
                       content_type: str = "application/json", header_length: str = "") -> None:  # fmt: skip
        """Store the result (kept ``ttl_s``) and drop the entry from the stream."""
        record = self._record(item.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(record, mapping={"status": status, "http_status": http_status, "result": body,
                                       "completed_at": time.time(), "content_type": content_type,
                                       "header_length": header_length})  # fmt: skip
            pipe.pexpire(record, int(self.ttl_s * 1000))
            pipe.xack(self.stream, GROUP, item.entry)
            pipe.xdel(self.stream, item.entry)
            pipe.zrem(self._tenant(item.tenant), item.id)
            await pipe.execute()


def _queued(entry: bytes, fields: dict) -> Queued:
    return Queued(
        entry.decode(), fields[b"id"].decode(), fields[b"path"].decode(), fields[b"body"],
        fields[b"credential"].decode(), float(fields[b"created_at"]),
        fields.get(b"content_type", b"application/json").decode(), fields.get(b"header_length", b"").decode(),
        float(fields.get(b"deadline_at", b"0")), fields.get(b"callback", b"").decode(),
        fields.get(b"tenant", b"").decode(),
    )  # fmt: skip
