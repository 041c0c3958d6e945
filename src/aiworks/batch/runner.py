"""The batch runner: takes jobs from Redis and sends their lines to the gateway as ``batch``-class requests.

The runner is a client of the gateway's public HTTP API, so the job's
tenant is authenticated, limited and metered like any caller, and the
scheduler serves its requests after online traffic (docs/scheduler.md).

A runner takes the job whose tenant had a turn least recently, and keeps
it at most ``turn_s`` while another job waits for a runner: then it records
the chunks in flight and lets the job go, to be resumed at a later turn.

A job is cut into chunks of ``chunk_size`` input lines, fixed by the input
alone. The runner keeps two chunks in flight: the next chunk's lines queue
behind the current one's, so they take the places its last requests leave
and the pipe stays full across chunks. At most ``concurrency`` requests are
in flight in all (fewer while online traffic is about:
:mod:`aiworks.batch.pacing` paces them on the runtimes' ``online_load``
signal and the 429/503 answers the runner sees). Chunks are recorded in
input order, as soon as it and the ones before it are answered: the chunk's
output and error lines are written to the job's storage first, as a part
next to the output file (``<output>.parts/``), then the part's name is
recorded in Redis (:meth:`JobStore.record_chunk`), with the counts, at
once. A runner that dies loses only the chunks in flight (at most two):
once its lease expires another runner (or the same one restarted) takes the
job, skips the recorded chunks and sends those again. Cancel is checked
after each chunk is recorded; once the job is cancelling, the chunk still in
flight is dropped (its answered lines are not kept), so at most one chunk
is recorded after the cancel: the job stops within one chunk. When every
chunk is in, the runner writes the output file (one line per successful
input line, in input order) and the error file (one line per refused or
failed input line, with its line number and reason), copying the parts in
order, one at a time, and then removes the parts (a job ended by a runner
that died before removing them is swept by an idle runner). A Parquet
job (:mod:`aiworks.batch.tables`) is read one chunk of rows at a time and its
output file is a Parquet table; its chunks are recorded as JSONL all the same.

Memory does not grow with the job: a JSONL input is mapped
(:func:`objects.mapped`), with 8 bytes kept per line
(:class:`~aiworks.batch.lines.LineIndex`); at most two chunks' lines and
answers are held; the output files are written through a file on disk
(:func:`objects.sink`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator

import aiohttp
import orjson

from aiworks.batch import answers, job_files, objects, packing
from aiworks.batch.jobs import TERMINAL, FileRecord, Job, JobStore, part_name
from aiworks.batch.lines import Line, chunk_bounds
from aiworks.batch.pacing import PacedGate, Pacer
from aiworks.batch.settings import BatchSettings
from aiworks.core.errors import AIWorksError, InvalidArgument, Status
from aiworks.core.metrics import BATCH_CHUNKS, BATCH_JOB_PAUSES, BATCH_JOBS_FINISHED, BATCH_ROWS
from aiworks.security.sealing import SealError

log = logging.getLogger(__name__)

_TRANSIENT = (429, 502, 503, 504)
_OVERLOAD = (429, 503)  # answers that say the suite is busy: the pacer backs off
_CHUNKS_IN_FLIGHT = 2  # the next chunk's lines queue behind the current one's, so its tail does not drain the pipe



class LeaseLost(Exception):
    """Another runner holds the job now."""


class StorageUnavailable(Exception):
    """The job's input or output store cannot be reached now (after its own tries): the job pauses, its lease
    released and its finished chunks kept, and resumes on a later poll; past its completion window it fails."""


# A paused job is tried again after this long, doubling while its store stays down, up to the maximum.
_PAUSE_FIRST_S, _PAUSE_MAX_S = 2.0, 60.0


class BatchRunner:
    """Runs batch jobs one at a time; several runners share the jobs through their leases."""

    def __init__(self, store: JobStore, settings: BatchSettings, *, runner_id: str | None = None,
                 on_chunk: Callable[[Job, int], None] | None = None):  # fmt: skip
        self.store = store
        self.settings = settings
        self.runner_id = runner_id or f"runner-{uuid.uuid4().hex[:12]}"
        self.on_chunk = on_chunk
        self.base_url = settings.gateway_url.rstrip("/")
        self._client: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection per request: retries after a 401
        self.seen: dict[str, Job] = {}  # jobs not yet ended, as last read (metrics)
        # Jobs whose credential the gateway refused (401: the submitting API key revoked, the tenant removed, the
        # token past its window): why. Every further line would be refused the same, so the job stops.
        self.refused: dict[str, str] = {}
        # Jobs paused on their store (StorageUnavailable): when to try again, and the wait after that.
        self.paused: dict[str, tuple[float, float]] = {}
        self._rows_ok, self._rows_failed = BATCH_ROWS.labels("ok"), BATCH_ROWS.labels("failed")
        self.pacer = Pacer(settings.concurrency, tolerance=settings.latency_tolerance, decrease=settings.backoff_factor,
                           adaptive=settings.adaptive, floor=min(settings.min_in_flight, settings.concurrency))  # fmt: skip
        self._gate = PacedGate(self.pacer)  # one for the runner's life: what it learnt holds across chunks and jobs

    def _session(self, force_close: bool = False) -> aiohttp.ClientSession:
        ssl_context = None
        if self.settings.ca_file:
            import ssl

            ssl_context = ssl.create_default_context(cafile=self.settings.ca_file)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.settings.concurrency, ssl=ssl_context, force_close=force_close),
            timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s),
        )

    @property
    def client(self) -> aiohttp.ClientSession:
        """One HTTP session for the runner's life, made on its event loop at first use."""
        if self._client is None:
            self._client = self._session()
        return self._client

    @property
    def fresh_client(self) -> aiohttp.ClientSession:
        """A session that opens a new connection for each request (and closes it after): a try after a 401
        reaches the gateway through a new connection, so a load balancer may send it to another replica."""
        if self._fresh is None:
            self._fresh = self._session(force_close=True)
        return self._fresh

    async def close(self) -> None:
        for session in (self._client, self._fresh):
            if session is not None:
                await session.close()

    async def run_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                worked = await self.run_once()
            except Exception:  # noqa: BLE001 - the runner outlives one job's trouble, and says so
                log.exception("batch runner: a job failed to run; trying again later")
                worked = False
            if not worked:
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.poll_interval_s)
                except TimeoutError:
                    pass

    async def run_once(self) -> bool:
        """Run one job nobody holds; False when there was none."""
        active = await self.store.active_ids()
        seen = {}
        for job_id in active:
            job = await self.store.get(job_id)
            if job is not None:
                seen[job_id] = job
        self.seen = seen
        now = time.monotonic()
        turns = await self.store.turns()
        # Turns: the tenant whose job last got a runner longest ago first, then its job taken least recently.
        order = sorted(seen.values(), key=lambda j: (turns.get(j.tenant, 0.0), j.turn_at, j.created_at, j.id))
        for job in order:
            job_id = job.id
            if self.paused.get(job_id, (0.0, 0.0))[0] > now:
                continue  # its store was down a moment ago; other jobs go first
            if await self.store.claim(job_id, self.runner_id, self.settings.lease_ttl_s):
                try:
                    await self.store.took_turn(job)
                    await self.run_job(job_id)
                except StorageUnavailable as exc:
                    wait = min(self.paused.get(job_id, (0.0, _PAUSE_FIRST_S / 2))[1] * 2, _PAUSE_MAX_S)
                    self.paused[job_id] = now + wait, wait
                    BATCH_JOB_PAUSES.inc()
                    log.warning("batch job %s paused: %s; its finished chunks are kept, and it resumes in %.0f s "
                                "or on another runner", job_id, exc, wait)  # fmt: skip
                    return False  # nothing done: the runner waits a poll
                finally:
                    await self.store.release(job_id, self.runner_id)
                self.paused.pop(job_id, None)
                return True
        await self._sweep()  # nothing to run: tidy one ended job's leftovers (one a poll)
        return False

    async def run_job(self, job_id: str) -> None:
        """Run (or resume) one job this runner has claimed, to its end or until cancelled."""
        job = await self.store.get(job_id)
        if job is None or job.status in TERMINAL:
            return
        renewer = asyncio.create_task(self._renew(job_id))
        try:
            await self._run(job)
        except LeaseLost:
            log.warning("batch job %s: lease lost to another runner; leaving it", job_id)
        finally:
            renewer.cancel()

    async def _renew(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_ttl_s / 3)
            try:
                await self.store.renew(job_id, self.runner_id, self.settings.lease_ttl_s)
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again; record_chunk checks the lease
                log.warning("batch job %s: lease renewal failed: %s", job_id, exc)

    async def _run(self, job: Job) -> None:
        with contextlib.ExitStack() as inputs:  # the mapped input until the end
            try:
                total, chunks = await asyncio.to_thread(job_files.open_input, job, inputs)
            except AIWorksError as exc:
                await self._unreadable(job, exc)
                return
            await self._run_chunks(job, total, chunks)

    async def _run_chunks(self, job: Job, total: int, chunks: Iterator[Callable[[], list[Line]]]) -> None:
        bounds = chunk_bounds(total, job.chunk_size)
        fields = {"total": total, "chunks_total": len(bounds)}
        if job.status == "validating":
            fields |= {"status": "in_progress", "in_progress_at": time.time()}
        await self.store.update(job.id, **fields)
        done = await self.store.done_chunks(job.id)
        for index, (out, err) in (await self.store.inline_chunks(job.id)).items():  # recorded before parts
            part = part_name(index, "inline", bool(out), bool(err))
            await asyncio.to_thread(job_files.write_part, job, part, out, err)
            await self.store.replace_inline(job.id, index, part)
        try:
            credential = await self.store.credential(job.id)
        except SealError as exc:  # a runner without the gateway's credential key: loud, and the job says why
            log.error("batch job %s: %s", job.id, exc.message)
            await self.store.finish(job.id, "failed", error=f"cannot open the job's credential: {exc.message}")
            BATCH_JOBS_FINISHED.labels("failed").inc()
            return
        # identity: the answers are small and local; gzip would cost the gateway and the runner CPU per line
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if credential:
            headers["authorization"] = credential
        pack_rows = await self._pack_rows(job, headers)
        expires_at = job.expires_at
        expired = None  # the first chunk not run once the completion window ended, or the credential was refused
        self.refused.pop(job.id, None)
        in_flight: deque[tuple[int, asyncio.Task]] = deque()  # the chunks sent and not yet recorded, oldest first
        turn_ends = time.monotonic() + self.settings.turn_s if self.settings.turn_s > 0 else None
        try:
            for index in range(len(bounds)):
                make = await self._next_chunk(job, chunks)  # reads the chunk (Parquet: decodes its record batches)
                if make is None:
                    return
                if index in done:
                    continue
                if time.time() >= expires_at or job.id in self.refused:
                    expired = index, make
                    break
                if not in_flight and not await self._in_progress(job.id):
                    break  # cancelling (or gone) before anything was sent
                parsed = await self._lines(job, make)
                if parsed is None:
                    return
                rows = self._rows_now(pack_rows)
                in_flight.append((index, asyncio.create_task(self._chunk(job, parsed, headers, rows))))
                if len(in_flight) == _CHUNKS_IN_FLIGHT:  # the next chunk's lines are queued: record the oldest
                    await self._record(job, *in_flight.popleft())
                    if not await self._in_progress(job.id):
                        break  # cancelling: the chunk queued behind is dropped, so the job stops within one chunk
                    if turn_ends is not None and time.monotonic() >= turn_ends:
                        if await self.store.waiting(job.id):  # its turn is over: keep what was sent, let it go
                            while in_flight:
                                await self._record(job, *in_flight.popleft())
                            log.info("batch job %s: its turn of %.0f s is over and another job waits; %d of %d "
                                     "chunks recorded, it goes on at its next turn", job.id, self.settings.turn_s,
                                     len(await self.store.done_chunks(job.id)), len(bounds))  # fmt: skip
                            return
                        turn_ends = time.monotonic() + 1.0  # nobody waits: look again in a second
            else:
                while in_flight:
                    await self._record(job, *in_flight.popleft())
                    if in_flight and not await self._in_progress(job.id):
                        break
            while expired is not None and in_flight:  # the chunks sent before the window ended are kept
                await self._record(job, *in_flight.popleft())
        finally:
            for _, task in in_flight:
                task.cancel()
            await asyncio.gather(*(task for _, task in in_flight), return_exceptions=True)
        refused = self.refused.pop(job.id, None)
        if refused is not None and expired is None and await self._in_progress(job.id):
            expired = len(bounds), None  # refused on the last chunks: every line was sent and recorded; it fails
        unsent = None
        if expired is not None:  # every line not answered goes to the error file: each input line is in one file
            done = await self.store.done_chunks(job.id)
            if refused is not None:
                code, reason = "credential_refused", f"the gateway refused the job's credential: {refused}"
            else:
                code, reason = "batch_expired", f"the job's completion window ({job.completion_window}) ended first"
            unsent = {}  # chunk index: its part (error lines only), written now, not recorded
            index, make = expired
            while index < len(bounds):
                if index not in done:
                    lines = await self._lines(job, make)
                    if lines is None:
                        return
                    errors = b"".join(answers.error_line(line, code, reason) for line in lines)
                    unsent[index] = part = part_name(index, "unsent", False, bool(errors))
                    await asyncio.to_thread(job_files.write_part, job, part, b"", errors)
                index += 1
                if index >= len(bounds):
                    break
                make = await self._next_chunk(job, chunks)
                if make is None:
                    return
        await self._finalize(job.id, unsent, refused)

    async def _in_progress(self, job_id: str) -> bool:
        """Whether the job is still to run (not cancelling, not gone); keeps it for the metrics."""
        current = await self.store.get(job_id)
        if current is None or current.status != "in_progress":
            return False
        self.seen[job_id] = current
        return True

    async def _record(self, job: Job, index: int, task: asyncio.Task) -> None:
        """Wait for a chunk's lines, write them as a part, and record the part in Redis (all or none)."""
        out, err, ok, bad = await task
        part = part_name(index, self.runner_id, bool(out), bool(err))
        try:
            await asyncio.to_thread(job_files.write_part, job, part, out, err)
        except AIWorksError as exc:
            if exc.status is Status.UNAVAILABLE:  # the chunk is sent again when the job resumes
                raise StorageUnavailable(f"cannot write the job's results: {exc.message}") from None
            raise
        recorded = await self.store.record_chunk(job.id, self.runner_id, index, part, ok, bad)
        if recorded < 0:
            raise LeaseLost(job.id)
        self._rows_ok.inc(ok)
        self._rows_failed.inc(bad)
        BATCH_CHUNKS.inc()
        if self.on_chunk is not None:
            self.on_chunk(job, index)

    async def _next_chunk(self, job: Job, chunks: Iterator[Callable[[], list[Line]]]):
        """The next chunk's maker; None, with the job ended ``failed``, when the input cannot be read that far."""
        try:
            make = await asyncio.to_thread(next, chunks, None)
            if make is None:
                raise InvalidArgument("the input file ended before the rows its footer counts")
        except AIWorksError as exc:
            await self._unreadable(job, exc)
            return None
        return make

    async def _lines(self, job: Job, make: Callable[[], list[Line]]) -> list[Line] | None:
        """A chunk's lines (a JSONL chunk is read here: one ranged GET from S3); None, with the job ended
        ``failed``, when the input cannot be read (replaced under the job, or its store failing)."""
        try:
            return await asyncio.to_thread(make)
        except AIWorksError as exc:
            await self._unreadable(job, exc)
            return None

    async def _unreadable(self, job: Job, exc: AIWorksError) -> None:
        """The input could not be read: a store that cannot be reached now pauses the job (StorageUnavailable)
        until its completion window ends; anything else (gone, replaced, malformed) fails it, saying why."""
        if exc.status is Status.UNAVAILABLE and time.time() < job.expires_at:
            raise StorageUnavailable(f"cannot read the input file: {exc.message}")
        await self.store.finish(job.id, "failed", error=f"cannot read the input file: {exc.message}")
        BATCH_JOBS_FINISHED.labels("failed").inc()

    async def _chunk(self, job: Job, parsed: list[Line], headers: dict, pack_rows: int = 1) -> tuple[bytes, bytes, int, int]:
        """Send a chunk's lines (neighbours that agree packed into one request, :mod:`aiworks.batch.packing`)."""

        async def one(line: Line) -> tuple[bool, bytes]:
            if line.request is None:
                return False, answers.error_line(line, "invalid_request", line.error or "invalid line")
            return await self._send(job, line, headers)

        async def packed(group: list[Line]) -> list[tuple[bool, bytes]]:
            if len(group) == 1:
                return [await one(group[0])]
            status, content, reason = await self._post(job, orjson.dumps(packing.packed_request(group)), headers)
            if status == 200:
                responses = packing.split_response(group, content)
                if responses is not None:
                    return [(True, answers.output_line(line, r)) for line, r in zip(group, responses)]
            elif status == 0 or status in _TRANSIENT:  # retried until retry_for_s: each line would fare the same
                code = str(status) if status else "unavailable"
                return [(False, answers.error_line(line, code, reason)) for line in group]
            # Refused (one line at fault, or more rows than the model takes) or not splittable: line by line.
            return list(await asyncio.gather(*(one(line) for line in group)))

        answered = await asyncio.gather(*(packed(g) for g in packing.groups(parsed, pack_rows)))
        results = [r for rs in answered for r in rs]
        out = b"".join(doc for good, doc in results if good)
        err = b"".join(doc for good, doc in results if not good)
        ok = sum(1 for good, _ in results if good)
        return out, err, ok, len(results) - ok

    async def _send(self, job: Job, line: Line, headers: dict) -> tuple[bool, bytes]:
        status, content, reason = await self._post(job, orjson.dumps(line.request), headers)
        if status == 200:
            return True, answers.output_line(line, content)
        return False, answers.error_line(line, str(status) if status else "unavailable", reason)

    async def _post(self, job: Job, body: bytes, headers: dict) -> tuple[int, bytes, str]:
        """(200, the answer without its signal, "") or (the HTTP status, or 0 unreached; b""; why).

        A 429/502/503/504 or no answer is retried with backoff (``Retry-After`` first) for up to
        ``retry_for_s``; a 401 for up to ``auth_retry_s``, each try on a new connection, and then the job is
        marked refused (it stops); any other answer is final.
        """
        give_up = time.monotonic() + self.settings.retry_for_s
        auth_give_up = time.monotonic() + self.settings.auth_retry_s
        attempt = 0
        gate, pacer = self._gate, self.pacer
        client = self.client
        while True:
            attempt += 1
            await gate.acquire()  # per attempt: a line waiting to retry holds no place in flight
            started = time.perf_counter()
            try:
                async with client.post(self.base_url + job.infer_path, data=body, headers=headers) as reply:
                    status, content = reply.status, await reply.read()
                    retry_after = reply.headers.get("retry-after")
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, reason, delay = 0, f"gateway unreachable ({type(exc).__name__})", None
            else:
                if status == 200:
                    online, content = answers.take_online_load(content)
                    pacer.answered(time.perf_counter() - started, online)
                    return 200, content, ""
                if status in _OVERLOAD:
                    pacer.refused()
                reason = answers.gateway_error(status, content)
                if status == 401:
                    # Refused for the job's token. Tried again for a while first: in a rolling upgrade, a gateway
                    # from before work tokens refuses one that the others accept. Then the job stops (refused).
                    delay = min(answers.MAX_BACKOFF_S, 0.05 * 2**attempt)
                    client = self.fresh_client  # the next try on a new connection: perhaps another gateway replica
                    if job.id in self.refused or time.monotonic() + delay > auth_give_up:
                        self.refused.setdefault(job.id, reason)
                        return status, b"", reason
                elif status not in _TRANSIENT:
                    return status, b"", reason
                else:
                    delay = answers.retry_after(retry_after)
            finally:
                gate.release(time.perf_counter() - started)
            delay = delay if delay is not None else min(answers.MAX_BACKOFF_S, 0.05 * 2**attempt)
            if time.monotonic() + delay > give_up:
                return status, b"", f"{reason}; gave up after {attempt} attempts"
            await asyncio.sleep(delay)

    def _quiet(self) -> bool:
        """Whether the pacer sees no online traffic now: the runtime's signal has been seen (a job does not
        start packed on a guess) and the limit is at least half its ceiling (it halves on the signal and
        grows back while the signal stays off). With adaptive pacing off: always."""
        pacer = self.pacer
        return not pacer.adaptive or (pacer.signalled > 0 and pacer.limit >= pacer.ceiling / 2)

    def _rows_now(self, pack_rows: int) -> int:
        """Rows per request for the next chunk: ``pack_rows`` while quiet; one line each until the runtime's
        signal has been seen (a job does not start packed on a guess: its first round, a quarter of the
        ceiling in flight, would hit online traffic with that many packed requests); else ``pack_rows_online``."""
        if self._quiet():
            return pack_rows
        if not self.pacer.signalled:
            return 1
        return min(pack_rows, self.settings.pack_rows_online)

    async def _pack_rows(self, job: Job, headers: dict) -> int:
        """Rows per request for this job: ``pack_rows``, at most the model's ``max_batch_size`` (1: one line each)."""
        if self.settings.pack_rows <= 1:
            return 1
        url = self.base_url + job.infer_path[: -len("/infer")] + "/config"
        try:
            async with self.client.get(url, headers=headers) as reply:
                config = orjson.loads(await reply.read()) if reply.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            config = {}
        max_batch = config.get("max_batch_size", 0) if isinstance(config, dict) else 0
        return max(1, min(self.settings.pack_rows, int(max_batch))) if isinstance(max_batch, int) else 1

    async def _finalize(self, job_id: str, unsent: dict[int, str] | None = None, refused: str | None = None) -> None:
        """Write the output and error files from the recorded parts; ``unsent``: an expired job's other parts
        (or a job whose credential was refused, ``refused`` saying why: it ends ``failed``, its files kept)."""
        job = await self.store.get(job_id)
        if job is None or job.status in TERMINAL:
            return
        cancelled = job.status == "cancelling"
        final = "failed" if refused else "expired" if unsent is not None else "cancelled" if cancelled else "completed"
        if final == "completed":
            await self.store.update(job.id, status="finalizing", finalizing_at=time.time())
        parts = await self.store.chunk_parts(job.id)
        if unsent:
            parts |= unsent
        ordered = [parts[index] for index in range(job.chunks_total) if index in parts]  # a cancelled job: gaps
        try:
            sizes = await asyncio.to_thread(job_files.write_results, job, ordered)
        except AIWorksError as exc:
            if exc.status is Status.UNAVAILABLE and time.time() < job.expires_at:  # written again on resuming
                raise StorageUnavailable(f"cannot write the results: {exc.message}") from None
            await self.store.finish(job.id, "failed", error=f"cannot write the results: {exc.message}")
            return
        for (file_id, url, name), size in zip(
            (
                (job_files.output_file_id(job.id), job.output_url, f"output.{job.format}"),
                (job_files.error_file_id(job.id), job.error_url, "errors.jsonl"),
            ),
            sizes,
        ):
            record = FileRecord(file_id, job.tenant, f"{job.id}-{name}", "batch_output", url, size)
            await self.store.add_file(record)
        why = {"error": f"the gateway refused the job's credential, so it stopped: {refused}"} if refused else {}
        await self.store.finish(
            job.id, final, output_file_id=job_files.output_file_id(job.id), error_file_id=job_files.error_file_id(job.id), **why
        )
        # After the job has ended: a runner that dies first leaves parts behind, never a job without them; the
        # job stays on the sweep list, and an idle runner removes them (_sweep).
        await self._remove_parts(job)
        BATCH_JOBS_FINISHED.labels(final).inc()
        self.seen.pop(job.id, None)
        log.info("batch job %s %s: %d lines answered, %d failed", job.id, final, job.completed, job.failed)

    async def _remove_parts(self, job: Job) -> int | None:
        """Remove an ended job's parts, and take it off the sweep list: how many there were; None (it stays
        on the list) when storage refused."""
        try:
            removed = await asyncio.to_thread(objects.delete_tree, job_files.parts_prefix(job))
        except (AIWorksError, OSError) as exc:
            log.warning("batch job %s: its parts under %s were not removed: %s", job.id, job_files.parts_prefix(job), exc)
            return None
        await self.store.swept(job.id)
        return removed

    async def _sweep(self) -> bool:
        """Idle: remove the parts of one ended job whose runner did not (it died, or storage refused); False
        when there was none."""
        job_id = await self.store.to_sweep()
        if job_id is None:
            return False
        job = await self.store.get(job_id)
        if job is None or job.status not in TERMINAL or not job.output_url:
            return True  # gone, resumed by nobody (not ended), or never had an output: nothing to remove
        for other_id in await self.store.active_ids():
            other = await self.store.get(other_id)
            if other is not None and other.output_url == job.output_url:
                # A job resubmitted to the same output writes its parts in the same folder: leave them to it (its
                # own end removes the folder, this job's leftovers with it).
                return True
        removed = await self._remove_parts(job)
        if removed is None:
            await self.store.resweep(job_id)
            return False
        if removed:
            log.info("batch job %s: removed the %d part file(s) left under %s", job_id, removed, job_files.parts_prefix(job))
        return True


