"""Result streams over server-sent events: ``GET /v2/streams/{name}`` (docs/tiers.md, "Result streams").

An ASGI front before the rest of the gateway. The caller's tenant owns the stream namespace: the
stream read is ``aiworks:stream:<tenant>:<name>``, so another tenant's stream is simply not there
(404). Each entry goes out as one event, ``id:`` the Redis entry id and ``data:`` the JSON record.

- Position: new entries only by default; ``Last-Event-ID`` (what EventSource sends when it
  reconnects) or ``?from=<id>`` continues after that id (``from=0``: from the oldest kept).
- ``?group=<g>`` (and optionally ``&consumer=<c>``) reads through the Redis consumer group ``g``
  (created at the stream's end, or at ``from``): subscribers of one group share the entries. An
  entry is acknowledged once written to its subscriber's connection; entries read but never
  written (the subscriber went away or was dropped) stay pending and another subscriber of the
  group takes them after ``stream_claim_idle_s``: at-least-once, up to the subscriber's socket.
- Bounded: a subscriber has at most ``stream_buffer_events`` entries in hand at once. When one
  write waits longer than ``stream_send_timeout_s`` (the client does not read and its socket has
  backed up), the subscriber is dropped: ``event: dropped`` is offered, the connection aborted,
  and it is counted in ``aiworks_stream_subscribers_dropped_total``.
- A comment line every ``_HEARTBEAT_S`` keeps proxies from closing an idle stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from urllib.parse import parse_qs

import orjson
from starlette.datastructures import Headers

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, NotFound, ResourceExhausted, Status
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.http_protocol import ABORT_EXTENSION
from aiworks.streams.store import Reader, check_entry_id, check_name, stream_key

log = logging.getLogger(__name__)

PATH = "/v2/streams/"
_JSON = (b"content-type", b"application/json")
_BLOCK_MS = 1000
_HEARTBEAT_S = 15.0


class StreamFront:
    """ASGI app in front of ``inner``: ``GET /v2/streams/{name}``, everything else passed through."""

    def __init__(self, inner, dataplane: GatewayDataPlane, reader: Reader, *, buffer_events: int = 100,
                 send_timeout_s: float = 5.0, max_subscribers: int = 1000):  # fmt: skip
        self.inner = inner
        self.dataplane = dataplane
        self.reader = reader
        self.buffer_events = buffer_events
        self.send_timeout_s = send_timeout_s
        self.max_subscribers = max_subscribers
        self.subscribers = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(PATH):
            try:
                plan = await self._open(scope["path"][len(PATH) :], scope)
            except AIWorksError as exc:
                return await _refuse(send, exc)
            except Exception as exc:  # noqa: BLE001 - answered, never silenced
                log.exception("stream subscription failed")
                message = f"internal error: {type(exc).__name__}"
                return await _refuse(send, AIWorksError(message, Status.INTERNAL))
            return await self._serve(plan, scope, receive, send)
        await self.inner(scope, receive, send)

    async def _open(self, name: str, scope) -> dict:
        """Who asks for what, checked; 401, 400, 404 or 429 before the response starts."""
        headers = Headers(scope=scope)
        principal = self.dataplane.authenticate(headers)
        check_name(name)
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode("latin-1")).items()}
        group = check_name(query["group"], "group name") if "group" in query else None
        consumer = check_name(query.get("consumer") or "c-" + secrets.token_hex(6), "consumer name")
        start = headers.get("last-event-id") or query.get("from")
        if start is not None:
            check_entry_id(start)
        key = stream_key(principal.tenant_id, name)
        if not await self.reader.exists(key):
            raise NotFound(f"no stream '{name}' (a stream exists once a result has been published to it)")
        if self.subscribers >= self.max_subscribers:
            raise ResourceExhausted(f"this gateway already serves {self.max_subscribers} subscribers", retry_after_s=1)
        if group is not None:
            await self.reader.join(key, group, start or "$")
        elif start is None:
            start = await self.reader.last_id(key)  # "$" once, so that no entry slips between two reads
        return {"key": key, "group": group, "consumer": consumer, "last": start}

    async def _serve(self, plan: dict, scope, receive, send) -> None:
        self.subscribers += 1
        metrics.STREAM_SUBSCRIBERS.inc()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ]})  # fmt: skip
            pump = asyncio.create_task(self._pump(plan, send))
            gone = asyncio.create_task(_disconnected(receive))
            done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            if pump in done and not pump.cancelled() and pump.exception() is None and pump.result() == "dropped":
                abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
                if abort is not None:
                    abort()
                return
            if pump in done and not pump.cancelled() and pump.exception() is not None:
                metrics.STREAM_SUBSCRIBERS_DROPPED.labels("error").inc()
                log.warning("stream subscriber ended: %s", pump.exception())
            with contextlib.suppress(Exception):
                await asyncio.wait_for(send({"type": "http.response.body", "body": b""}), 1.0)
        finally:
            self.subscribers -= 1
            metrics.STREAM_SUBSCRIBERS.dec()

    async def _pump(self, plan: dict, send) -> str:
        """Entries to the subscriber until it goes; ``"dropped"`` when its socket backed up."""
        key, group, consumer, last = plan["key"], plan["group"], plan["consumer"], plan["last"]
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            if group is None:
                entries = await self.reader.after(key, last, self.buffer_events, _BLOCK_MS)
            else:
                entries = await self.reader.take(key, group, consumer, self.buffer_events, _BLOCK_MS)
            if not entries:
                if loop.time() - quiet_since >= _HEARTBEAT_S:
                    if not await self._write(send, b": heartbeat\n\n"):
                        return await self._drop(send)
                    quiet_since = loop.time()
                continue
            sent = []
            for entry_id, record in entries:
                if not await self._write(send, b"id: %s\ndata: %s\n\n" % (entry_id.encode(), record)):
                    if group is not None:
                        await self.reader.ack(key, group, sent)
                    return await self._drop(send)
                sent.append(entry_id)
                last = entry_id
            metrics.STREAM_EVENTS_SENT.inc(len(sent))
            if group is not None:
                await self.reader.ack(key, group, sent)
            quiet_since = loop.time()

    async def _write(self, send, chunk: bytes) -> bool:
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                   self.send_timeout_s)  # fmt: skip
        except TimeoutError:
            return False
        return True

    async def _drop(self, send) -> str:
        metrics.STREAM_SUBSCRIBERS_DROPPED.labels("slow").inc()
        note = orjson.dumps({"reason": f"the subscriber did not read for {self.send_timeout_s:g} s"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(send({"type": "http.response.body", "body": b"event: dropped\ndata: %s\n\n" % note,
                                         "more_body": True}), 0.2)  # fmt: skip
        return "dropped"


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
