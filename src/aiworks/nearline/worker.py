"""The nearline worker: takes queued asynchronous requests in order and sends them through the gateway.

Like the batch runner it is a client of the gateway's public HTTP API, with
the submitter's credential, so tenancy, limits and metering apply. A request
the gateway refuses for load (429/503) is retried until ``deadline_s`` after
it was queued; then its record says ``failed`` with the last answer. Any
answer (200 or an error) is stored as the request's result.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp

from aiworks.core.metrics import NEARLINE_BACKLOG, NEARLINE_OLDEST_AGE, NEARLINE_REQUESTS, NEARLINE_WAIT
from aiworks.nearline.queue import AsyncQueue, Queued

log = logging.getLogger(__name__)

_TRANSIENT = (429, 502, 503, 504)


class NearlineWorker:
    """Consumes the request stream with ``concurrency`` requests in flight."""

    def __init__(self, queue: AsyncQueue, gateway_url: str, *, concurrency: int = 32, deadline_s: float = 30.0,
                 claim_idle_s: float = 30.0, request_timeout_s: float = 60.0, consumer: str | None = None):  # fmt: skip
        self.queue = queue
        self.base_url = gateway_url.rstrip("/")
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.claim_idle_s = claim_idle_s
        self.request_timeout_s = request_timeout_s
        self.consumer = consumer or f"worker-{uuid.uuid4().hex[:12]}"
        self._client: aiohttp.ClientSession | None = None

    async def run_forever(self, stop: asyncio.Event) -> None:
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
        )
        await self.queue.ensure_group()
        gate = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        next_backlog = 0.0
        try:
            while not stop.is_set():
                free = self.concurrency - len(tasks)
                if free <= 0:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    items = await self.queue.take(self.consumer, free, 500, self.claim_idle_s)
                    if time.monotonic() >= next_backlog:
                        next_backlog = time.monotonic() + 1.0
                        NEARLINE_BACKLOG.set(await self.queue.backlog())
                except Exception as exc:  # noqa: BLE001 - Redis away: wait and try again
                    log.warning("nearline worker: cannot read the queue: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
                if items:
                    NEARLINE_OLDEST_AGE.set(max(0.0, time.time() - min(i.created_at for i in items)))
                for item in items:
                    task = asyncio.create_task(self._one(item, gate))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=self.request_timeout_s)
        finally:
            await self._client.close()

    async def _one(self, item: Queued, gate: asyncio.Semaphore) -> None:
        async with gate:
            NEARLINE_WAIT.observe(max(0.0, time.time() - item.created_at))
            headers = {"content-type": item.content_type}
            if item.header_length:
                headers["inference-header-content-length"] = item.header_length
            if item.credential:
                headers["authorization"] = item.credential
            give_up = item.created_at + self.deadline_s
            attempt = 0
            while True:
                attempt += 1
                try:
                    async with self._client.post(self.base_url + item.path, data=item.body, headers=headers) as reply:
                        status, body = reply.status, await reply.read()
                        content_type = reply.headers.get("content-type", "application/json")
                        header_length = reply.headers.get("inference-header-content-length", "")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status, body = 503, b'{"error": "gateway unreachable (%s)"}' % type(exc).__name__.encode()
                    content_type, header_length = "application/json", ""
                if status not in _TRANSIENT or time.time() + 0.05 * 2**attempt > give_up:
                    break
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
            outcome = "completed" if status == 200 else "failed"
            NEARLINE_REQUESTS.labels(outcome).inc()
            try:
                await self.queue.complete(item, outcome, status, body, content_type=content_type,
                                          header_length=header_length)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - left pending: another worker takes it over
                log.warning("nearline worker: cannot store the result of %s: %s", item.id, exc)
