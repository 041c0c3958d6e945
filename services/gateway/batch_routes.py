"""The OpenAI-style Batch API on the gateway (docs/tiers.md): routes translate and delegate to BatchService.

- ``POST /v1/files``: multipart upload (``purpose=batch``, ``file``), a File object;
- ``GET /v1/files`` (``limit``, ``order``, ``after``, ``purpose``), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content`` and ``DELETE /v1/files/{id}`` (refused while a job not ended reads it);
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
  ``GET /v1/batches`` (``limit``, ``after``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

Every route authenticates first; a tenant sees only its own files and jobs.
The batch runner sends a job's lines through this gateway with the
submitter's credential, so the tenant's models, limits and metering apply.
Without a batch file store or Redis the routes are not registered: 404, as
for any unknown path, and nothing about batches in the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from aiworks.batch.jobs import TOKEN_GRACE_S, JobStore, new_id, window_seconds
from aiworks.batch.service import BatchService, batch_object, check_window, parse_endpoint
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.multipart import PART_END, FormStream, Part, boundary_of
from aiworks.security.work_tokens import EndedWork

log = logging.getLogger(__name__)

_MAX_BATCH_BODY_BYTES = 64 * 1024


def _json(doc, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def work_credential(dataplane: GatewayDataPlane, principal, work: str, model: str, lifetime_s: float,
                    work_id: str = "") -> str | None:  # fmt: skip
    """What the runner or worker sends for this tenant: a work token the gateway mints now, as a bearer header.

    Never the caller's own API key or JWT (:mod:`aiworks.security.work_tokens`): the token runs inference of
    ``model`` only, expires with the work, and stops working when the submitting API key is revoked, or, for a
    batch job (``work_id``, the job's id), once the job has ended (:func:`watch_ended_jobs`). An
    anonymous caller's (demo mode) work keeps nothing, as nothing will check it. The stores seal it
    (``aiworks.security.sealing``)."""
    token = dataplane.tenancy.auth.mint_work_token(principal, work, model, lifetime_s, work_id)
    return f"Bearer {token}" if token else None


async def watch_ended_jobs(store: JobStore, ended: EndedWork, every_s: float = 1.0) -> None:
    """Keep ``ended`` (what the authenticator refuses) up to date with the jobs the store has ended, forever.

    Each read asks for the jobs ended since a minute before the latest end seen, so runners' clocks a little
    apart lose nothing; the first read takes every job whose token has not yet expired. Redis unreachable: the
    jobs already known stay refused, and the watch tries again (a warning, once, until it reads again)."""
    warned = False
    while True:
        try:
            while True:
                page = await store.ended_since(max(0.0, ended.read_to - 60.0))
                before = ended.read_to
                ended.note(page)
                if len(page) < store.ENDED_PAGE or ended.read_to <= before:
                    break
            if warned:
                log.info("reading ended batch jobs again (%d whose work tokens are refused)", len(ended))
                warned = False
        except Exception as exc:  # noqa: BLE001 - Redis away (or a reply not understood): the next read tries again
            if not warned:
                log.warning("cannot read ended batch jobs from Redis (%s): tokens of jobs ended since the last read "
                            "are still accepted until it can", exc)  # fmt: skip
                warned = True
        await asyncio.sleep(every_s)


def add_batch_routes(app: FastAPI, dataplane: GatewayDataPlane, batch: BatchService | None, max_file_bytes: int):
    """Register the Batch API's routes on ``app``; none when ``batch`` is None (not configured)."""
    if batch is None:
        return

    def caller(request: Request):
        principal = dataplane.authenticate(request.headers)
        dataplane.refuse_work_token(principal, "use the Batch or Files API")
        return principal, batch

    @app.post("/v1/files")
    async def upload_file(request: Request):
        principal, service = caller(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_file_bytes:
            raise PayloadTooLarge(f"file upload exceeds the limit of {max_file_bytes} bytes")
        return _json((await _stream_upload(request, principal.tenant_id, service, max_file_bytes)).public())

    @app.get("/v1/files")
    async def list_files(request: Request):
        principal, service = caller(request)
        query = request.query_params
        try:
            limit = int(query.get("limit", "10000"))
        except ValueError:
            raise InvalidArgument("limit must be an integer") from None
        files, more = await service.list_files(principal.tenant_id, limit=limit, after=query.get("after") or None,
                                               order=query.get("order", "desc"), purpose=query.get("purpose") or None)  # fmt: skip
        data = [f.public() for f in files]
        return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": more})  # fmt: skip

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        principal, service = caller(request)
        return _json(await service.delete_file(principal.tenant_id, file_id))

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
        # The token lives as long as the job may: its completion window, and a quarter of an hour for its last chunk.
        lifetime_s = window_seconds(check_window(doc.get("completion_window", "24h"))) + TOKEN_GRACE_S
        job_id = new_id("batch")  # the token names its job: it is refused once the job has ended
        job = await service.create_batch(
            tenant.id, doc, work_credential(dataplane, principal, "batch", model, lifetime_s, job_id),
            requests_per_second=tenant.requests_per_second, burst=tenant.bucket_size if tenant.requests_per_second else 0,
            job_id=job_id,
        )  # fmt: skip
        return _json(batch_object(job))

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        principal, service = caller(request)
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise InvalidArgument("limit must be an integer") from None
        jobs, more = await service.list(principal.tenant_id, limit, request.query_params.get("after") or None)
        data = [batch_object(j) for j in jobs]
        return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": more})  # fmt: skip

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        principal, service = caller(request)
        return _json(batch_object(await service.get(principal.tenant_id, batch_id)))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        principal, service = caller(request)
        return _json(batch_object(await service.cancel(principal.tenant_id, batch_id)))



_FIELD_BYTES = 1024  # the purpose field
_WRITE_BYTES = 1 << 20  # the file's bytes gathered before each write (in a worker thread)


async def _stream_upload(request: Request, tenant: str, service: BatchService, max_file_bytes: int):
    """The file of a ``POST /v1/files`` form written to the files store as the body arrives: the event loop
    parses (one boundary search a chunk) and a worker thread writes, a megabyte at a time, so one upload
    holds neither the loop nor the gateway's memory."""
    form = FormStream(boundary_of(request.headers.get("content-type", "")))
    purpose = bytearray()
    upload = None  # (file id, filename, sink) once the file part has begun
    current: str | None = None  # the part being read: "file", "purpose", or "" (another field, ignored)
    pending: list[bytes] = []
    waiting = total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_file_bytes:
                raise PayloadTooLarge(f"file upload exceeds the limit of {max_file_bytes} bytes")
            for event in form.feed(chunk):
                if isinstance(event, Part):
                    if event.name == "file":
                        if upload is not None:
                            raise InvalidArgument("multipart body has more than one 'file' field")
                        file_id, sink = await service.start_upload(tenant, event.filename or "")
                        upload = (file_id, event.filename or "", sink)
                        current = "file"
                    else:
                        current = "purpose" if event.name == "purpose" else ""
                elif event is PART_END:
                    current = None
                elif current == "file":
                    pending.append(event)
                    waiting += len(event)
                    if waiting >= _WRITE_BYTES:
                        await asyncio.to_thread(upload[2].write, b"".join(pending))
                        pending, waiting = [], 0
                elif current:  # purpose: small
                    purpose += event
                    if len(purpose) > _FIELD_BYTES:
                        raise InvalidArgument(f"form field 'purpose' exceeds {_FIELD_BYTES} bytes")
        form.finish()
        if upload is None:
            raise InvalidArgument("multipart body has no 'file' field")
        if pending:
            await asyncio.to_thread(upload[2].write, b"".join(pending))
    except BaseException:
        if upload is not None:
            await asyncio.to_thread(upload[2].abort)
        raise
    file_id, filename, sink = upload
    return await service.end_upload(tenant, file_id, filename, purpose.decode("utf-8", "replace").strip(), sink)
