"""Per model-version queues and the dynamic batcher that drains them.

Admission and order live in :mod:`aiworks.scheduler.queue_state` (bounded,
three classes with aging); sending a batch, with retries, in
:mod:`aiworks.scheduler.dispatch`. The loop of one :class:`ModelQueue`:

1. wait for a request;
2. reserve a replica with room for the class of the request that goes next
   (the router), so batches form while all replicas are busy;
3. if the model batches, wait until the rows queued reach the largest
   preferred batch size (or ``max_batch_size``), or until that request has
   waited ``max_queue_delay_us``, whichever is first. With a delay of 0
   (Triton's default) whatever is queued leaves at once. asyncio's timers
   round waits up to whole milliseconds, so small delays act as 1 ms;
4. take whole requests, best rank first, up to ``max_batch_size`` rows and
   with the same non-batch shapes; drop those whose deadline has passed; join
   the input bytes and send the batch;
5. split the outputs back by rows, exactly, to each request.

A request waits for its answer until its own deadline at most; if it gives up
(deadline, or the caller cancelled) while queued, it leaves the queue at once,
frees its room and costs nothing. One whose deadline passes while its batch
runs is answered DEADLINE_EXCEEDED when the batch has ended, so that what the
runtime spent on it is known: each request's :class:`~aiworks.scheduler.dispatch.Charge`
(:data:`CHARGE`, set by the caller) receives its share of every batch it ran
in, by rows, failures included (docs/tenancy.md, "Compute quota").

Telemetry: each request's wait is a "scheduler queue" span (when tracing
records) and an observation of ``aiworks_scheduler_queue_duration_seconds``,
from enqueue until its batch is sent; each batch is a "scheduler batch" span
in the trace of its first request, linked to every request's queue span
(:func:`aiworks.core.tracing.batch_scope`). The metrics' label children are
made once per queue.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from collections.abc import Callable

from opentelemetry.trace import SpanContext

from aiworks.core import metrics, tracing
from aiworks.core.datatypes import Tensor, split_rows
from aiworks.core.errors import AIWorksError, DeadlineExceeded, Internal, PayloadTooLarge, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.scheduler.dispatch import BatchSender, Charge
from aiworks.scheduler.qos import Priority
from aiworks.scheduler.queue_state import Entry, QueueState
from aiworks.scheduler.registry import Key
from aiworks.scheduler.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueLimits:
    """Bounds and aging of one model version's queue."""

    max_requests: int = 2048
    max_bytes: int = 64 << 20
    aging_s: float = 0.1


_DEFAULT_LIMITS = QueueLimits()


@dataclass(slots=True, eq=False)
class _Pending:
    request: InferRequest
    rows: int
    future: asyncio.Future
    trace_parent: SpanContext | None = None  # the caller's span (or only its propagated context)
    span: object = None  # the queue span while it waits, when tracing records
    charge: Charge | None = None  # where its share of its batch's compute goes

    def link(self) -> SpanContext | None:
        return self.span.get_span_context() if self.span is not None else self.trace_parent


REJECTION_REASONS = ("queue_full", "queue_bytes", "no_replica")

# The request being served charges its batches' compute here (Scheduler.infer sets it; pipeline steps
# inherit it, shadow copies run in a fresh context and charge nobody).
CHARGE: contextvars.ContextVar[Charge | None] = contextvars.ContextVar("aiworks_scheduler_charge", default=None)


