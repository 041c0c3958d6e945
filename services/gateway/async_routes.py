"""Nearline: asynchronous inference over HTTP (docs/tiers.md), an ASGI front before the infer fast path.

- ``POST /v2/models/{model}[/versions/{v}]/infer`` with ``Prefer: respond-async``: the caller is
  authenticated and authorized, the body's size and OIP header checked, the request queued on a
  Redis Stream; the answer is 202 ``{"id", "status": "queued"}`` with ``Location`` and
  ``Preference-Applied: respond-async``. Without the preference, or with no queue configured,
  the request is answered synchronously as always (RFC 7240 lets a server ignore a preference).
- The same request with ``"async": true`` in its body (top level or ``parameters``): the infer
  fast path finds it (a substring search, then a parse only when the header holds ``"async"``)
  and hands the request to :meth:`AsyncInferFront.accept`. With no queue configured that flag
  is refused (400, naming the setting): an explicit flag in the body is not a preference.
- Each queued request carries its deadline (``async_deadline_s``, or the request's own shorter
  ``parameters.timeout``) and, from the ``AIWorks-Callback`` header, a callback URL whose host
  the tenant's ``callbacks.hosts`` must list (400 naming the host otherwise).
- ``GET /v2/requests/{id}``: 202 ``{"id", "status": "queued"}`` while waiting; then the stored
  answer, with the status, content type and body a synchronous call would have had. Results are
  kept ``async_result_ttl_s``; a tenant sees only its own requests (404 otherwise).

The nearline worker (``aiworks nearline worker``) takes the queue in order and sends each
request through this gateway with the caller's credential.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import orjson
import redis.exceptions as redis
from starlette.datastructures import Headers

from aiworks.core.errors import AIWorksError, NotFound, PayloadTooLarge, ResourceExhausted, Unavailable
from aiworks.gateway.batch_routes import work_credential
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import check_body_size
from aiworks.gateway.http_codec import HEADER_LENGTH, error_headers, parse_infer_header
from aiworks.gateway.tenancy_layer import request_limit
from aiworks.nearline.body import AsyncBody, take_async_flag
from aiworks.nearline.callbacks import HEADER as CALLBACK_HEADER
from aiworks.nearline.callbacks import check_callback_url
from aiworks.nearline.queue import AsyncQueue

ASYNC_TOKEN_SLACK_S = 60.0  # a queued request's work token outlives its deadline by this much

log = logging.getLogger(__name__)

_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_REQUEST_PATH = re.compile(r"/v2/requests/([A-Za-z0-9_]{1,64})")
_JSON = (b"content-type", b"application/json")
# The answer to ``"async": true`` on a gateway without the queue (settings: async_requests, redis_url).
ASYNC_OFF = ("'async': true asks for an asynchronous request, but this gateway queues none: set "
             "AIWORKS_GATEWAY_ASYNC_REQUESTS=true (with AIWORKS_GATEWAY_REDIS_URL), or drop the flag")  # fmt: skip


class Accepted(NamedTuple):
    """A queued request's answer: status, body, headers (ASGI pairs)."""

    status: int
    body: bytes
    headers: list


