"""Priority order, deadlines and admission control through the real suite (runtimes slowed to 50 ms a batch)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import numpy as np
from qos_support import KServeClient, child_pid, rss_bytes, scheduler_status


def iris_rows(n: int) -> np.ndarray:
    return np.tile(np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32), (n, 1))


async def iris_rows_executed(suite) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{suite.base}/v2/models/iris/stats") as resp:
            doc = await resp.json()
    return sum(m["inference_count"] for m in doc["model_stats"])


async def test_realtime_overtakes_a_batch_backlog(slow_suite):
    client = KServeClient(slow_suite.grpc_url)
    finished: dict[str, list[float]] = {"batch": [], "realtime": []}
    started = time.monotonic()

    async def one(kind: str, priority: int):
        await client.infer(client.request("iris", iris_rows(32), priority=priority))
        finished[kind].append(time.monotonic() - started)

    try:
        # 32 rows a request and 64 a batch: 60 requests are 30 batches, 15 rounds of 50 ms on two replicas.
        backlog = [asyncio.ensure_future(one("batch", 3)) for _ in range(60)]
        await asyncio.sleep(0.2)
        urgent = [asyncio.ensure_future(one("realtime", 1)) for _ in range(4)]
        await asyncio.gather(*backlog, *urgent)
    finally:
        await client.close()
    last_urgent = max(finished["realtime"])
    behind = sum(1 for t in finished["batch"] if t > last_urgent)
    assert behind >= 20, f"realtime done at {last_urgent:.2f}s; batch done at {sorted(finished['batch'])}"


async def test_a_request_that_expires_in_the_queue_gets_504_and_never_runs(slow_suite):
    client = KServeClient(slow_suite.grpc_url)
    before_rows = await iris_rows_executed(slow_suite)
    expired_before = sum(q.expired for q in scheduler_status(slow_suite).queues)
    try:
        backlog = [asyncio.ensure_future(client.infer(client.request("iris", iris_rows(32)))) for _ in range(40)]
        await asyncio.sleep(0.1)
        # Same class, behind ~500 ms of work, with 100 ms to live: over gRPC and over HTTP.
        late = client.request("iris", iris_rows(32), timeout_us=100_000)
        started = time.monotonic()
        try:
            await client.infer(late)
            raise AssertionError("the late request was answered")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
        assert time.monotonic() - started < 1.0  # answered at its deadline, not when the backlog cleared
        body = {
            "inputs": [{"name": "input", "shape": [32, 4], "datatype": "FP32", "data": iris_rows(32).ravel().tolist()}],
            "parameters": {"timeout": 100_000},
        }
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{slow_suite.base}/v2/models/iris/infer", json=body) as resp:
                assert resp.status == 504, await resp.text()
        await asyncio.gather(*backlog)
    finally:
        await client.close()
    deadline = time.monotonic() + 5  # the replicas report their queues with each heartbeat (every second)
    while sum(q.expired for q in scheduler_status(slow_suite).queues) - expired_before < 2:
        assert time.monotonic() < deadline, "the replicas never reported the two expired requests"
        await asyncio.sleep(0.2)
    assert sum(q.expired for q in scheduler_status(slow_suite).queues) - expired_before == 2
    assert await iris_rows_executed(slow_suite) - before_rows == 40 * 32  # the two late ones never ran


async def test_overload_is_refused_with_429_and_the_queues_stay_bounded(slow_suite):
    # The queues are in the runtimes: each replica's memory must stay bounded by its queue's bounds.
    pids = [child_pid(slow_suite, name) for name in ("runtime-0", "runtime-1")]
    rss_before = [rss_bytes(pid) for pid in pids]
    peak = list(rss_before)
    client = KServeClient(slow_suite.grpc_url)
    digits = np.random.default_rng(0).random((64, 64), dtype=np.float32)  # 16 KiB a request
    codes: dict[str, int] = {}
    retry_after: set[str] = set()

    async def one():
        try:
            await client.infer(client.request("digits", digits, version="1"))
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
            retry_after.update(v for k, v in (exc.trailing_metadata() or ()) if k == "retry-after")

    async def sample():
        nonlocal peak
        while True:
            peak = [max(p, rss_bytes(pid)) for p, pid in zip(peak, pids)]
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    try:
        for _ in range(2):  # two waves of 1,000 concurrent requests, 16 MiB each; 1 MiB may queue
            await asyncio.gather(*(one() for _ in range(1000)))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            body = iris_rows(32).tobytes()
            header = (
                b'{"inputs":[{"name":"input","shape":[32,4],"datatype":"FP32",'
                b'"parameters":{"binary_data_size":%d}}]}' % len(body)
            )
            headers = {"Inference-Header-Content-Length": str(len(header))}

            async def http_one():
                async with http.post(
                    f"{slow_suite.base}/v2/models/iris/infer", data=header + body, headers=headers
                ) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            http_results = await asyncio.gather(*(http_one() for _ in range(400)))
    finally:
        sampler.cancel()
        await client.close()
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.get("RESOURCE_EXHAUSTED", 0) >= 1000 and codes.get("OK", 0) >= 100, codes
    assert retry_after and all(int(v) >= 1 for v in retry_after)
    statuses = [s for s, _ in http_results]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 50, {s: statuses.count(s) for s in set(statuses)}
    assert all(ra is not None and int(ra) >= 1 for s, ra in http_results if s == 429)
    grown_mib = max(p - b for p, b in zip(peak, rss_before)) / 2**20
    # Queued, one wave alone would be 16 MiB of tensors plus their messages; bounded, about 1 MiB a replica is.
    assert grown_mib < 24, f"a replica's RSS grew by {grown_mib:.0f} MiB under overload"
    deadline = time.monotonic() + 5  # the replicas report their queues with each heartbeat
    while True:
        status = scheduler_status(slow_suite)
        if all(q.queued_requests == 0 for q in status.queues) and sum(q.rejected for q in status.queues) >= 1000:
            break
        assert time.monotonic() < deadline, list(status.queues)
        await asyncio.sleep(0.2)
