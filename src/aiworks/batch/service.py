"""The Batch API's logic, transport-agnostic: files, job submission, status and cancel, per tenant.

The gateway's routes (``aiworks.gateway.batch_routes``) authenticate the
caller and delegate here. A tenant sees only its own files and jobs: another
tenant's id answers 404 exactly as an unknown id does. Objects follow
OpenAI's Batch and File shapes; storage locations never leave the server.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

from aiworks.batch import objects, tables
from aiworks.batch.jobs import CANCELLABLE, TERMINAL, FileRecord, Job, JobStore, new_id, window_seconds
from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, ResourceExhausted, Status, Unavailable
from aiworks.core.names import check_model_name, check_version

MAX_CHUNK_SIZE = 10_000
_ENDPOINT = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_WINDOW = re.compile(r"([1-9][0-9]{0,3})h")
_STORED_NAME = re.compile(r"[^A-Za-z0-9._-]")


def parse_endpoint(endpoint: str) -> tuple[str, str]:
    """``/v2/models/{model}[/versions/{version}]/infer`` as (model, version)."""
    match = _ENDPOINT.fullmatch(endpoint or "")
    if match is None:
        raise InvalidArgument(f"endpoint must be /v2/models/{{model}}[/versions/{{version}}]/infer, not '{endpoint}'")
    model, version = match[1], match[2] or ""
    check_model_name(model)
    check_version(version)
    return model, version


def check_window(window: str) -> str:
    if not isinstance(window, str) or _WINDOW.fullmatch(window) is None:
        raise InvalidArgument(f"completion_window must be a number of hours such as '24h', not '{window}'")
    return window


def _count_lines(url: str, form: str = "jsonl", input_columns: dict | None = None) -> int:
    """Lines (Parquet: rows) of an input file, as the runner will cut it (a final newline ends the last line)."""
    if form == "parquet":
        return tables.check_input(url, input_columns or {})
    return objects.count_lines(url)


def batch_object(job: Job) -> dict:
    """OpenAI's Batch object for ``job`` (times in epoch seconds, absent ones null)."""

    def stamp(value: float) -> int | None:
        return int(value) if value else None

    endpoint = job.infer_path
    return {
        "id": job.id, "object": "batch", "endpoint": endpoint, "errors": (
            {"object": "list", "data": [{"code": "job_failed", "message": job.error}]} if job.error else None
        ),
        "input_file_id": job.input_file_id or None, "completion_window": job.completion_window,
        "status": job.status, "output_file_id": job.output_file_id or None, "error_file_id": job.error_file_id or None,
        "created_at": stamp(job.created_at), "in_progress_at": stamp(job.in_progress_at),
        "expires_at": stamp(job.expires_at),
        "finalizing_at": stamp(job.finalizing_at), "completed_at": stamp(job.completed_at),
        "failed_at": stamp(job.failed_at), "expired_at": stamp(job.expired_at),
        "cancelling_at": stamp(job.cancelling_at),
        "cancelled_at": stamp(job.cancelled_at),
        "request_counts": {"total": job.total, "completed": job.completed, "failed": job.failed},
        "metadata": job.metadata or None,
        # Beyond OpenAI's shape: chunk progress, for progress bars.
        "chunks": {"total": job.chunks_total, "done": job.chunks_done, "size": job.chunk_size},
    }  # fmt: skip


def check_metadata(metadata) -> dict:
    """A batch's ``metadata`` as OpenAI's Batch API defines it: at most 16 pairs, keys of at most 64 characters,
    string values of at most 512; anything else a 400 naming what."""
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise InvalidArgument("metadata must be an object of at most 16 key-value pairs")
    for key, value in metadata.items():
        if len(key) > 64:
            raise InvalidArgument(f"metadata key '{key[:64]}…' is longer than 64 characters")
        if not isinstance(value, str) or len(value) > 512:
            raise InvalidArgument(f"metadata value of '{key}' must be a string of at most 512 characters")
    return metadata


