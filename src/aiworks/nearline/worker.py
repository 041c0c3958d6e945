"""The nearline worker: takes queued asynchronous requests in order and sends them through the gateway.

Like the batch runner it is a client of the gateway's public HTTP API, with
the submitter's credential, so tenancy, limits and metering apply.

Each request carries its deadline (set by the gateway at submission: the
nearline class's, 500 ms by default). One taken after it is not run: its
result is a stored 504 naming the deadline (``status: expired``). Otherwise
the body sent has no ``async`` key (so it cannot be queued again) and
``parameters.timeout`` = the time left, so the runtime drops it if it expires
in its queue. A request the gateway refuses for load (429/503) is retried
until the deadline; then its record says ``failed`` with the last answer. Any
answer (200 or an error) is stored as the request's result, then posted to the
request's callback URL if it has one (:mod:`aiworks.nearline.callbacks`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid

import aiohttp
import orjson

from aiworks.core.errors import AIWorksError, DeadlineExceeded
from aiworks.core.metrics import (
    NEARLINE_BACKLOG,
    NEARLINE_CALLBACKS,
    NEARLINE_OLDEST_AGE,
    NEARLINE_REQUESTS,
    NEARLINE_WAIT,
)
from aiworks.nearline.body import replay_body
from aiworks.nearline.delivery import CallbackSender
from aiworks.nearline.queue import AsyncQueue, Queued
from aiworks.security.sealing import SealError

log = logging.getLogger(__name__)

_TRANSIENT = (429, 502, 503, 504)
_AUTH_TRIES = 3  # a 401's tries on new connections, within the deadline, before it is the result


class NearlineWorker:
    """Consumes the request stream with ``concurrency`` requests in flight."""

    def __init__(self, queue: AsyncQueue, gateway_url: str, *, concurrency: int = 32, deadline_s: float = 30.0,
                 claim_idle_s: float = 30.0, request_timeout_s: float = 60.0, consumer: str | None = None,
                 callbacks: CallbackSender | None = None, ca_file: str | None = None):  # fmt: skip
        self.queue = queue
        self.callbacks = callbacks or CallbackSender({})
        self._deliveries: set[asyncio.Task] = set()
        self.base_url = gateway_url.rstrip("/")
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.claim_idle_s = claim_idle_s
        self.request_timeout_s = request_timeout_s
        self.ca_file = ca_file  # the gateway's CA (https://); callbacks keep the system's CAs
        self.consumer = consumer or f"worker-{uuid.uuid4().hex[:12]}"
        self._client: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection a request: a 401's next try

    async def run_forever(self, stop: asyncio.Event) -> None:
        ssl_context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
        self._client, self._fresh = (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency, ssl=ssl_context, force_close=fresh),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            )
            for fresh in (False, True)
        )
        await self.queue.ensure_group()
        gate = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        next_backlog = 0.0
        try:
            while not stop.is_set():
                if len(self._deliveries) >= 4 * self.concurrency:
                    # Callbacks are slow to answer: take no more until some are done (memory stays bounded).
                    await asyncio.wait(self._deliveries, return_when=asyncio.FIRST_COMPLETED)
                    continue
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
            if self._deliveries:
                await asyncio.wait(self._deliveries, timeout=30.0)
        finally:
            await self._client.close()
            await self._fresh.close()
            await self.callbacks.close()

    async def _one(self, item: Queued, gate: asyncio.Semaphore) -> None:
        async with gate:
            now = time.time()
            NEARLINE_WAIT.observe(max(0.0, now - item.created_at))
            deadline_at = item.deadline_at or item.created_at + self.deadline_s
            if now >= deadline_at:
                status, body, content_type, header_length = _expired(item, deadline_at, now)
                outcome = "expired"
            else:
                status, body, content_type, header_length = await self._send(item, deadline_at)
                outcome = "completed" if status == 200 else "failed"
            NEARLINE_REQUESTS.labels(outcome).inc()
            try:
                await self.queue.complete(item, outcome, status, body, content_type=content_type,
                                          header_length=header_length)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - left pending: another worker takes it over
                log.warning("nearline worker: cannot store the result of %s: %s", item.id, exc)
                return
        if item.callback:
            task = asyncio.create_task(self._deliver(item, outcome, status, body, content_type, header_length))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)

    async def _send(self, item: Queued, deadline_at: float) -> tuple[int, bytes, str, str]:
        """Send it through the gateway with the time left as its timeout; retried on load until the deadline."""
        headers = {"content-type": item.content_type}
        try:
            credential = self.queue.credential(item)
        except SealError as exc:  # a worker without the gateway's credential key: the result says why
            log.error("nearline worker: %s", exc.message)
            return exc.status.http, orjson.dumps({"error": exc.message}), "application/json", ""
        if credential:
            headers["authorization"] = credential
        attempt, client, refusals = 0, self._client, 0
        while True:
            attempt += 1
            left_us = max(1, int((deadline_at - time.time()) * 1e6))
            try:
                body, header_length = replay_body(item.body, item.header_length or None, left_us)
            except AIWorksError as exc:  # checked at submission: only a body stored by something else gets here
                return exc.status.http, orjson.dumps({"error": exc.message}), "application/json", ""
            if header_length is not None:
                headers["inference-header-content-length"] = header_length
            try:
                async with client.post(self.base_url + item.path, data=body, headers=headers) as reply:
                    status, answer = reply.status, await reply.read()
                    content_type = reply.headers.get("content-type", "application/json")
                    answer_length = reply.headers.get("inference-header-content-length", "")
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, answer = 503, b'{"error": "gateway unreachable (%s)"}' % type(exc).__name__.encode()
                content_type, answer_length = "application/json", ""
            if status == 401 and refusals < _AUTH_TRIES and time.time() < deadline_at:
                # A gateway replica from before work tokens refuses one (a rolling upgrade): the next try goes out
                # on a new connection, which a load balancer may send to another replica.
                refusals += 1
                client = self._fresh
                continue
            if status not in _TRANSIENT or time.time() + 0.05 * 2**attempt > deadline_at:
                return status, answer, content_type, answer_length
            await asyncio.sleep(min(1.0, 0.05 * 2**attempt))

    async def _deliver(self, item: Queued, outcome: str, status: int, body: bytes, content_type: str,
                       header_length: str) -> None:  # fmt: skip
        result = await self.callbacks.send(item.tenant, item.callback, item.id, outcome, status, body, content_type,
                                           header_length)  # fmt: skip
        NEARLINE_CALLBACKS.labels("delivered" if result == "delivered" else "failed").inc()
        try:
            await self.queue.note(item.id, callback=result)
        except Exception as exc:  # noqa: BLE001 - the result itself is stored
            log.warning("nearline worker: cannot note the callback of %s: %s", item.id, exc)


def _expired(item: Queued, deadline_at: float, now: float) -> tuple[int, bytes, str, str]:
    """The stored answer of a request taken after its deadline: 504, naming the deadline; it was not run."""
    budget_ms = round((deadline_at - item.created_at) * 1000)
    late_ms = round((now - deadline_at) * 1000)
    error = DeadlineExceeded(
        f"deadline exceeded: this request's nearline deadline of {budget_ms} ms after submission passed "
        f"{late_ms} ms before a worker took it; it was not run"
    )
    return error.status.http, orjson.dumps({"error": error.message}), "application/json", ""
