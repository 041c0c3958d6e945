"""Nearline: asynchronous inference over HTTP (docs/tiers.md), an ASGI front before the infer fast path.

- ``POST /v2/models/{model}[/versions/{v}]/infer`` with ``Prefer: respond-async``: the caller is
  authenticated and authorized, the body's size and OIP header checked, the request queued on a
  Redis Stream; the answer is 202 ``{"id", "status": "queued"}`` with ``Location`` and
  ``Preference-Applied: respond-async``. Without the preference, or with no queue configured,
  the request is answered synchronously as always (RFC 7240 lets a server ignore a preference).
- ``GET /v2/requests/{id}``: 202 ``{"id", "status": "queued"}`` while waiting; then the stored
  answer, with the status, content type and body a synchronous call would have had. Results are
  kept ``async_result_ttl_s``; a tenant sees only its own requests (404 otherwise).

The nearline worker (``aiworks nearline worker``) takes the queue in order and sends each
request through this gateway with the caller's credential.
"""

from __future__ import annotations

import logging
import re

import orjson
from starlette.datastructures import Headers

from aiworks.core.errors import AIWorksError, NotFound, PayloadTooLarge, ResourceExhausted, Status
from aiworks.gateway.batch_routes import caller_credential
from aiworks.gateway.dataplane import GatewayDataPlane, request_limit
from aiworks.gateway.filters import check_body_size
from aiworks.gateway.http_codec import HEADER_LENGTH, parse_infer_header
from aiworks.nearline.queue import AsyncQueue

log = logging.getLogger(__name__)

_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_REQUEST_PATH = re.compile(r"/v2/requests/([A-Za-z0-9_]{1,64})")
_JSON = (b"content-type", b"application/json")


def _wants_async(scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"prefer" and b"respond-async" in value.lower():
            return True
    return False


class AsyncInferFront:
    """ASGI app in front of ``inner``: the two nearline routes, everything else passed through untouched."""

    def __init__(self, inner, dataplane: GatewayDataPlane, queue: AsyncQueue, max_request_bytes: int,
                 max_backlog: int):  # fmt: skip
        self.inner = inner
        self.dataplane = dataplane
        self.queue = queue
        self.max_request_bytes = max_request_bytes
        self.max_backlog = max_backlog

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and _wants_async(scope):
                match = _INFER_PATH.fullmatch(scope["path"])
                if match is not None:
                    return await self._answer(send, self._submit(match[1], match[2] or "", scope, receive))
            elif scope["method"] == "GET" and scope["path"].startswith("/v2/requests/"):
                match = _REQUEST_PATH.fullmatch(scope["path"])
                return await self._answer(send, self._result(match[1] if match else "", scope))
        await self.inner(scope, receive, send)

    async def _answer(self, send, work) -> None:
        try:
            status, body, headers = await work
        except AIWorksError as exc:
            extra = [(b"retry-after", b"%d" % max(1, int(exc.retry_after_s)))] if exc.retry_after_s else []
            if exc.status is Status.UNAUTHENTICATED:
                extra.append((b"www-authenticate", b'Bearer realm="aiworks"'))
            status, body, headers = exc.status.http, orjson.dumps({"error": exc.message}), [_JSON, *extra]
        except Exception as exc:  # noqa: BLE001 - answered, never silenced
            log.exception("nearline route failed")
            status, body, headers = 500, orjson.dumps({"error": f"internal error: {type(exc).__name__}"}), [_JSON]
        headers = [*headers, (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _submit(self, model: str, version: str, scope, receive):
        headers = Headers(scope=scope)
        principal = self.dataplane.authenticate(headers)  # before a byte of the body is read
        self.dataplane.authorize(principal, model, version)
        limit = request_limit(principal, self.max_request_bytes)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit():
            check_body_size(int(declared), limit, principal.tenant_id)
        chunks, total = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # The header now, so a malformed request is refused at once rather than queued.
        parse_infer_header(body, headers.get(HEADER_LENGTH), model, version, self.dataplane.limits)
        if await self.queue.backlog() >= self.max_backlog:
            raise ResourceExhausted(f"the asynchronous queue is full ({self.max_backlog} requests)", retry_after_s=1.0)
        request_id, _ = await self.queue.enqueue(
            principal.tenant_id, scope["path"], body, caller_credential(headers),
            content_type=headers.get("content-type", "application/json"), header_length=headers.get(HEADER_LENGTH, ""),
        )  # fmt: skip
        doc = orjson.dumps({"id": request_id, "status": "queued"})
        location = f"/v2/requests/{request_id}".encode()
        return 202, doc, [_JSON, (b"location", location), (b"preference-applied", b"respond-async")]

    async def _result(self, request_id: str, scope):
        principal = self.dataplane.authenticate(Headers(scope=scope))
        record = await self.queue.get(request_id) if request_id else None
        if record is None or record["tenant"].decode() != principal.tenant_id:
            raise NotFound(f"no request '{request_id[:64]}' (results are kept for a limited time)")
        status = record["status"].decode()
        if status == "queued":
            return 202, orjson.dumps({"id": request_id, "status": status}), [_JSON]
        headers = [(b"content-type", record.get("content_type", b"application/json")),
                   (b"aiworks-request-status", status.encode())]  # fmt: skip
        if record.get("header_length"):
            headers.append((b"inference-header-content-length", record["header_length"]))
        return int(record["http_status"]), record["result"], headers
