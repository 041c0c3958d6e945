"""Per model-version queues and the dynamic batcher that drains them.

The loop of one :class:`ModelQueue`:

1. wait for a request;
2. reserve a replica with room (the router), so batches form while all are busy;
3. if the model batches, wait until the rows queued reach the largest
   preferred batch size (or ``max_batch_size``), or until the oldest request
   has waited ``max_queue_delay_us``, whichever is first. With a delay of 0
   (Triton's default) whatever is queued leaves at once. asyncio's timers
   round waits up to whole milliseconds, so small delays act as 1 ms;
4. take whole requests, oldest first, up to ``max_batch_size`` rows and with
   the same non-batch shapes, join their input bytes, and send the batch;
5. split the outputs back by rows, exactly, to each request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiworks.core.datatypes import Tensor, split_rows
from aiworks.core.errors import AIWorksError, Internal, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.scheduler.registry import Key, Replica
from aiworks.scheduler.router import Router

log = logging.getLogger(__name__)

# (replica, model, version, inputs, outputs) -> outputs
Runner = Callable[[Replica, str, str, list[Tensor], list[str]], Awaitable[list[Tensor]]]


@dataclass(slots=True)
class _Pending:
    request: InferRequest
    rows: int
    signature: tuple
    future: asyncio.Future
    enqueued_s: float


class ModelQueue:
    """The queue and batcher of one model version."""

    def __init__(
        self,
        spec: ModelSpec,
        router: Router,
        runner: Runner,
        *,
        batching: bool,
        max_retries: int,
        on_transport_error: Callable[[Replica, AIWorksError], None],
    ):
        self.key: Key = (spec.name, spec.version)
        self.spec = spec
        self._router = router
        self._runner = runner
        self._batching = batching and spec.batching.enabled and spec.max_batch_size > 1
        self._max_rows = spec.max_batch_size if self._batching else 0
        preferred = spec.batching.preferred_batch_sizes
        self._target_rows = max(preferred) if (self._batching and preferred) else spec.max_batch_size
        self._delay_s = spec.batching.max_queue_delay_us / 1e6
        self._max_retries = max_retries
        self._on_transport_error = on_transport_error
        self._pending: deque[_Pending] = deque()
        self._rows = 0
        self._arrived = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0
        self.rows_done = 0
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher-{spec.name}-{spec.version}")

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def queued_rows(self) -> int:
        return self._rows

    def submit(self, request: InferRequest, rows: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        signature = (
            tuple(sorted((t.name, t.shape[1:] if self.spec.max_batch_size > 0 else t.shape) for t in request.inputs)),
            tuple(request.outputs),
        )
        self._pending.append(_Pending(request, rows, signature, future, time.monotonic()))
        self._rows += rows
        self._arrived.set()
        return future

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
        if not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
            return
        first_rows = self._pending[0].rows
        try:
            replica = await self._router.acquire(self.key, first_rows)
        except AIWorksError as exc:
            self._fail_all(exc)
            return
        if self._batching and self._delay_s > 0 and self._rows < self._target_rows:
            deadline = self._pending[0].enqueued_s + self._delay_s if self._pending else 0
            while self._rows < self._target_rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
        batch = self._take()
        if not batch:
            await self._router.release(replica, self.key, first_rows)
            return
        rows = sum(p.rows for p in batch)
        replica.outstanding_rows += rows - first_rows
        task = asyncio.get_running_loop().create_task(self._dispatch(batch, rows, replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        signature = None
        while self._pending:
            head = self._pending[0]
            if head.future.done():  # the caller gave up (cancelled or timed out)
                self._pending.popleft()
                self._rows -= head.rows
                continue
            if batch and (
                not self._batching or head.signature != signature or rows + head.rows > self._max_rows
            ):
                break
            self._pending.popleft()
            self._rows -= head.rows
            batch.append(head)
            rows += head.rows
            signature = head.signature
        return batch

    def _fail_all(self, exc: AIWorksError) -> None:
        while self._pending:
            p = self._pending.popleft()
            if not p.future.done():
                p.future.set_exception(_copy(exc))
        self._rows = 0

    # ---- one batch -----------------------------------------------------------------------

    async def _dispatch(self, batch: list[_Pending], rows: int, replica: Replica) -> None:
        inputs = self._join_inputs(batch, rows)
        outputs = list(batch[0].request.outputs)
        tried: set[str] = set()
        try:
            for attempt in range(self._max_retries + 1):
                try:
                    result = await self._runner(replica, self.key[0], self.key[1], inputs, outputs)
                    break
                except AIWorksError as exc:
                    if exc.status is not Status.UNAVAILABLE:
                        raise
                    self._on_transport_error(replica, exc)
                    tried.add(replica.replica_id)
                    await self._router.release(replica, self.key, rows)
                    replica = None
                    if attempt == self._max_retries:
                        raise
                    log.warning("batch of %d rows for %s/%s failed on a replica; retrying", rows, *self.key)
                    replica = await self._router.acquire(self.key, rows, exclude=tried)
            self._deliver(batch, rows, result)
        except AIWorksError as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(_copy(exc))
        except Exception as exc:
            log.exception("batch for %s/%s failed", *self.key)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(Internal(f"batch failed: {exc}"))
        finally:
            if replica is not None:
                await self._router.release(replica, self.key, rows)
        self.batches += 1
        self.rows_done += rows

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
                    f"model '{self.key[0]}' output '{out.name}' has shape {list(out.shape)}; "
                    f"expected {rows} rows first"
                )
            for i, piece in enumerate(split_rows(out.raw, out.datatype, out.shape, counts)):
                per_request[i].append(Tensor(out.name, out.datatype, (counts[i], *out.shape[1:]), piece))
        for p, outs in zip(batch, per_request):
            if not p.future.done():
                p.future.set_result(outs)

    async def close(self) -> None:
        self._loop_task.cancel()
        self._fail_all(Unavailable("the scheduler is shutting down"))


def _copy(exc: AIWorksError) -> AIWorksError:
    """A fresh exception per waiter, so tracebacks do not pile up on a shared one."""
    return type(exc)(exc.message, exc.status, retry_after_s=exc.retry_after_s)
