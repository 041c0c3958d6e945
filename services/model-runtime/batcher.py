"""Per model-version queues and the dynamic batcher that drains them, next to the model.

Admission and order live in :mod:`aiworks.runtime.queue_state` (bounded,
three classes with aging). The loop of one :class:`ModelQueue`:

1. wait for a request;
2. wait for a free execution slot (the version's ``instance_group.count``),
   so batches form while every instance is busy, as Triton's dynamic
   batcher does;
3. if the model batches, wait until the rows queued reach the largest
   preferred batch size (or ``max_batch_size``), or until the first request
   has waited ``max_queue_delay_us``, whichever is first. With a delay of 0
   (Triton's default) whatever is queued leaves at once. asyncio's timers
   round waits up to whole milliseconds, so small delays act as 1 ms;
4. take whole requests, best rank first, up to ``max_batch_size`` rows and
   with the same non-batch shapes and requested outputs; drop those whose
   deadline has passed; join the input bytes and run the batch. While online
   requests are queued or one arrived within ``QueueLimits.online_window_s``,
   ``batch``-class requests take at most ``batch_share_when_online`` of the
   batch's rows, and batches of only ``batch`` requests hold at most that
   share of the execution slots (at least one, and with two or more slots
   never the last one): the rest wait, so an online request that arrives
   finds a slot soon (:mod:`aiworks.runtime.queue_state`, "Online first");
5. split the outputs back by rows, exactly, to each request, with its share
   of the batch's compute time (by rows), which the gateway charges.

**The batch lane.** Where the runtime gives a queue ``run_lane`` (its
backend computes on this host's CPU, and ``batch_lane_nice`` is on), batches
of ``batch``-class requests do not take the instance slots at all: they run
beside them, in threads at a low CPU priority (niced), so an online request
never waits for a batch job's batch to end, and the job's compute takes
what CPU online work leaves. The slots serve online requests only; the lane
runs at most as many batches as there are slots (their share while online
traffic is about), with the same row cap. The lane is where the offline
tier "fills idle capacity and yields to online traffic at once" on a CPU.

A request whose deadline passes while it is queued leaves the queue at once
and costs nothing. Once its batch runs it is answered when the batch ends,
deadline or not: the gateway has answered its client at the deadline already
and waits for this answer only to charge the work that was done.

Telemetry: each request's wait is a "runtime queue" span (when tracing
records) and an observation of ``aiworks_scheduler_queue_duration_seconds``
(the scheduling stage's metrics keep their names, so dashboards and alerts
keep working, though the stage now runs in the runtime); each batch is a
"runtime batch" span in the trace of its first request, linked to every
request's queue span. The metrics' label children are made once per queue.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry.trace import SpanContext

from aiworks.core import metrics, tracing
from aiworks.core.datatypes import Tensor, split_rows
from aiworks.core.errors import AIWorksError, DeadlineExceeded, Internal, PayloadTooLarge, Status, Unavailable
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import ONLINE_LOAD, Priority
from aiworks.runtime.queue_state import Entry, QueueState

log = logging.getLogger(__name__)

# (inputs, outputs) -> (output tensors, compute ns): runs one batch on the version's model.
RunBatch = Callable[[list[Tensor], list[str]], Awaitable[tuple[list[Tensor], int]]]


@dataclass(frozen=True)
class QueueLimits:
    """Bounds and aging of one model version's queue."""

    max_requests: int = 2048
    max_bytes: int = 64 << 20
    aging_s: float = 0.1
    # Sequences of a stateful model that may wait for a free slot (aiworks.runtime.sequence_batcher).
    max_sequence_backlog: int = 64
    # Share of a batch's rows and of the execution slots batch-class work may hold while online traffic is about
    # (1.0: no bound), and how long after the last online request it counts as about.
    batch_share_when_online: float = 1.0
    online_window_s: float = 0.1


_DEFAULT_LIMITS = QueueLimits()


