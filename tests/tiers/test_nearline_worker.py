"""The nearline worker in process, against a private redis-server and an aiohttp server standing in for the
gateway: what it does with the gateway's refusals."""

from __future__ import annotations

import asyncio

from aiohttp import web

from aiworks.nearline.queue import AsyncQueue
from aiworks.nearline.worker import NearlineWorker

from .conftest import serve_infer


async def _answered(queue: AsyncQueue, ids: list[str], timeout_s: float = 20.0) -> list[dict]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        records = [await queue.get(i) for i in ids]
        if all(r and r.get("status") not in (None, b"queued", "queued") for r in records):
            return records
        assert asyncio.get_running_loop().time() < deadline, records
        await asyncio.sleep(0.05)


def _status(record: dict) -> str:
    value = record["status"]
    return value.decode() if isinstance(value, bytes) else value


async def test_a_401_that_goes_away_on_a_new_connection_is_not_the_result(redis_url):
    """A rolling upgrade of the gateways: a replica from before work tokens refuses the token (401), the others
    take it. The worker tries a 401 again on a new connection, which a load balancer may send elsewhere, so the
    request completes; a 401 that lasts (a revoked key) is the result after a few tries, within the deadline."""
    peers: list[int] = []
    refuse_first = {"yes": True}

    async def infer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        if request.headers.get("authorization") == "Bearer revoked" or refuse_first.pop("yes", False):
            return web.json_response({"error": "API key is not recognised"}, status=401)
        return web.json_response({"model_name": "digits", "outputs": []})

    server, url = await serve_infer(infer)
    queue = AsyncQueue.from_url(redis_url)
    worker = NearlineWorker(queue, url, concurrency=1, deadline_s=10.0)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_forever(stop))
    try:
        first, _ = await queue.enqueue("alice", "/v2/models/digits/infer", b'{"inputs": []}', "Bearer fine",
                                       deadline_s=10)  # fmt: skip
        (done,) = await _answered(queue, [first])
        assert _status(done) == "completed", done
        assert len(peers) == 2 and peers[0] != peers[1], "the second try went out on a new connection"
        revoked, _ = await queue.enqueue("alice", "/v2/models/digits/infer", b'{"inputs": []}', "Bearer revoked",
                                         deadline_s=10)  # fmt: skip
        (refused,) = await _answered(queue, [revoked])
        assert _status(refused) == "failed" and refused["http_status"] == b"401" and b"not recognised" in refused["result"], refused
        assert len(peers) == 2 + 4, "a lasting 401: the first try and three on new connections, then the result"
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await queue.close()
        await server.cleanup()


async def test_a_tenants_backlog_counts_its_queued_requests_once_each_and_heals(redis_url):
    """What the gateway's per-tenant bound reads: a tenant's queued requests, each counted until its result is
    stored (once, however often it is answered), tenants apart; ids older than the TTL, which a worker that
    never removes them would leave, are dropped."""
    queue = AsyncQueue.from_url(redis_url, ttl_s=60)
    try:
        await queue.ensure_group()
        ids = [(await queue.enqueue("alice", "/v2/models/m/infer", b"{}", None))[0] for _ in range(3)]
        await queue.enqueue("bob", "/v2/models/m/infer", b"{}", None)
        assert await queue.depth("alice") == (4, 3) and await queue.depth("bob") == (4, 1)
        taken = await queue.take("w", 10, 100, 30.0)
        first = next(item for item in taken if item.id == ids[0])
        await queue.complete(first, "completed", 200, b"{}")
        await queue.complete(first, "completed", 200, b"{}")  # answered twice (taken over after a slow worker)
        assert await queue.depth("alice") == (3, 2)
        await queue.redis.zadd(f"{queue.prefix}tenant:alice", {"req_left_by_an_old_worker": 1.0})  # long ago
        assert await queue.depth("alice") == (3, 2), "an id older than the TTL is dropped"
    finally:
        await queue.close()


async def test_each_tenant_gets_its_turn_whatever_another_has_queued(redis_url):
    """alice queues 40, then bob 2 and the anonymous tenant 1: a worker with four free places takes from each in
    turns (bob's first before alice's second), never more than its places plus one a stream, and each tenant's
    requests in the order they were queued; the backlog counts them all until their results are stored."""
    queue = AsyncQueue.from_url(redis_url)
    try:
        await queue.ensure_group()
        alice = [(await queue.enqueue("alice", "/v2/models/m/infer", b"{}", None))[0] for _ in range(40)]
        bob = [(await queue.enqueue("bob", "/v2/models/m/infer", b"{}", None))[0] for _ in range(2)]
        anonymous, _ = await queue.enqueue("", "/v2/models/m/infer", b"{}", None)
        assert await queue.backlog() == 43 and await queue.depth("bob") == (43, 2)
        first = await queue.take("w", 4, 100, 30.0)
        ids = [item.id for item in first]
        assert len(first) <= 4 + 3 and set(bob) <= set(ids) and anonymous in ids, ids
        assert ids.index(bob[0]) < ids.index(alice[1]), f"bob waited behind alice's backlog: {ids}"
        taken = list(first)
        while len(taken) < 43:
            more = await queue.take("w", 8, 100, 30.0)
            assert more and len(more) <= 8 + 3
            taken.extend(more)
        assert [i.id for i in taken if i.tenant == "alice"] == alice and [i.id for i in taken if i.tenant == "bob"] == bob
        assert {i.stream for i in taken} == {queue.stream_of("alice"), queue.stream_of("bob"), queue.stream}
        registry = f"{queue.prefix}streams"
        assert await queue.redis.smembers(registry) == {s.encode() for s in (queue.stream_of("alice"), queue.stream_of("bob"))}
        for item in taken:
            await queue.complete(item, "completed", 200, b"{}")
        assert await queue.backlog() == 0 and await queue.depth("alice") == (0, 0)
        assert await queue.redis.smembers(registry) == set(), "a stream with no entries left is read no more"
        assert await queue.take("w", 4, 50, 30.0) == []
        again, _ = await queue.enqueue("bob", "/v2/models/m/infer", b"{}", None)  # bob's stream is read again
        assert [item.id for item in await queue.take("w", 4, 100, 30.0)] == [again]
    finally:
        await queue.close()


async def test_a_new_tenants_first_request_wakes_a_worker_waiting_on_the_others(redis_url):
    """A worker blocked reading the streams it knows is woken by the doorbell a new tenant's first request rings,
    and takes that request at once rather than when its wait ends; a worker that dies holding entries has them
    taken over by another after claim_idle_s."""
    worker_side, gateway_side = AsyncQueue.from_url(redis_url), AsyncQueue.from_url(redis_url)
    try:
        await worker_side.ensure_group()
        loop = asyncio.get_running_loop()
        began = loop.time()
        waiting = asyncio.create_task(worker_side.take("w1", 4, 10_000, 0.3))
        await asyncio.sleep(0.3)
        request_id, _ = await gateway_side.enqueue("dave", "/v2/models/m/infer", b"{}", None)
        got = await asyncio.wait_for(waiting, 5)
        assert [item.id for item in got] == [request_id] and loop.time() - began < 3.0
        await asyncio.sleep(0.5)  # w1 "died" holding it
        other = AsyncQueue.from_url(redis_url)
        try:
            await other.ensure_group()
            claimed = await other.take("w2", 4, 100, 0.3)
            assert [item.id for item in claimed] == [request_id] and claimed[0].stream == other.stream_of("dave")
            await other.complete(claimed[0], "completed", 200, b"{}")
            assert await other.backlog() == 0
        finally:
            await other.close()
    finally:
        await worker_side.close()
        await gateway_side.close()