def _wants_async(scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"prefer" and b"respond-async" in value.lower():
            return True
    return False


class AsyncInferFront:
    """ASGI app in front of ``inner``: the two nearline routes, everything else passed through untouched."""

    def __init__(self, inner, dataplane: GatewayDataPlane, queue: AsyncQueue, max_request_bytes: int,
                 max_backlog: int, deadline_s: float = 0.5, max_backlog_per_tenant: int | None = None):  # fmt: skip
        self.inner = inner
        self.deadline_s = deadline_s
        self.dataplane = dataplane
        self.queue = queue
        self.max_request_bytes = max_request_bytes
        self.max_backlog = max_backlog
        # One tenant's share of the queue, so that its burst cannot fill it for the others (a tenant's own
        # max_async_backlog overrides it).
        self.max_backlog_per_tenant = max_backlog_per_tenant or max_backlog

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
            try:
                status, body, headers = await work
            except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis down, or every pooled connection busy
                log.warning("nearline queue store unavailable: %s", type(exc).__name__)
                raise Unavailable(
                    "the asynchronous queue's store is unreachable or busy; try again", retry_after_s=1.0
                ) from None
        except AIWorksError as exc:
            extra = [(k.lower().encode(), v.encode()) for k, v in (error_headers(exc) or {}).items()]
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
        self.dataplane.refuse_work_token(principal, "queue asynchronous requests")
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
        # The body's own "async" key, if any, is taken out here: it never reaches the queue.
        parsed = take_async_flag(body, headers.get(HEADER_LENGTH), self.dataplane.limits)
        return await self.accept(principal, headers, model, version, parsed)

    async def accept(self, principal, headers, model: str, version: str, parsed: AsyncBody) -> Accepted:
        """Queue an authorized request whose body has no ``async`` key left: 202, or the error that refuses it."""
        # The header now, so a malformed request is refused at once rather than queued.
        parse_infer_header(parsed.body, parsed.header_length, model, version, self.dataplane.limits)
        callback = (headers.get(CALLBACK_HEADER) or "").strip()
        if callback:
            check_callback_url(callback, getattr(principal.tenant, "callbacks", None))
        deadline_s = self.deadline_s
        if parsed.timeout_us:
            deadline_s = min(deadline_s, parsed.timeout_us / 1e6)
        total, own = await self.queue.depth(principal.tenant_id)
        if total >= self.max_backlog:
            raise ResourceExhausted(f"the asynchronous queue is full ({self.max_backlog} requests)", retry_after_s=1.0)
        cap = principal.tenant.max_async_backlog or self.max_backlog_per_tenant
        if principal.tenant_id and own >= cap:  # demo mode's anonymous tenant: the queue's bound alone
            raise ResourceExhausted(
                f"tenant '{principal.tenant_id}' already has {cap} asynchronous requests queued (max_async_backlog "
                "in the tenants file, else the setting async_max_backlog_per_tenant); more once some are answered",
                retry_after_s=1.0,
            )
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        request_id, _ = await self.queue.enqueue(
            principal.tenant_id, path, parsed.body,
            # A work token, sealed in the queue: it runs this request's inference only, until its deadline (a
            # worker never sends it later: the answer is then a stored 504), and a minute for clocks apart.
            work_credential(self.dataplane, principal, "async", model, deadline_s + ASYNC_TOKEN_SLACK_S),
            content_type=headers.get("content-type", "application/json"), header_length=parsed.header_length or "",
            deadline_s=deadline_s, callback=callback,
        )  # fmt: skip
        doc = orjson.dumps({"id": request_id, "status": "queued"})
        location = f"/v2/requests/{request_id}".encode()
        headers_out = [_JSON, (b"location", location)]
        if "respond-async" in (headers.get("prefer") or "").lower():  # applied only where it was asked for
            headers_out.append((b"preference-applied", b"respond-async"))
        return Accepted(202, doc, headers_out)

    async def _result(self, request_id: str, scope):
        principal = self.dataplane.authenticate(Headers(scope=scope))
        self.dataplane.refuse_work_token(principal, "read asynchronous results")
        if not request_id:  # the path's id is not one this gateway hands out: nothing to look up
            raise NotFound("no such request: a request id is up to 64 letters, digits and underscores (req_…)")
        record = await self.queue.get(request_id)
        if record is None or record["tenant"].decode() != principal.tenant_id:
            raise NotFound(f"no request '{request_id}' (results are kept for a limited time)")
        status = record["status"].decode()
        if status == "queued":
            return 202, orjson.dumps({"id": request_id, "status": status}), [_JSON]
        headers = [(b"content-type", record.get("content_type", b"application/json")),
                   (b"aiworks-request-status", status.encode())]  # fmt: skip
        if record.get("callback"):
            headers.append((b"aiworks-callback-status", record["callback"][:200]))
        if record.get("header_length"):
            headers.append((b"inference-header-content-length", record["header_length"]))
        return int(record["http_status"]), record["result"], headers
