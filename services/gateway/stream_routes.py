"""Result streams over server-sent events: ``GET /v2/streams/{name}`` (docs/tiers.md, "Result streams").

An ASGI front before the rest of the gateway; it only translates. The subscription itself (checks,
position, groups, the bounded buffer, the slow-consumer policy, gaps) is
:mod:`aiworks.streams.subscription`, shared with the gRPC front (stream_grpc.py). The caller's
tenant owns the stream namespace: another tenant's stream is simply not there (404).

- Request: ``Last-Event-ID`` (what EventSource sends when it reconnects) or ``?from=<id>`` continues
  after that id (``from=0``: from the oldest kept); ``?group=<g>`` (and optionally
  ``&consumer=<c>``) reads through the Redis consumer group ``g``.
- Events: a record is ``id:`` its Redis entry id and ``data:`` the JSON record; a gap is
  ``event: gap`` (no ``id:``, so EventSource keeps the last record's) with ``{"after", "first"}``;
  a drop is ``event: dropped``, then the connection is aborted; a heartbeat is a comment line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import parse_qs

import orjson
from starlette.datastructures import Headers

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, Status
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.http_protocol import ABORT_EXTENSION
from aiworks.streams.subscription import DROPPED_ENDING, HEARTBEAT, RECORD, Event, Subscription, Subscriptions

log = logging.getLogger(__name__)

PATH = "/v2/streams/"
_JSON = (b"content-type", b"application/json")


class StreamFront:
    """ASGI app in front of ``inner``: ``GET /v2/streams/{name}``, everything else passed through."""

    def __init__(self, inner, dataplane: GatewayDataPlane, subscriptions: Subscriptions):
        self.inner = inner
        self.dataplane = dataplane
        self.subscriptions = subscriptions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(PATH):
            try:
                subscription = await self._open(scope["path"][len(PATH) :], scope)
            except AIWorksError as exc:
                return await _refuse(send, exc)
            except Exception as exc:  # noqa: BLE001 - answered, never silenced
                log.exception("stream subscription failed")
                message = f"internal error: {type(exc).__name__}"
                return await _refuse(send, AIWorksError(message, Status.INTERNAL))
            try:
                return await self._serve(subscription, scope, receive, send)
            finally:
                subscription.close()
        await self.inner(scope, receive, send)

    async def _open(self, name: str, scope) -> Subscription:
        """Who asks for what, checked; 401, 400, 404 or 429 before the response starts."""
        headers = Headers(scope=scope)
        principal = self.dataplane.authenticate(headers)
        self.dataplane.refuse_work_token(principal, "subscribe to result streams")
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode("latin-1")).items()}
        return await self.subscriptions.open(
            principal.tenant_id, name, group=query.get("group"), consumer=query.get("consumer") or None,
            start=headers.get("last-event-id") or query.get("from"), policy=principal.tenant.stream_policy(name),
            tenant_limit=principal.tenant.max_stream_subscribers,
        )  # fmt: skip

    async def _serve(self, subscription: Subscription, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]})  # fmt: skip

        async def write(event: Event) -> None:
            await send({"type": "http.response.body", "body": _sse(event), "more_body": True})

        pump = asyncio.create_task(subscription.run(write))
        gone = asyncio.create_task(_disconnected(receive))
        done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in (pump, gone):
            task.cancel()
        await asyncio.gather(pump, gone, return_exceptions=True)
        if pump in done and not pump.cancelled() and pump.exception() is None and pump.result() == DROPPED_ENDING:
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort is not None:
                abort()
            return
        if pump in done and not pump.cancelled() and pump.exception() is not None:
            metrics.STREAM_SUBSCRIBERS_DROPPED.labels("error").inc()
            log.warning("stream subscriber ended: %s", pump.exception())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(send({"type": "http.response.body", "body": b""}), 1.0)


def _sse(event: Event) -> bytes:
    if event.kind == RECORD:
        return b"id: %s\ndata: %s\n\n" % (event.id.encode(), event.data)
    if event.kind == HEARTBEAT:
        return b": heartbeat\n\n"
    return b"event: %s\ndata: %s\n\n" % (event.kind.encode(), event.data)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _refuse(send, exc: AIWorksError) -> None:
    headers = [_JSON]
    if exc.retry_after_s:
        headers.append((b"retry-after", b"%d" % max(1, int(exc.retry_after_s))))
    if exc.status is Status.UNAUTHENTICATED:
        headers.append((b"www-authenticate", b'Bearer realm="aiworks"'))
    body = orjson.dumps({"error": exc.message})
    await send({"type": "http.response.start", "status": exc.status.http,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