class BatchService:
    """Files and jobs of every tenant, kept apart; ``files_url`` is where uploads and results are written."""

    def __init__(self, store: JobStore, files_url: str | None, *, chunk_size: int = 100, max_active_jobs: int = 10):
        self.store = store
        self.max_active_jobs = max_active_jobs
        self.files_url = files_url.rstrip("/") if files_url else None
        self.chunk_size = chunk_size

    def _where(self, tenant: str, name: str) -> str:
        if self.files_url is None:
            raise Unavailable("the Batch API has no file store (AIWORKS_GATEWAY_BATCH_FILES_URL is unset)")
        return f"{self.files_url}/{_STORED_NAME.sub('_', tenant) or '_anonymous'}/{name}"

    # ---- files -------------------------------------------------------------------------------------------

    async def start_upload(self, tenant: str, filename: str) -> tuple[str, objects.Sink]:
        """A new file's id and the sink its bytes are written to, as they arrive; then :meth:`end_upload`
        (or the sink's ``abort``)."""
        file_id = new_id("file")
        url = self._where(tenant, f"{file_id}.{tables.format_of(filename or '')}")
        return file_id, await asyncio.to_thread(objects.Sink, url)

    async def end_upload(self, tenant: str, file_id: str, filename: str, purpose: str, sink: objects.Sink) -> FileRecord:
        """Keep the upload (its purpose checked now: a form may send it after the file), or drop it."""
        if purpose != "batch":
            await asyncio.to_thread(sink.abort)
            raise InvalidArgument(f"purpose must be 'batch', not '{purpose[:40]}'")
        size = await asyncio.to_thread(sink.commit)
        name = (filename or "upload.jsonl")[:256]
        return await self.store.add_file(FileRecord(file_id, tenant, name, purpose, sink.url, size, lines=sink.lines))

    async def file(self, tenant: str, file_id: str) -> FileRecord:
        record = await self.store.get_file(file_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"no file '{file_id[:80]}'")
        return record

    async def content(self, tenant: str, file_id: str) -> tuple[Iterator[bytes], str]:
        """The file's bytes, in blocks read as they are taken (a blocking iterator: serve it from a thread),
        and its media type (JSONL or Parquet, by its name). A file gone from storage is refused here, before
        any byte is sent."""
        record = await self.file(tenant, file_id)
        if not await asyncio.to_thread(objects.exists, record.url):
            raise NotFound(f"file '{file_id[:80]}' is no longer in storage")
        return objects.blocks(record.url), tables.MEDIA_TYPES[tables.format_of(record.filename)]

    async def list_files(self, tenant: str, *, limit: int = 10_000, after: str | None = None, order: str = "desc",
                         purpose: str | None = None) -> tuple[list[FileRecord], bool]:  # fmt: skip
        """A page of the tenant's files, as OpenAI's ``GET /v1/files`` (limit 1-10,000, ``order`` by creation
        time, ``after`` a file id of the previous page, ``purpose`` a filter), and whether more follow."""
        if not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit must be between 1 and 10000, not {limit}")
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"order must be 'asc' or 'desc', not '{order[:20]}'")
        page: list[FileRecord] = []
        cursor = after
        step = max(limit + 1, 1000)  # a purpose filter may skip records: read on, a thousand at least a time
        while True:
            records = await self.store.list_files(tenant, step, after=cursor, ascending=order == "asc")
            for record in records:
                if purpose is None or record.purpose == purpose:
                    page.append(record)
                    if len(page) > limit:
                        return page[:limit], True
            if len(records) < step:
                return page, False
            cursor = records[-1].id

    async def delete_file(self, tenant: str, file_id: str) -> dict:
        """Remove one of the tenant's files from storage and the list; refused while a job not yet ended reads
        it (a job that resumes after a crash reads its input again)."""
        record = await self.file(tenant, file_id)
        for job_id in await self.store.active_ids(tenant):
            job = await self.store.get(job_id)
            if job is not None and job.input_file_id == record.id and job.status not in TERMINAL:
                raise AIWorksError(f"file '{record.id}' is the input of batch '{job.id}', which is {job.status}: "
                                   "cancel it or let it end first", Status.FAILED_PRECONDITION)  # fmt: skip
        await asyncio.to_thread(objects.delete, record.url)  # a missing object is no error: a retry ends the same
        await self.store.delete_file(record)
        return {"id": record.id, "object": "file", "deleted": True}

    # ---- jobs ------------------------------------------------------------------------------------------

    async def create_batch(self, tenant: str, body: dict, credential: str | None, *,
                           requests_per_second: float | None = None, burst: int = 0,
                           job_id: str | None = None) -> Job:  # fmt: skip
        """``POST /v1/batches``: ``input_file_id``, ``endpoint``, ``completion_window``, optional ``metadata``.

        Parquet input (:mod:`aiworks.batch.tables`): ``format`` (``jsonl`` or
        ``parquet``; by default the uploaded file name's extension) and
        ``input_columns``. A Parquet job's output file is Parquet too.

        ``requests_per_second`` and ``burst``: the tenant's request rate, when
        it has one. A job with more lines than that rate lets through in its
        completion window could never finish in time: it is refused here (429).

        ``job_id``: the id the gateway minted the job's work token for (a new one when not given).
        """
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise InvalidArgument("input_file_id is required")
        model, version = parse_endpoint(body.get("endpoint", ""))
        window = check_window(body.get("completion_window", "24h"))
        metadata = check_metadata(body.get("metadata") or {})
        chunk_size = body.get("chunk_size", self.chunk_size)
        record = await self.file(tenant, file_id)
        form = tables.format_of(record.filename, body.get("format"))
        input_columns = body.get("input_columns")
        if requests_per_second:
            await self._check_rate(tenant, record.url, window, requests_per_second, burst, form, input_columns,
                                   known_lines=record.lines if form == "jsonl" else -1)  # fmt: skip
        job_id = job_id or new_id("batch")
        return await self.submit(
            tenant, model, record.url, self._where(tenant, f"{job_id}/output.{form}"),
            self._where(tenant, f"{job_id}/errors.jsonl"), version=version, chunk_size=chunk_size,
            credential=credential, metadata=metadata, completion_window=window, input_file_id=file_id, job_id=job_id,
            format=form, input_columns=input_columns,
        )  # fmt: skip

    @staticmethod
    async def _check_rate(tenant: str, url: str, window: str, requests_per_second: float, burst: int,
                          form: str = "jsonl", input_columns: object = None, *, known_lines: int = -1) -> None:  # fmt: skip
        """429 for a job the tenant's rate could not finish in its window. ``known_lines``: a JSONL upload's
        lines, counted as it arrived (the file is not read again); -1 reads the file to count them."""
        window_s = window_seconds(window)
        allowed = int(burst + requests_per_second * window_s)
        columns = tables.check_mapping(input_columns) if form == "parquet" else None
        lines = known_lines if known_lines >= 0 else await asyncio.to_thread(_count_lines, url, form, columns)
        if lines > allowed:
            raise ResourceExhausted(
                f"the job has {lines} lines, more than tenant '{tenant}' may send in its completion window "
                f"({window}): requests_per_second {requests_per_second:g} x {window_s} s + burst {burst} = "
                f"{allowed} requests (rule: the tenant's requests_per_second); split the job or ask for a "
                "higher rate"
            )

    async def submit(self, tenant: str, model: str, input_url: str, output_url: str, error_url: str, *,
                     version: str = "", chunk_size: int | None = None, credential: str | None = None,
                     metadata: dict | None = None, completion_window: str = "24h", input_file_id: str = "",
                     job_id: str | None = None, format: str | None = None,
                     input_columns: object = None) -> Job:  # fmt: skip
        """A new job, queued for a runner; a missing input file is refused here, not discovered later.

        ``format``: ``jsonl`` or ``parquet``, by default ``input_url``'s
        extension. A Parquet input's columns are checked against
        ``input_columns`` here (a 400 names a missing column), from the
        file's footer.
        """
        form = tables.format_of(input_url, format)
        columns = tables.check_mapping(input_columns)
        if columns and form != "parquet":
            raise InvalidArgument("input_columns applies to Parquet input only")
        check_model_name(model)
        check_version(version)
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidArgument(f"chunk_size must be an integer from 1 to {MAX_CHUNK_SIZE}")
        for url in (input_url, output_url, error_url):
            objects.check_url(url)
        if await self.store.active_count(tenant) >= self.max_active_jobs:
            raise ResourceExhausted(
                f"tenant '{tenant}' already has {self.max_active_jobs} batch jobs not yet ended "
                "(batch_max_active_jobs); wait for one to end or cancel one", retry_after_s=30.0,
            )  # fmt: skip
        if not await asyncio.to_thread(objects.exists, input_url):
            raise NotFound("input file does not exist" + ("" if input_file_id else f": {input_url}"))
        if form == "parquet":
            await asyncio.to_thread(tables.check_input, input_url, columns)
        job = Job(
            id=job_id or new_id("batch"), tenant=tenant, model=model, version=version, input_url=input_url,
            output_url=output_url, error_url=error_url, chunk_size=chunk_size, metadata=metadata or {},
            completion_window=completion_window, input_file_id=input_file_id, created_at=time.time(), format=form,
            input_columns=columns,
        )  # fmt: skip
        return await self.store.create(job, credential)

    async def get(self, tenant: str, job_id: str) -> Job:
        job = await self.store.get(job_id)
        if job is None or job.tenant != tenant:
            raise NotFound(f"no batch '{job_id[:80]}'")
        return job

    async def list(self, tenant: str, limit: int = 20, after: str | None = None) -> tuple[list[Job], bool]:
        """A page of the tenant's jobs, newest first, as OpenAI's ``GET /v1/batches`` (limit 1-100, ``after`` a
        batch id of the previous page), and whether more follow."""
        if not 1 <= limit <= 100:
            raise InvalidArgument(f"limit must be between 1 and 100, not {limit}")
        jobs = await self.store.list(tenant, limit + 1, after=after)
        return jobs[:limit], len(jobs) > limit

    async def cancel(self, tenant: str, job_id: str) -> Job:
        job = await self.get(tenant, job_id)
        if job.status in CANCELLABLE:
            await self.store.request_cancel(job.id)
        elif job.status not in TERMINAL and job.status != "cancelling":
            raise InvalidArgument(f"batch '{job.id}' is {job.status} and can no longer be cancelled")
        return await self.get(tenant, job_id)
