"""The Open Inference Protocol over HTTP (FastAPI): routes translate and delegate.

Every error leaves as OIP's ``{"error": "..."}`` with the HTTP status from the
one error table in :mod:`aiworks.core.errors`; a 401 carries
``WWW-Authenticate: Bearer``, a 429 ``Retry-After``.

Credentials (``authorization: Bearer <API key or JWT>`` or ``x-api-key``) are
checked before a request body is read; which routes need them is said in
:mod:`aiworks.gateway.dataplane`. ``GET /v2/usage`` is this gateway's own
extension: usage per tenant and model (docs/tenancy.md).

``POST …/infer``, the one hot route, is answered by :class:`InferFastPath`, a
plain ASGI app in front of FastAPI: under load, FastAPI's middleware stack,
routing and endpoint wrapping cost the gateway about 40 % of its CPU per
request. The FastAPI route stays, for OpenAPI and for any request the fast
path does not take; both call :func:`_infer`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Mapping

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.core.load_overrides import LoadOverrides, overrides_from_parameters
from aiworks.core.looplag import offload
from aiworks.core.names import NAME_RULE
from aiworks.gateway import generate
from aiworks.gateway.async_routes import ASYNC_OFF, Accepted, AsyncInferFront
from aiworks.gateway.batch_routes import add_batch_routes
from aiworks.gateway.compression import compress, inflate, request_encoding, response_encoding
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import read_body
from aiworks.gateway.http_codec import (
    HEADER_LENGTH,
    INFER_REQUEST_SCHEMA,
    encode_infer_response,
    error_headers,
    parse_infer_header,
)
from aiworks.gateway.metering import DEFAULT_USAGE_SPAN_S, parse_time
from aiworks.gateway.openai_routes import add_openai_routes, openai_error
from aiworks.gateway.shared_memory import store_outputs
from aiworks.gateway.stream_routes import StreamFront
from aiworks.gateway.telemetry import REQUEST_ID_HEADER
from aiworks.gateway.tenancy_layer import request_limit
from aiworks.nearline.body import mentions_async, take_async_flag

log = logging.getLogger(__name__)

# A load body this large (its files in base64) is parsed off the event loop.
_LARGE_LOAD_BODY = 1 << 20


def _json(doc, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, message: str, headers: dict | None = None) -> Response:
    return _json({"error": message}, status, headers)


async def _infer(
    dataplane: GatewayDataPlane,
    max_request_bytes: int,
    model: str,
    version: str,
    headers: Mapping[str, str],
    body_stream: AsyncIterator[bytes],
    submit_async=None,
) -> tuple[bytes, int | None, str | None] | Accepted:
    """One OIP inference over HTTP: (payload, its JSON header's length for binary data or None for JSON,
    the payload's Content-Encoding or None).

    A compressed request (``Content-Encoding``) is read within the caller's
    body limit, then inflated within it too (compression.py); the answer is
    compressed when ``Accept-Encoding`` asks for it. Header lengths count the
    decompressed bodies.

    A body whose JSON header holds ``"async"`` is parsed once more for the
    flag (aiworks.nearline.body): the key is removed, and when it is true the
    request goes to ``submit_async`` (:meth:`AsyncInferFront.accept`), whose
    202 is returned; without a queue that is a 400.
    """
    with dataplane.telemetry.infer("http", model, version, headers) as call:
        call.request_id = headers.get(REQUEST_ID_HEADER, "")
        principal = dataplane.authenticate(headers)  # before a byte of the body is read
        call.tenant = principal.tenant_id
        dataplane.authorize(principal, model, version)
        limit = request_limit(principal, max_request_bytes)
        encoding = request_encoding(headers.get("content-encoding"))
        body = await read_body(body_stream, headers.get("content-length"), limit, principal.tenant_id)
        if encoding is not None:
            body = await inflate(body, encoding, limit, principal.tenant_id)
        header_length = headers.get(HEADER_LENGTH)
        if mentions_async(body, header_length):
            parsed = take_async_flag(body, header_length, dataplane.limits)
            body, header_length = parsed.body, parsed.header_length
            if parsed.flag:
                if submit_async is None:
                    raise InvalidArgument(ASYNC_OFF)
                return await submit_async(principal, headers, model, version, parsed)
        # The header only: the data plane checks the caps on it, then has the tensor data decoded.
        registry, tenant = dataplane.shared_memory, principal.tenant_id
        call.request, fmt, pending = parse_infer_header(
            body, header_length, model, version, dataplane.limits,
            shm=lambda ref, where: registry.view(tenant, ref, where),
        )  # fmt: skip
        placements = registry.placements(tenant, fmt.shm) if fmt.shm else None
        call.response = response = await dataplane.infer(
            call.request, principal, pending, request_id=call.request_id, api="HTTP end point"
        )
        if placements:
            await store_outputs(response.outputs, placements)
        payload, header_length = encode_infer_response(response, fmt)
        answer_encoding = response_encoding(headers.get("accept-encoding"))
        if answer_encoding is None:
            return payload, header_length, None
        return await compress(payload, answer_encoding), header_length, answer_encoding


_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
# Routes whose path segments are model names and versions (checked by aiworks.core.names in the data plane).
_NAMED_PATHS = ("/v2/models/", "/v2/repository/models/")
_ENCODED_SEPARATOR = re.compile(rb"%(2f|5c)", re.IGNORECASE)
_JSON = [(b"content-type", b"application/json")]
_BINARY = (b"content-type", b"application/octet-stream")


class InferFastPath:
    """ASGI app: ``POST /v2/models/{model}[/versions/{version}]/infer`` straight to :func:`_infer`, the rest to ``app``.

    Same answers as the FastAPI route (errors through the one table, as
    ``{"error": ...}`` with their Retry-After or WWW-Authenticate), without
    FastAPI's per-request layers.
    """

    def __init__(self, app: FastAPI, dataplane: GatewayDataPlane, max_request_bytes: int):
        self.app = app
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes
        # AsyncInferFront.accept when asynchronous requests are on: where "async": true bodies go.
        self.submit_async = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if scope["path"].startswith(_NAMED_PATHS) and _ENCODED_SEPARATOR.search(scope.get("raw_path") or b""):
                # "%2F" decodes into the path and would no longer be one name: refuse rather than route it.
                message = "model name or version contains an encoded '/' or '\\'; names are " + NAME_RULE
                return await _send(send, 400, orjson.dumps({"error": message}), _JSON)
            if scope["method"] == "POST":
                match = _INFER_PATH.fullmatch(scope["path"])
                if match is not None:
                    return await self._infer(match[1], match[2] or "", scope, receive, send)
        await self.app(scope, receive, send)

    async def _infer(self, model: str, version: str, scope, receive, send) -> None:
        try:
            result = await _infer(
                self.dataplane, self.max_request_bytes, model, version, Headers(scope=scope), _body(receive),
                self.submit_async,
            )
        except ClientDisconnect:
            return  # nobody is left to answer
        except AIWorksError as exc:
            headers = error_headers(exc)
            extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()] if headers else []
            return await _send(send, exc.status.http, orjson.dumps({"error": exc.message}), _JSON + extra)
        except Exception as exc:  # noqa: BLE001 - answered, never silence
            log.exception("unhandled error in %s", scope["path"])
            return await _send(send, 500, orjson.dumps({"error": f"internal error: {type(exc).__name__}"}), _JSON)
        if isinstance(result, Accepted):
            return await _send(send, *result)
        payload, header_length, encoding = result
        if header_length is None:
            headers = _JSON
        else:
            headers = [_BINARY, (b"inference-header-content-length", b"%d" % header_length)]
        if encoding is not None:
            headers = [*headers, (b"content-encoding", encoding.encode())]
        return await _send(send, 200, payload, headers)


async def _body(receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _send(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def load_overrides_from_body(body: bytes) -> LoadOverrides:
    """A load request's JSON body (empty, or ``{"parameters": {...}}``) as its overrides."""
    if not body.strip():
        return LoadOverrides()
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"malformed JSON in request body: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("a load request's body must be a JSON object")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("a load request's 'parameters' must be a JSON object")
    return overrides_from_parameters(parameters, base64_files=True)


def trace_settings_from_json(doc: dict) -> dict[str, list[str] | None]:
    """Triton's HTTP trace settings (a string, a list of strings, or null to clear) as lists of strings."""
    updates: dict[str, list[str] | None] = {}
    for key, value in doc.items():
        if value is None or isinstance(value, list):
            items = value
        else:
            items = [value]
        if items is not None and not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in items):
            raise InvalidArgument(f"trace setting '{key[:64]}' must be a string or a list of strings")
        updates[key] = None if items is None else [str(v) for v in items]
    return updates