class ModelQueue:
    """The queue and batcher of one model version."""

    def __init__(
        self,
        spec: ModelSpec,
        router: Router,
        sender: BatchSender,
        *,
        batching: bool,
        limits: QueueLimits = _DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.key: Key = (spec.name, spec.version)
        self.spec = spec
        self._router = router
        self._sender = sender
        self._clock = clock
        self._batching = batching and spec.batching.enabled and spec.max_batch_size > 1
        self._max_rows = spec.max_batch_size if self._batching else 0
        preferred = spec.batching.preferred_batch_sizes
        self._target_rows = max(preferred) if (self._batching and preferred) else spec.max_batch_size
        self._delay_s = spec.batching.max_queue_delay_us / 1e6
        self.state = QueueState(max_requests=limits.max_requests, max_bytes=limits.max_bytes, aging_s=limits.aging_s)
        self._arrived = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0
        self.rows_done = 0
        self.rejected = 0
        self.expired = 0
        labels = self.key
        self._queue_wait = {p: metrics.SCHEDULER_QUEUE_DURATION.labels(*labels, p.label) for p in Priority}
        self._batch_size = metrics.SCHEDULER_BATCH_SIZE.labels(*labels)
        self._batch_duration = metrics.SCHEDULER_BATCH_DURATION.labels(*labels)
        self._rejections = {r: metrics.SCHEDULER_REJECTIONS.labels(*labels, r) for r in REJECTION_REASONS}
        self._span_attributes = {"aiworks.model": spec.name, "aiworks.version": spec.version}
        # A fresh context: the queue is made while serving some request, whose trace context
        # (contextvars) the loop and every batch task it starts would otherwise inherit.
        self._loop_task = asyncio.get_running_loop().create_task(
            self._run(), name=f"batcher-{spec.name}-{spec.version}", context=contextvars.Context()
        )

    @property
    def depth(self) -> int:
        return self.state.requests

    @property
    def queued_rows(self) -> int:
        return self.state.rows

    @property
    def running(self) -> int:
        """Batches taken from the queue whose answers are not delivered yet."""
        return len(self._tasks)

    # ---- admission -----------------------------------------------------------------------

    async def submit(
        self, request: InferRequest, rows: int, priority: Priority = Priority.STANDARD, deadline_s: float | None = None
    ) -> list[Tensor]:
        """Queue the request and wait for its outputs (until ``deadline_s`` at most)."""
        now = self._clock()
        if deadline_s is not None and deadline_s <= now:
            self.expired += 1
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        nbytes = sum(len(t.raw) for t in request.inputs)
        if nbytes > self.state.max_bytes:
            self._rejections["queue_bytes"].inc()
            raise PayloadTooLarge(
                f"request of {nbytes} bytes exceeds the queue bound of {self.state.max_bytes} bytes of model "
                f"'{self.key[0]}'"
            )
        signature = (
            tuple(sorted((t.name, t.shape[1:] if self.spec.max_batch_size > 0 else t.shape) for t in request.inputs)),
            tuple(request.outputs),
        )
        pending = _Pending(
            request, rows, asyncio.get_running_loop().create_future(), tracing.current_span_context(), charge=CHARGE.get()
        )
        entry = Entry(pending, priority, rows, nbytes, signature, now, deadline_s)
        state = self.state
        reason = "queue_full" if state.requests >= state.max_requests else "queue_bytes"
        shed = state.admit(entry)
        if shed is None:
            self.rejected += 1
            self._rejections[reason].inc()
            raise self._full(f"the queue of model '{self.key[0]}' version {self.key[1]} is full")
        for victim in shed:
            self.rejected += 1
            self._rejections[reason].inc()
            if not victim.future.done():
                victim.future.set_exception(self._full("shed from a full queue for a higher-priority request"))
        pending.span = tracing.start_span("scheduler queue", attributes=self._span_attributes)
        self._arrived.set()
        future = pending.future
        try:
            if deadline_s is None:
                return await future
            # asyncio.wait, not wait_for: the future must survive the deadline if its batch is running.
            await asyncio.wait((future,), timeout=deadline_s - self._clock())
            if future.done():
                return future.result()
            if entry.queued:  # dropped before it ran: it costs nothing
                self.expired += 1
                raise DeadlineExceeded("the request's deadline passed while it was queued")
            # Its batch runs: the runtime spends the time anyway, so wait for the batch (bounded by the
            # per-try timeouts) and answer with what it cost; the gateway answered its client already.
            await asyncio.wait((future,))
            if not future.cancelled():
                future.exception()  # retrieved: the deadline is the answer either way
            raise DeadlineExceeded("the request's deadline passed while it ran")
        except BaseException as exc:
            if pending.span is not None:  # it never left the queue in a batch
                tracing.fail(pending.span, exc)
            raise
        finally:
            if pending.span is not None:
                pending.span.end()
                pending.span = None
            if not future.done():
                future.cancel()
            self.state.remove(entry)

    def _full(self, message: str) -> AIWorksError:
        return AIWorksError(message, Status.RESOURCE_EXHAUSTED, retry_after_s=self.retry_after_s())

    def retry_after_s(self) -> float:
        """A hint of when the queue will have room: the time to drain it at recent batch latency, 1..30 s."""
        holders = self._router.registry.holders(self.key)
        latencies = [r.health.latency_s[self.key] for r in holders if self.key in r.health.latency_s]
        if not latencies or not holders:
            return 1.0
        batches = self.state.rows / max(1, self._max_rows or 1)
        return min(30.0, max(1.0, batches * (sum(latencies) / len(latencies)) / len(holders)))

    # ---- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: that would strand requests
                log.exception("batcher for %s/%s failed a step", *self.key)

    async def _step(self) -> None:
        head = self.state.peek()
        if head is None:
            self._arrived.clear()
            await self._arrived.wait()
            return
        try:
            replica = await self._router.acquire(self.key, head.priority)
        except AIWorksError as exc:
            self._rejections["no_replica"].inc(self.state.requests)
            self._fail_all(exc)
            return
        if self._batching and self._delay_s > 0 and self.state.rows < self._target_rows:
            head = self.state.peek()
            deadline = (head.enqueued_s if head else self._clock()) + self._delay_s
            while self.state.rows < self._target_rows:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
        batch, expired = self.state.take(self._max_rows, self._clock())
        for entry in expired:
            self.expired += 1
            if not entry.payload.future.done():
                entry.payload.future.set_exception(
                    DeadlineExceeded("the request's deadline passed while it was queued")
                )
        if not batch:
            await self._router.release(replica, self.key, 0)
            return
        rows = sum(e.rows for e in batch)
        self._router.add_rows(replica, rows)
        task = asyncio.get_running_loop().create_task(self._dispatch(batch, rows, replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail_all(self, exc: AIWorksError) -> None:
        for pending in self.state.drain():
            if not pending.future.done():
                pending.future.set_exception(_copy(exc))

    # ---- one batch -----------------------------------------------------------------------

    async def _dispatch(self, batch: list[Entry], rows: int, replica) -> None:
        pendings: list[_Pending] = [e.payload for e in batch]
        deadlines = [e.deadline_s for e in batch]
        deadline_s = None if None in deadlines else max(deadlines)
        now = self._clock()
        for e in batch:
            self._queue_wait[e.priority].observe(now - e.enqueued_s)
        scope = self._batch_scope(pendings, rows)
        for p in pendings:
            if p.span is not None:
                p.span.end()
                p.span = None
        self._batch_size.observe(rows)
        started = time.perf_counter()
        with scope:
            try:
                inputs = self._join_inputs(pendings, rows)
                cost = Charge()
                try:
                    result = await self._sender.send(
                        self.key,
                        replica,
                        rows,
                        inputs,
                        list(pendings[0].request.outputs),
                        priority=min(e.priority for e in batch),
                        deadline_s=deadline_s,
                        charge=cost,
                    )
                finally:  # before any answer leaves, so a scrape after the answers sees the batch
                    self._batch_duration.observe(time.perf_counter() - started)
                    _share(pendings, rows, cost.compute_ns)
                self._deliver(pendings, rows, result)
            except AIWorksError as exc:
                scope.fail(exc)
                for p in pendings:
                    if not p.future.done():
                        p.future.set_exception(_copy(exc))
            except Exception as exc:
                scope.fail(exc)
                log.exception("batch for %s/%s failed", *self.key)
                for p in pendings:
                    if not p.future.done():
                        p.future.set_exception(Internal(f"batch failed: {exc}"))
        self.batches += 1
        self.rows_done += rows

    def _batch_scope(self, pendings: list[_Pending], rows: int) -> tracing.Scope:
        """The batch's span in its first request's trace, linked to every request (call before their spans end)."""
        if not tracing.enabled():  # pass one request's context on; a batch of several belongs to none
            parent = pendings[0].trace_parent if len(pendings) == 1 else None
            return tracing.batch_scope("scheduler batch", parent, ())
        links = [link for link in (p.link() for p in pendings) if link is not None]
        attributes = {**self._span_attributes, "aiworks.batch.rows": rows, "aiworks.batch.requests": len(pendings)}
        return tracing.batch_scope("scheduler batch", pendings[0].trace_parent, links, attributes)

    def _join_inputs(self, batch: list[_Pending], rows: int) -> list[Tensor]:
        if len(batch) == 1:
            return batch[0].request.inputs
        first = batch[0].request.inputs
        by_name = [{t.name: t for t in p.request.inputs} for p in batch[1:]]
        joined = []
        for t in first:
            parts = [t.raw] + [m[t.name].raw for m in by_name]
            joined.append(Tensor(t.name, t.datatype, (rows, *t.shape[1:]), b"".join(parts)))
        return joined

    def _deliver(self, batch: list[_Pending], rows: int, outputs: list[Tensor]) -> None:
        if len(batch) == 1:
            if not batch[0].future.done():
                batch[0].future.set_result(outputs)
            return
        counts = [p.rows for p in batch]
        per_request: list[list[Tensor]] = [[] for _ in batch]
        for out in outputs:
            if not out.shape or out.shape[0] != rows:
                raise Internal(
                    f"model '{self.key[0]}' output '{out.name}' has shape {list(out.shape)}; expected {rows} rows first"
                )
            for i, piece in enumerate(split_rows(out.raw, out.datatype, out.shape, counts)):
                per_request[i].append(Tensor(out.name, out.datatype, (counts[i], *out.shape[1:]), piece))
        for p, outs in zip(batch, per_request):
            if not p.future.done():
                p.future.set_result(outs)

    async def close(self, error: AIWorksError | None = None) -> None:
        """Stop the loop; requests still queued fail with ``error`` (default: the scheduler is shutting down)."""
        self._loop_task.cancel()
        self._fail_all(error or Unavailable("the scheduler is shutting down"))


def _share(pendings: list[_Pending], rows: int, compute_ns: int) -> None:
    """Each request's part of a batch's compute, by its rows."""
    if compute_ns <= 0:
        return
    for p in pendings:
        if p.charge is not None:
            p.charge.compute_ns += compute_ns * p.rows // max(1, rows)


def _copy(exc: AIWorksError) -> AIWorksError:
    """A fresh exception per waiter, so tracebacks do not pile up on a shared one."""
    return type(exc)(exc.message, exc.status, retry_after_s=exc.retry_after_s)
