"""The OpenAI-style Batch API on the gateway (docs/tiers.md): routes translate and delegate to BatchService.

- ``POST /v1/files``: multipart upload (``purpose=batch``, ``file``), a File object;
- ``GET /v1/files/{id}`` and ``GET /v1/files/{id}/content``;
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
  ``GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

Every route authenticates first; a tenant sees only its own files and jobs.
The batch runner sends a job's lines through this gateway with the
submitter's credential, so the tenant's models, limits and metering apply.
Without a batch file store or Redis the routes are not registered: 404, as
for any unknown path, and nothing about batches in the OpenAPI document.
"""

from __future__ import annotations

import email.parser
import email.policy

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from aiworks.batch.service import BatchService, batch_object, parse_endpoint
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.gateway.dataplane import GatewayDataPlane

_MAX_BATCH_BODY_BYTES = 64 * 1024


def _json(doc, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def caller_credential(headers) -> str | None:
    """What the runner sends for this tenant: the caller's own bearer token or API key, as a bearer header."""
    authorization = headers.get("authorization")
    if authorization:
        return authorization.strip()
    key = headers.get("x-api-key")
    return f"Bearer {key.strip()}" if key and key.strip() else None


def parse_upload(content_type: str, body: bytes) -> tuple[str, str, bytes]:
    """``(purpose, filename, file bytes)`` of a multipart/form-data body (standard library's MIME parser)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidArgument("POST /v1/files takes multipart/form-data with fields 'purpose' and 'file'")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise InvalidArgument("malformed multipart body")
    purpose, filename, data = "", "", None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name == "purpose":
            purpose = (part.get_payload(decode=True) or b"").decode("utf-8", "replace").strip()
        elif name == "file":
            filename = part.get_filename() or ""
            data = part.get_payload(decode=True) or b""
    if data is None:
        raise InvalidArgument("multipart body has no 'file' field")
    return purpose, filename, data


def add_batch_routes(app: FastAPI, dataplane: GatewayDataPlane, batch: BatchService | None, max_file_bytes: int):
    """Register the Batch API's routes on ``app``; none when ``batch`` is None (not configured)."""
    if batch is None:
        return

    def caller(request: Request):
        return dataplane.authenticate(request.headers), batch

    @app.post("/v1/files")
    async def upload_file(request: Request):
        principal, service = caller(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_file_bytes:
            raise PayloadTooLarge(f"file upload exceeds the limit of {max_file_bytes} bytes")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_file_bytes:
                raise PayloadTooLarge(f"file upload exceeds the limit of {max_file_bytes} bytes")
            chunks.append(chunk)
        purpose, filename, data = parse_upload(request.headers.get("content-type", ""), b"".join(chunks))
        record = await service.upload(principal.tenant_id, filename, purpose, data)
        return _json(record.public())

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        principal, service = caller(request)
        return _json((await service.file(principal.tenant_id, file_id)).public())

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        principal, service = caller(request)
        blocks, media_type = await service.content(principal.tenant_id, file_id)
        return StreamingResponse(blocks, media_type=media_type)  # a blocking iterator: Starlette reads it in a thread

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        principal, service = caller(request)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > _MAX_BATCH_BODY_BYTES:
                raise PayloadTooLarge(f"a batch request body is at most {_MAX_BATCH_BODY_BYTES} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"malformed JSON in request body: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("request body must be a JSON object")
        model, version = parse_endpoint(doc.get("endpoint", ""))
        dataplane.authorize(principal, model, version)
        tenant = principal.tenant
        job = await service.create_batch(
            tenant.id, doc, caller_credential(request.headers),
            requests_per_second=tenant.requests_per_second, burst=tenant.bucket_size if tenant.requests_per_second else 0,
        )  # fmt: skip
        return _json(batch_object(job))

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        principal, service = caller(request)
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise InvalidArgument("limit must be an integer") from None
        jobs = await service.list(principal.tenant_id, limit)
        data = [batch_object(j) for j in jobs]
        return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": False})  # fmt: skip

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        principal, service = caller(request)
        return _json(batch_object(await service.get(principal.tenant_id, batch_id)))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        principal, service = caller(request)
        return _json(batch_object(await service.cancel(principal.tenant_id, batch_id)))