def trace_settings_to_json(settings: dict[str, list[str]]) -> dict:
    """As Triton answers: trace_level a list, every other setting a string."""
    return {k: v if k == "trace_level" else (v[0] if v else "") for k, v in settings.items()}


_CONTROL_BODY_BYTES = 64 * 1024


async def _small_json_body(request: Request):
    """A control call's small JSON body (at most 64 KiB)."""
    body = await read_body(request.stream(), request.headers.get("content-length"), _CONTROL_BODY_BYTES)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"malformed JSON in request body: {exc}") from None


def _time_param(request: Request, name: str) -> float | None:
    value = request.query_params.get(name)
    return None if value is None or value == "" else parse_time(value, name)


def create_app(
    dataplane: GatewayDataPlane, *, max_request_bytes: int, batch=None, batch_max_file_bytes: int = 512 << 20,
    nearline=None, nearline_max_backlog: int = 100_000, nearline_deadline_s: float = 0.5, streams=None,
    nearline_max_backlog_per_tenant: int | None = None,
):  # fmt: skip
    """The gateway's HTTP app: the FastAPI routes, with the infer fast path in front.

    ``batch``: the Batch API's :class:`aiworks.batch.service.BatchService`; ``nearline``: the
    :class:`aiworks.nearline.queue.AsyncQueue` of asynchronous requests; ``streams``: the gateway's
    :class:`aiworks.streams.subscription.Subscriptions` (shared with the gRPC front); None when not
    configured.
    """
    app = FastAPI(title="AIWorks gateway", description="KServe v2 / Open Inference Protocol", docs_url="/docs")

    def refusal(request: Request, status: int, message: str, headers: dict | None = None, code: str = "") -> Response:
        """An error in the protocol of the route asked: OpenAI's ``{"error": {"message", "type", ...}}`` under
        ``/v1/`` (the Batch, Files and generation APIs, which the ``openai`` client reads), OIP's otherwise."""
        if request.url.path.startswith("/v1/"):
            return openai_error(status, message, code, headers)
        return _error(status, message, headers)

    @app.exception_handler(AIWorksError)
    async def _aiworks_error(request: Request, exc: AIWorksError):
        # Inference failures are logged by the gateway's telemetry, inside the request's trace.
        if exc.status.http >= 500 and not request.url.path.endswith("/infer"):
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status.http, exc.message)
        return refusal(request, exc.status.http, exc.message, error_headers(exc), exc.status.name.lower())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return refusal(request, 400, f"invalid request: {exc.errors()}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return refusal(request, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Starlette logs the traceback after this answer; the body names the failure, in the route's protocol.
        return refusal(request, 500, f"internal error: {type(exc).__name__}", code="internal")

    # ---- health and metadata ----------------------------------------------------------

    @app.get("/v2/health/live")
    async def live():
        return _json({"live": True})

    @app.get("/v2/health/ready")
    async def ready():
        ok = await dataplane.ready()
        return _json({"ready": ok}, 200 if ok else 503)

    @app.get("/v2")
    async def server_metadata():
        return _json(dataplane.server_metadata())

    @app.get("/v2/models/stats")
    async def all_stats(request: Request):
        return _json({"model_stats": await dataplane.statistics("", "", request.headers)})

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, request: Request, version: str = ""):
        return _json(await dataplane.model_metadata(model, version, request.headers))

    @app.get("/v2/models/{model}/config")
    @app.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, request: Request, version: str = ""):
        return _json(await dataplane.model_config(model, version, request.headers))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, request: Request, version: str = ""):
        ok = await dataplane.model_ready(model, version, request.headers)
        return _json({"name": model, "ready": ok}, 200 if ok else 503)

    @app.get("/v2/models/{model}/stats")
    @app.get("/v2/models/{model}/versions/{version}/stats")
    async def model_stats(model: str, request: Request, version: str = ""):
        return _json({"model_stats": await dataplane.statistics(model, version, request.headers)})

    # ---- inference ------------------------------------------------------------------------

    infer_body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": INFER_REQUEST_SCHEMA},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }

    @app.post("/v2/models/{model}/infer", openapi_extra=infer_body)
    @app.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=infer_body)
    async def infer(model: str, request: Request, version: str = ""):
        """Answered by InferFastPath in front of this app; the same :func:`_infer` here."""
        args = (dataplane, max_request_bytes, model, version, request.headers, request.stream())
        result = await _infer(*args)
        if isinstance(result, Accepted):  # not reached: InferFastPath answers these paths first
            headers = {k.decode(): v.decode() for k, v in result.headers}
            return Response(result.body, status_code=result.status, headers=headers)
        payload, header_length, encoding = result
        headers = {} if encoding is None else {"Content-Encoding": encoding}
        if header_length is None:
            return Response(payload, media_type="application/json", headers=headers)
        headers["Inference-Header-Content-Length"] = str(header_length)
        return Response(payload, media_type="application/octet-stream", headers=headers)

    # ---- generation (Triton's generate extension; aiworks.gateway.generate) --------------------

    @app.post("/v2/models/{model}/generate")
    @app.post("/v2/models/{model}/versions/{version}/generate")
    async def generate_once(model: str, request: Request, version: str = ""):
        running = await generate.start(dataplane, max_request_bytes, model, version, request.headers, request.stream())
        try:
            return _json(await generate.generate_once(running, request.receive))
        except generate.ClientGone:
            return Response(status_code=generate.CLIENT_GONE_STATUS)

    @app.post("/v2/models/{model}/generate_stream")
    @app.post("/v2/models/{model}/versions/{version}/generate_stream")
    async def generate_stream(model: str, request: Request, version: str = ""):
        running = await generate.start(dataplane, max_request_bytes, model, version, request.headers, request.stream())
        first, rest = await generate.first_and_rest(running)  # an error before the first piece: a JSON error
        return StreamingResponse(generate.sse_events(first, rest), media_type="text/event-stream; charset=utf-8")

    add_openai_routes(app, dataplane, max_request_bytes)  # /v1/models, /v1/completions, /v1/chat/completions

    # ---- model repository -----------------------------------------------------------------

    @app.post("/v2/repository/index")
    async def repository_index(request: Request):
        dataplane.authenticate(request.headers)  # before the body; the data plane filters by tenant
        body = await read_body(request.stream(), request.headers.get("content-length"), max_request_bytes)
        ready_only = False
        if body.strip():
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise InvalidArgument(f"malformed JSON in request body: {exc}") from None
            ready_only = bool(isinstance(doc, dict) and doc.get("ready"))
        return _json(await dataplane.repository_index(ready_only, request.headers))

    @app.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request):
        """Triton's load; the body's ``parameters`` may carry ``config`` and ``file:<path>`` (base64) overrides."""

        async def overrides() -> LoadOverrides:  # read only once the caller is known to be an admin
            body = await read_body(request.stream(), request.headers.get("content-length"), max_request_bytes)
            return await offload(load_overrides_from_body, body, large=len(body) > _LARGE_LOAD_BODY)  # base64 decoding

        await dataplane.load(model, request.headers, overrides)
        return _json({})

    @app.post("/v2/repository/models/{model}/unload")
    async def unload(model: str, request: Request):
        await dataplane.unload(model, request.headers)
        return _json({})

    # ---- trace and log settings (Triton's trace and logging extensions) --------------------------------

    async def _json_body(request: Request) -> dict:
        dataplane.authenticate(request.headers)  # before the body
        body = await read_body(request.stream(), request.headers.get("content-length"), max_request_bytes)
        try:
            doc = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"malformed JSON in request body: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the request body must be a JSON object of settings")
        return doc

    @app.get("/v2/trace/setting")
    @app.get("/v2/models/{model}/trace/setting")
    async def trace_settings(request: Request, model: str = ""):
        return _json(trace_settings_to_json(await dataplane.trace_settings(model, request.headers)))

    @app.post("/v2/trace/setting")
    @app.post("/v2/models/{model}/trace/setting")
    async def update_trace_settings(request: Request, model: str = ""):
        updates = trace_settings_from_json(await _json_body(request))
        return _json(trace_settings_to_json(await dataplane.update_trace_settings(model, updates, request.headers)))

    @app.get("/v2/logging")
    async def log_settings(request: Request):
        return _json(await dataplane.log_settings(request.headers))

    @app.post("/v2/logging")
    async def update_log_settings(request: Request):
        return _json(await dataplane.update_log_settings(await _json_body(request), request.headers))

    # ---- system shared memory (docs/triton.md); CUDA shared memory is refused -----------------------

    @app.get("/v2/systemsharedmemory/status")
    @app.get("/v2/systemsharedmemory/region/{region}/status")
    async def shm_status(request: Request, region: str = ""):
        return _json(await dataplane.shm_status(region, request.headers))

    @app.post("/v2/systemsharedmemory/region/{region}/register")
    async def shm_register(region: str, request: Request):
        dataplane.authenticate(request.headers)  # before the body
        doc = await _small_json_body(request)
        if not isinstance(doc, dict) or not all(k in doc for k in ("key", "offset", "byte_size")):
            raise InvalidArgument("register needs a JSON object with 'key', 'offset' and 'byte_size'")
        await dataplane.shm_register(region, doc["key"], doc["offset"], doc["byte_size"], request.headers)
        return _json({})

    @app.post("/v2/systemsharedmemory/unregister")
    @app.post("/v2/systemsharedmemory/region/{region}/unregister")
    async def shm_unregister(request: Request, region: str = ""):
        await dataplane.shm_unregister(region, request.headers)
        return _json({})

    @app.get("/v2/cudasharedmemory/status")
    @app.get("/v2/cudasharedmemory/region/{region}/status")
    async def cuda_shm_status(request: Request, region: str = ""):
        return _json(dataplane.cuda_shm("status", region, request.headers))

    @app.post("/v2/cudasharedmemory/region/{region}/register")
    async def cuda_shm_register(request: Request, region: str):
        dataplane.cuda_shm("register", region, request.headers)

    @app.post("/v2/cudasharedmemory/unregister")
    @app.post("/v2/cudasharedmemory/region/{region}/unregister")
    async def cuda_shm_unregister(request: Request, region: str = ""):
        dataplane.cuda_shm("unregister", region, request.headers)
        return _json({})

    # ---- usage (docs/tenancy.md) ----------------------------------------------------------------

    @app.get("/v2/usage")
    async def usage(request: Request):
        """?start=&end= (ISO 8601 or epoch seconds; default the last 24 h), &tenant=, &model=."""
        end = _time_param(request, "end")
        start = _time_param(request, "start")
        if start is None:
            start = (time.time() if end is None else end) - DEFAULT_USAGE_SPAN_S
        query = request.query_params
        report = await dataplane.usage(
            request.headers, start=start, end=end, tenant=query.get("tenant") or None, model=query.get("model") or None
        )
        return _json(report)

    add_batch_routes(app, dataplane, batch, batch_max_file_bytes)  # /v1/files, /v1/batches (docs/tiers.md)

    app.openapi()  # built once now, not on the event loop of the first request that asks for it
    front = fast = InferFastPath(app, dataplane, max_request_bytes)
    if nearline is not None:
        front = AsyncInferFront(front, dataplane, nearline, max_request_bytes, nearline_max_backlog,
                                nearline_deadline_s, nearline_max_backlog_per_tenant)  # docs/tiers.md  # fmt: skip
        fast.submit_async = front.accept
    if streams is not None:
        front = StreamFront(front, dataplane, streams)  # GET /v2/streams/{name}, docs/tiers.md
    return front