@dataclass(slots=True, eq=False)
class _Pending:
    request: InferRequest
    rows: int
    future: asyncio.Future
    trace_parent: SpanContext | None = None  # the caller's span (or only its propagated context)
    span: object = None  # the queue span while it waits, when tracing records
    queue_ns: int = 0
    low: bool = False  # a batch-class request: its answer says whether online traffic is about (ONLINE_LOAD)

    def link(self) -> SpanContext | None:
        return self.span.get_span_context() if self.span is not None else self.trace_parent


REJECTION_REASONS = ("queue_full", "queue_bytes", "no_replica")


class ModelQueue:
    """The queue and batcher of one model version on this replica."""

    def __init__(
        self,
        spec: ModelSpec,
        run_batch: RunBatch,
        *,
        batching: bool,
        limits: QueueLimits = _DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
        run_lane: RunBatch | None = None,
    ):
        self.key = (spec.name, spec.version)
        self.spec = spec
        self._run_batch = run_batch
        self._run_lane = run_lane  # the batch lane's run (module docstring); None: batch work takes the slots
        self._clock = clock
        self._batching = batching and spec.batching.enabled and spec.max_batch_size > 1
        self._max_rows = spec.max_batch_size if self._batching else 0
        preferred = spec.batching.preferred_batch_sizes
        self._target_rows = max(preferred) if (self._batching and preferred) else spec.max_batch_size
        self._delay_s = spec.batching.max_queue_delay_us / 1e6
        self.slots = max(1, spec.instance_count)
        self.state = QueueState(max_requests=limits.max_requests, max_bytes=limits.max_bytes, aging_s=limits.aging_s,
                                batch_share=limits.batch_share_when_online, online_window_s=limits.online_window_s)  # fmt: skip
        self._share = limits.batch_share_when_online < 1.0
        self.batch_slots = batch_slot_cap(self.slots, limits.batch_share_when_online)
        self._arrived = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._wake = asyncio.Event()  # an arrival or a finished batch: what a held-back batch request waits for
        self._tasks: set[asyncio.Task] = set()
        self._batch_tasks: set[asyncio.Task] = set()  # running batches of only batch-class requests (the lane's too)
        self.closing = False
        self.batches = 0
        self.rows_done = 0
        self.rejected = 0
        self.expired = 0
        self.recent_batch_s = 0.0  # moving average of a batch's run time, for Retry-After hints
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
        return len(self._tasks | self._batch_tasks)

    @property
    def idle(self) -> bool:
        return not self.state.requests and not self._tasks and not self._batch_tasks

    # ---- admission -----------------------------------------------------------------------

    async def submit(
        self, request: InferRequest, rows: int, priority: Priority = Priority.STANDARD, deadline_s: float | None = None
    ) -> Answer:
        """Queue the request and wait for its answer; see the module docstring for deadlines."""
        if self.closing:
            raise Unavailable(f"model '{self.key[0]}' version {self.key[1]} is being unloaded on this replica")
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
        pending = _Pending(request, rows, asyncio.get_running_loop().create_future(), tracing.current_span_context(),
                           low=priority is Priority.BATCH)  # fmt: skip
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
        pending.span = tracing.start_span("runtime queue", attributes=self._span_attributes)
        self._arrived.set()
        self._wake.set()
        future = pending.future
        try:
            if deadline_s is not None:
                try:
                    return await asyncio.wait_for(asyncio.shield(future), deadline_s - self._clock())
                except TimeoutError:
                    if entry.queued:  # dropped before it ran: it cost nothing
                        self.expired += 1
                        error = DeadlineExceeded("the request's deadline passed while it was queued")
                        if pending.span is not None:
                            tracing.fail(pending.span, error)
                        raise error from None
            return await future  # running (or answered meanwhile): its answer comes when the batch ends
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
        if not self.recent_batch_s:
            return 1.0
        batches = self.state.rows / max(1, self._max_rows or 1)
        return min(30.0, max(1.0, batches * self.recent_batch_s / self.slots))

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
        if self._run_lane is not None:
            return await self._lane_step()
        while len(self._tasks) >= self.slots:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        await self._gather(lambda: self.state.rows)
        now = self._clock()
        cap = self.state.batch_rows_cap(self._max_rows, now) if self._share else None
        if cap is not None and len(self._batch_tasks) >= self.batch_slots:
            cap = 0  # batch work holds its share of the slots: only online requests may start now
        batch, expired = self.state.take(self._max_rows, now, cap)
        self._expire(expired)
        if not batch:
            if cap == 0 and self.state.requests:  # only batch work is queued, held back while online is about
                quiet_s = self.state.online_quiet_in(now)
                if quiet_s > 0:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), quiet_s)
                    except TimeoutError:
                        pass
            return
        self._start(batch, self._share and all(e.priority is Priority.BATCH for e in batch), slot=True)

    async def _lane_step(self) -> None:
        """One step with the batch lane: online requests to a free slot, else batch requests to the lane."""
        state = self.state
        now = self._clock()
        lane_cap = self.batch_slots if state.online_active(now) else self.slots
        online = state.online_queued and len(self._tasks) < self.slots
        if not online and not (state.batch_rows and len(self._batch_tasks) < lane_cap):
            self._wake.clear()  # an arrival or a finished batch; or the online window's end frees the lane's slots
            quiet_s = state.online_quiet_in(now) if state.batch_rows and len(self._batch_tasks) < self.slots else 0
            try:
                await asyncio.wait_for(self._wake.wait(), quiet_s or None)
            except TimeoutError:
                pass
            return
        if online:
            await self._gather(lambda: state.rows - state.batch_rows)  # the lane's rows wait for no batch here
            now = self._clock()
            batch, expired = state.take(self._max_rows, now, 0)
        else:
            batch, expired = state.take(self._max_rows, now, state.batch_rows_cap(self._max_rows, now), online=False)
        self._expire(expired)
        if batch:
            self._start(batch, not online, slot=online)

    async def _gather(self, queued_rows: Callable[[], int]) -> None:
        """Step 3: with a batching delay, wait until ``queued_rows()`` reaches the target or the head has waited
        ``max_queue_delay_us``."""
        if not (self._batching and self._delay_s > 0):
            return
        head = self.state.peek()
        deadline = (head.enqueued_s if head else self._clock()) + self._delay_s
        while queued_rows() < self._target_rows and (remaining := deadline - self._clock()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break

    def _expire(self, expired: list[Entry]) -> None:
        for entry in expired:
            self.expired += 1
            if not entry.payload.future.done():
                entry.payload.future.set_exception(
                    DeadlineExceeded("the request's deadline passed while it was queued")
                )

    def _start(self, batch: list[Entry], batch_only: bool, *, slot: bool) -> None:
        """Run ``batch`` in a task: in an instance slot, or (``slot`` False) in the batch lane."""
        rows = sum(e.rows for e in batch)
        run = self._run_batch if slot else self._run_lane
        task = asyncio.get_running_loop().create_task(self._dispatch(batch, rows, run))
        if slot:
            self._tasks.add(task)
        if batch_only:
            self._batch_tasks.add(task)
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._batch_tasks.discard(task)
        self._slot_freed.set()
        self._wake.set()

    def _fail_all(self, exc: AIWorksError) -> None:
        for pending in self.state.drain():
            if not pending.future.done():
                pending.future.set_exception(_copy(exc))

    # ---- one batch -----------------------------------------------------------------------

    async def _dispatch(self, batch: list[Entry], rows: int, run: RunBatch) -> None:
        pendings: list[_Pending] = [e.payload for e in batch]
        now = self._clock()
        for e in batch:
            waited = now - e.enqueued_s
            e.payload.queue_ns = int(waited * 1e9)
            self._queue_wait[e.priority].observe(waited)
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
                try:
                    outputs, compute_ns = await run(inputs, list(pendings[0].request.outputs))
                finally:  # before any answer leaves, so a scrape after the answers sees the batch
                    elapsed = time.perf_counter() - started
                    self._batch_duration.observe(elapsed)
                    self.recent_batch_s = elapsed if not self.recent_batch_s else 0.8 * self.recent_batch_s + 0.2 * elapsed
                self._deliver(pendings, rows, outputs, compute_ns)
            except Exception as exc:
                scope.fail(exc)
                if not isinstance(exc, AIWorksError):
                    log.exception("batch for %s/%s failed", *self.key)
                    exc = Internal(f"batch failed: {exc}")
                spent_ns = int((time.perf_counter() - started) * 1e9)
                for p in pendings:
                    if not p.future.done():
                        error = _copy(exc)
                        error.compute_ns = spent_ns * p.rows // rows  # a failed run is charged too
                        error.queue_ns = p.queue_ns
                        p.future.set_exception(error)
        self.batches += 1
        self.rows_done += rows

    def _batch_scope(self, pendings: list[_Pending], rows: int) -> tracing.Scope:
        """The batch's span in its first request's trace, linked to every request (call before their spans end)."""
        if not tracing.enabled():  # pass one request's context on; a batch of several belongs to none
            parent = pendings[0].trace_parent if len(pendings) == 1 else None
            return tracing.batch_scope("runtime batch", parent, ())
        links = [link for link in (p.link() for p in pendings) if link is not None]
        attributes = {**self._span_attributes, "aiworks.batch.rows": rows, "aiworks.batch.requests": len(pendings)}
        return tracing.batch_scope("runtime batch", pendings[0].trace_parent, links, attributes)

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

    def _deliver(self, batch: list[_Pending], rows: int, outputs: list[Tensor], compute_ns: int) -> None:
        # Batch-class answers say whether online traffic is about now (the state the share rule reads): the
        # runner's signal to back off, which its own latency cannot give it (one look per batch).
        online = self.state.online_active(self._clock()) if any(p.low for p in batch) else False
        if len(batch) == 1:
            p = batch[0]
            if not p.future.done():
                p.future.set_result(Answer(outputs, compute_ns, p.queue_ns, {ONLINE_LOAD: online} if p.low else {}))
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
                parameters = {ONLINE_LOAD: online} if p.low else {}
                p.future.set_result(Answer(outs, compute_ns * p.rows // rows, p.queue_ns, parameters))

    async def drain(self, timeout_s: float) -> bool:
        """Take no new requests; wait until the queued and running ones are answered (True) or ``timeout_s``."""
        self.closing = True
        return await wait_idle(lambda: self.idle, self._clock, timeout_s)

    async def close(self, error: AIWorksError | None = None) -> None:
        """Stop the loop; requests still queued fail with ``error`` (default: the runtime is shutting down)."""
        self.closing = True
        self._loop_task.cancel()
        self._fail_all(error or Unavailable("the runtime replica is shutting down"))


async def wait_idle(idle: Callable[[], bool], clock: Callable[[], float], timeout_s: float) -> bool:
    """Poll ``idle`` every 10 ms until it holds (True) or ``timeout_s`` passes (False): a queue's drain."""
    deadline = clock() + timeout_s
    while not idle():
        if clock() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def batch_slot_cap(slots: int, share: float) -> int:
    """Execution slots batches of only batch-class requests may hold while online traffic is about.

    ``share`` of ``slots``, rounded down, but at least one (the job goes on)
    and, with two or more slots, never all of them (an online request finds one).
    """
    if share >= 1.0:
        return slots
    return 1 if slots <= 1 else max(1, min(slots - 1, int(share * slots)))


def _copy(exc: AIWorksError) -> AIWorksError:
    """A fresh exception per waiter, so tracebacks do not pile up on a shared one."""
    return type(exc)(exc.message, exc.status, retry_after_s=exc.retry_after_s)
