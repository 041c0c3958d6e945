"""Asynchronous requests on Redis Streams, one a tenant: enqueue, take fairly and in order, store results.

Keys (prefix ``aiworks:async:``):

- ``requests:{tenant}``: the tenant's stream (one entry per request: id, path, body, credential (the request's
  work token, sealed under the installation's credential key where the queue has one:
  :mod:`aiworks.security.sealing`), the deadline and the callback URL), read by the consumer group ``workers``;
  an entry is deleted once its result is stored. Demo mode's anonymous tenant uses ``requests``, the one stream
  of versions before the streams were split by tenant, which workers still read;
- ``streams``: set of the tenant streams that hold entries (queued, or taken and not yet answered): workers
  read only these, so a read costs the tenants with work, not every tenant there is. A stream joins it with the
  request that finds it empty, which also rings ``doorbell`` (a stream of its own in the group), so a worker
  waiting on the others reads it at once; it leaves when its last entry is answered;
- ``queued``: sorted set of every queued request id, scored by when it was queued: the queue's backlog, which
  the gateway bounds;
- ``req:{id}``: hash, the request's record (tenant, status, result), expiring ``ttl_s`` after its
  last change;
- ``tenant:{tenant}``: sorted set of the tenant's queued request ids, scored by when they were queued:
  its backlog, which the gateway bounds per tenant. A request leaves it (and ``queued``) when its result is
  stored (ZREM: a request answered twice leaves once), and one older than ``ttl_s`` is dropped when the tenant
  queues again, so a worker that never removes (an older version, one that died) cannot wedge a tenant.

**Fair across tenants.** A worker reads every tenant's stream in one XREADGROUP, asking each for an equal share
of its free places, and starts what it took in turns, one tenant's request after another's. A tenant with
thousands queued therefore delays another's request by about one request, not by its whole backlog; within a
tenant, requests are taken in the order they were queued.

A worker that dies leaves its entries pending in the group; another takes
them over after ``claim_idle_s`` (XAUTOCLAIM, swept every ``claim_idle_s`` / 2,
at most 5 s apart), so a burst is absorbed and no accepted request is lost
while one worker lives.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as redis
from redis.exceptions import ResponseError

from aiworks.security.sealing import Sealer, seal, unseal

PREFIX = "aiworks:async:"
GROUP = "workers"
_REGISTRY_S = 1.0  # how long a worker uses its list of tenant streams before reading it again (the doorbell aside)
# After a result is stored: the stream leaves the set of streams with entries once its last entry is gone. One
# script, in the same transaction as the XDEL, so a request queued meanwhile (XADD and SADD in one transaction)
# either keeps the stream in or adds it back, ringing the doorbell.
_LEAVE_IF_EMPTY = "if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], KEYS[1]) end return 0"
# With a request queued: a tenant stream not in the set joins it and rings the doorbell, in the request's own
# transaction (no round trip of its own). KEYS: the set, the doorbell; ARGV: the stream. 1 when it joined.
_JOIN_AND_RING = (
    "if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then "
    "redis.call('XADD', KEYS[2], 'MAXLEN', '~', '1000', '*', 'stream', ARGV[1]) return 1 end return 0"
)


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
    stream: str = ""  # the stream it was taken from


class AsyncQueue:
    """The request stream and the records, over ``redis.asyncio`` (raw bytes)."""

    def __init__(self, client: redis.Redis, *, ttl_s: float = 3600.0, max_len: int = 100_000, prefix: str = PREFIX,
                 sealer: Sealer | None = None):  # fmt: skip
        self.redis = client
        self.sealer = sealer  # seals credentials as requests are queued, opens them for the worker
        self.ttl_s = ttl_s
        self.max_len = max_len
        self.prefix = prefix
        self.stream = prefix + "requests"  # the anonymous tenant's (and every tenant's before the split)
        self._registry = prefix + "streams"
        self._doorbell = prefix + "doorbell"
        self._queued = prefix + "queued"
        self._streams: list[str] = []  # the worker's: every stream it reads, the doorbell first
        self._grouped: set[str] = set()  # streams this queue made sure have the group
        self._streams_read_at = -math.inf
        self._next_claim = 0.0
        self._leave_if_empty = client.register_script(_LEAVE_IF_EMPTY)

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

    def stream_of(self, tenant: str) -> str:
        """The stream ``tenant``'s requests are queued on."""
        return f"{self.stream}:{tenant}" if tenant else self.stream

    async def backlog(self) -> int:
        """Requests queued, all tenants (ids older than the TTL dropped first)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self._queued, "-inf", time.time() - self.ttl_s)
            pipe.zcard(self._queued)
            _, total = await pipe.execute()
        return int(total)

    async def depth(self, tenant: str) -> tuple[int, int]:
        """``(requests queued, of them the tenant's)``, in one round trip; stale ids dropped first."""
        stale = time.time() - self.ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self._queued, "-inf", stale)
            pipe.zcard(self._queued)
            pipe.zremrangebyscore(self._tenant(tenant), "-inf", stale)
            pipe.zcard(self._tenant(tenant))
            _, total, _, own = await pipe.execute()
        return int(total), int(own)

    async def enqueue(self, tenant: str, path: str, body: bytes, credential: str | None, *,
                      content_type: str = "application/json", header_length: str = "", deadline_s: float = 0.0,
                      callback: str = "") -> tuple[str, int]:  # fmt: skip
        """Queue one request: ``(request id, backlog after it)``; to be taken within ``deadline_s`` (0: no limit)."""
        request_id = "req_" + secrets.token_hex(12)
        now = time.time()
        deadline_at = now + deadline_s if deadline_s > 0 else 0.0
        stream = self.stream_of(tenant)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._record(request_id), mapping={"tenant": tenant, "status": "queued", "created_at": now})
            pipe.pexpire(self._record(request_id), int(self.ttl_s * 1000))
            stored = seal(self.sealer, credential, f"request {request_id}") or ""
            pipe.xadd(stream, {"id": request_id, "path": path, "body": body, "credential": stored,
                               "created_at": now, "content_type": content_type,
                               "header_length": header_length, "deadline_at": deadline_at,
                               "callback": callback, "tenant": tenant})  # fmt: skip
            pipe.zadd(self._tenant(tenant), {request_id: now})
            pipe.pexpire(self._tenant(tenant), int(self.ttl_s * 1000))
            pipe.zadd(self._queued, {request_id: now})
            pipe.zcard(self._queued)
            joins = stream != self.stream  # a tenant's stream joins the set read; the anonymous one is always read
            if joins:  # the stream was empty: a worker blocked on the other streams reads this one now
                pipe.eval(_JOIN_AND_RING, 2, self._registry, self._doorbell, stream)
            replies = await pipe.execute()
        length = replies[-2] if joins else replies[-1]
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
        """The consumer group on the doorbell, the anonymous stream and every tenant stream there is."""
        await self._read_streams(force=True)

    async def _group(self, stream: str) -> None:
        if stream in self._grouped:
            return
        try:
            await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._grouped.add(stream)

    async def _read_streams(self, force: bool = False) -> list[str]:
        """The streams a worker reads: the doorbell, the anonymous one, each tenant's that holds entries (the
        group made on each)."""
        now = time.monotonic()
        if force or now - self._streams_read_at >= _REGISTRY_S:
            tenants = sorted(s.decode() for s in await self.redis.smembers(self._registry))
            streams = [self._doorbell, self.stream, *(s for s in tenants if s != self.stream)]
            for stream in streams:
                await self._group(stream)
            self._streams, self._streams_read_at = streams, now
        return self._streams

    async def _claim(self, streams: list[str], consumer: str, count: int, claim_idle_s: float) -> list:
        """Entries a dead (or stuck) worker has held longer than ``claim_idle_s``, swept at most every half of it."""
        now = time.monotonic()
        if now < self._next_claim:
            return []
        self._next_claim = now + min(claim_idle_s / 2, 5.0)
        async with self.redis.pipeline(transaction=False) as pipe:  # one round trip, however many tenants
            for stream in streams[1:]:
                pipe.xautoclaim(stream, GROUP, consumer, min_idle_time=int(claim_idle_s * 1000), start_id="0-0",
                                count=count)  # fmt: skip
            replies = await pipe.execute()
        claimed = [(stream, entry, fields) for stream, (_, entries, *_) in zip(streams[1:], replies)
                   for entry, fields in entries]  # fmt: skip
        return claimed

    async def take(self, consumer: str, count: int, block_ms: int, claim_idle_s: float) -> list[Queued]:
        """Up to about ``count`` entries for ``consumer``: any a dead worker left pending too long, then new ones,
        an equal share from each tenant's stream, in turns (each tenant's in order).

        At most ``count`` plus one a tenant stream: each stream is asked for its share, rounded up, and where
        some have fewer queued the rest is asked of those that filled theirs, in a second round trip.
        """
        try:
            return await self._take(consumer, count, block_ms, claim_idle_s)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis lost its keys (a restart without persistence): group them again
                self._grouped.clear()
                self._streams_read_at = -math.inf
            raise

    async def _take(self, consumer: str, count: int, block_ms: int, claim_idle_s: float) -> list[Queued]:
        streams = await self._read_streams()
        claimed = await self._claim(streams, consumer, count, claim_idle_s)
        want = count - len(claimed)
        per_stream: dict[str, list] = {}
        if want > 0:
            share = max(1, math.ceil(want / (len(streams) - 1)))
            reply = await self.redis.xreadgroup(GROUP, consumer, dict.fromkeys(streams, ">"), count=share,
                                                block=block_ms if not claimed else None)  # fmt: skip
            per_stream = {name.decode(): entries for name, entries in reply or []}
            rang = per_stream.pop(self._doorbell, None)
            if rang:  # a request found its tenant's stream empty: read the list of streams again, and the new one
                await self._ack(self._doorbell, [entry for entry, _ in rang])
                streams = await self._read_streams(force=True)
                fresh = [s for s in streams[1:] if s not in per_stream]
                if fresh:
                    again = await self.redis.xreadgroup(GROUP, consumer, dict.fromkeys(fresh, ">"), count=share)
                    per_stream.update({name.decode(): entries for name, entries in again or []})
            left = want - sum(len(entries) for entries in per_stream.values())
            full = [name for name, entries in per_stream.items() if len(entries) >= share]
            if left > 0 and full:
                more = await self.redis.xreadgroup(GROUP, consumer, dict.fromkeys(full, ">"),
                                                   count=math.ceil(left / len(full)))  # fmt: skip
                for name, entries in more or []:
                    per_stream[name.decode()].extend(entries)
        mine = [[(name, entry, fields) for entry, fields in entries] for name, entries in per_stream.items()]
        turns = itertools.chain.from_iterable(itertools.zip_longest(*mine))
        taken = [*claimed, *(one for one in turns if one is not None)]
        return [_queued(stream, entry, fields) for stream, entry, fields in taken if fields]

    async def _ack(self, stream: str, entries: list) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, GROUP, *entries)
            pipe.xdel(stream, *entries)
            await pipe.execute()

    async def complete(self, item: Queued, status: str, http_status: int, body: bytes, *,
                       content_type: str = "application/json", header_length: str = "") -> None:  # fmt: skip
        """Store the result (kept ``ttl_s``) and drop the entry from the stream."""
        record = self._record(item.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(record, mapping={"status": status, "http_status": http_status, "result": body,
                                       "completed_at": time.time(), "content_type": content_type,
                                       "header_length": header_length})  # fmt: skip
            pipe.pexpire(record, int(self.ttl_s * 1000))
            pipe.xack(item.stream, GROUP, item.entry)
            pipe.xdel(item.stream, item.entry)
            pipe.zrem(self._tenant(item.tenant), item.id)
            pipe.zrem(self._queued, item.id)
            if item.stream != self.stream:  # the anonymous stream is always read
                await self._leave_if_empty(keys=[item.stream, self._registry], client=pipe)
            await pipe.execute()


def _queued(stream: str, entry: bytes, fields: dict) -> Queued:
    return Queued(
        entry.decode(), fields[b"id"].decode(), fields[b"path"].decode(), fields[b"body"],
        fields[b"credential"].decode(), float(fields[b"created_at"]),
        fields.get(b"content_type", b"application/json").decode(), fields.get(b"header_length", b"").decode(),
        float(fields.get(b"deadline_at", b"0")), fields.get(b"callback", b"").decode(),
        fields.get(b"tenant", b"").decode(), stream,
    )  # fmt: skip
