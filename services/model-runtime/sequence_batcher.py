"""The sequence batcher: requests of a stateful model (Triton's ``sequence_batching``), next to the model.

Where :class:`~aiworks.runtime.batcher.ModelQueue` batches any requests
together, here each request belongs to a sequence (its correlation id), and
:class:`~aiworks.runtime.sequence_state.SequenceTable` keeps which sequence
holds which slot of which instance. One loop per instance of the model
forms its batches, one at a time:

- **direct**: a batch has one row per slot of the instance, up to its
  highest occupied slot; a slot whose sequence has a request ready
  contributes it, the others a row with ``READY`` false (zeros otherwise),
  so a model that keeps state per slot always sees each sequence in the
  same row (Triton's direct strategy);
- **oldest**: a batch takes the oldest ready request of each sequence on the
  instance, at most one per sequence, up to ``max_batch_size`` (Triton's
  oldest strategy). Rows must agree on their non-batch shapes; the others
  wait for the next batch.

With ``max_queue_delay_microseconds`` a batch waits that long at most for
every slot (direct) or the largest preferred batch (oldest) to be ready.
A sequence's next request runs only after the one before it has: its state
depends on it.

The batcher fills the control inputs (``START``, ``END``, ``READY`` with
the config's false and true values, ``CORRID`` in its ``data_type``) and the
implicit state: each ``state`` input gets the sequence's state (its initial
state on a start: ``initial_state`` zeros or its ``data_file``, else zeros
with variable dims as 1, as Triton does), and the model's state output
becomes the sequence's state for its next request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiworks.core import metrics
from aiworks.core.datatypes import NUMPY_DTYPES, Tensor, element_count, encode, itemsize, split_rows
from aiworks.core.errors import (
    AIWorksError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import Priority, RequestOptions, SequenceRef
from aiworks.runtime.batcher import RunBatch, wait_idle
from aiworks.runtime.sequence_state import Sequence, SequenceTable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _QueueView:
    counts: dict
    nbytes: int


@dataclass(slots=True, eq=False)
class _Pending:
    request: InferRequest
    ref: SequenceRef
    future: asyncio.Future
    enqueued_s: float
    deadline_s: float | None
    signature: tuple = ()


class SequenceBatcher:
    """The sequences and batches of one stateful model version on this replica."""

    def __init__(self, spec: ModelSpec, run_batch: RunBatch, *, model_dir: Path | None = None,
                 max_backlog: int = 64, max_requests: int = 2048,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.key = (spec.name, spec.version)
        self.spec = spec
        self.config = config = spec.sequence
        self._run_batch = run_batch
        self._clock = clock
        self._batched = spec.max_batch_size > 0
        if config.strategy == "oldest":
            slots = config.max_candidate_sequences
            self._max_rows = max(1, spec.max_batch_size)
            preferred = config.preferred_batch_sizes
            self._target_rows = min(max(preferred), self._max_rows) if preferred else self._max_rows
        else:
            slots = self._max_rows = self._target_rows = max(1, spec.max_batch_size)
        self._delay_s = config.max_queue_delay_us / 1e6
        instances = max(1, spec.instance_count)
        self.table = SequenceTable(spec.name, instances, slots, max_backlog=max_backlog,
                                   idle_s=config.max_idle_us / 1e6, clock=clock)  # fmt: skip
        self.max_requests = max_requests
        self._initial = {s.input_name: _initial_state(s, model_dir) for s in config.states}
        self._outputs = [o.name for o in spec.outputs] + [
            s.output_name for s in config.states if s.output_name not in {o.name for o in spec.outputs}
        ]
        self._wake = [asyncio.Event() for _ in range(instances)]
        self._reaped = asyncio.Event()
        self.queued = 0
        self.running_batches = 0
        self.closing = False
        self.batches = self.rows_done = self.expired = self.rejected = 0
        self._batch_size = metrics.SCHEDULER_BATCH_SIZE.labels(*self.key)
        self._batch_duration = metrics.SCHEDULER_BATCH_DURATION.labels(*self.key)
        self._queue_wait = metrics.SCHEDULER_QUEUE_DURATION.labels(*self.key, Priority.STANDARD.label)
        loop = asyncio.get_running_loop()
        # Fresh contexts: the batcher is made while serving some request, whose trace its loops must not inherit.
        self._tasks = [
            loop.create_task(self._run(i), name=f"sequences-{spec.name}-{spec.version}-{i}", context=contextvars.Context())
            for i in range(instances)
        ]
        self._tasks.append(loop.create_task(self._reap(), context=contextvars.Context()))

    @property
    def idle(self) -> bool:
        return not self.queued and not self.running_batches

    # What the heartbeat reports of a queue (RequestQueues.stats): requests wait here in the standard class.
    @property
    def depth(self) -> int:
        return self.queued

    queued_rows = depth

    @property
    def state(self) -> _QueueView:
        return _QueueView({Priority.REALTIME: 0, Priority.STANDARD: self.queued, Priority.BATCH: 0}, 0)

    # ---- admission -----------------------------------------------------------------------

    async def submit(self, request: InferRequest, rows: int, options: RequestOptions) -> Answer:
        """Queue ``request`` on its sequence and wait for its answer."""
        name = self.spec.name
        ref = options.sequence
        if ref is None:
            raise InvalidArgument(f"inference request to model '{name}' must specify a non-zero or non-empty "
                                  "correlation ID")  # fmt: skip
        if rows != 1:
            raise InvalidArgument(
                f"inference request to model '{name}' must specify batch-size 1 due to requirements of sequence "
                "batcher"
            )
        if self.closing:
            raise Unavailable(f"model '{name}' version {self.key[1]} is being unloaded on this replica")
        now = self._clock()
        if options.deadline_s is not None and options.deadline_s <= now:
            self.expired += 1
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        if self.queued >= self.max_requests:
            self.rejected += 1
            raise ResourceExhausted(f"the queue of model '{name}' version {self.key[1]} is full", retry_after_s=1.0)
        self._check_corrid(ref)
        try:
            sequence = self.table.admit(ref)  # raises: not started, or no room for another sequence
        except ResourceExhausted:
            self.rejected += 1
            raise
        pending = _Pending(request, ref, asyncio.get_running_loop().create_future(), now, options.deadline_s)
        pending.signature = tuple((t.name, t.shape) for t in request.inputs)
        sequence.queue.append(pending)
        self.queued += 1
        if sequence.instance is not None:
            self._wake[sequence.instance].set()
        future = pending.future
        try:
            if options.deadline_s is None:
                return await future
            try:
                return await asyncio.wait_for(asyncio.shield(future), options.deadline_s - self._clock())
            except TimeoutError:
                if pending in sequence.queue:  # it never ran: it costs nothing
                    self.expired += 1
                    raise DeadlineExceeded("the request's deadline passed while it was queued") from None
                return await future  # running: answered when its batch ends
        finally:
            if pending in sequence.queue:  # cancelled or expired while queued
                sequence.queue.remove(pending)
                self.queued -= 1
                self._placed(self.table.done(sequence))
            if not future.done():
                future.cancel()

    def _check_corrid(self, ref: SequenceRef) -> None:
        control = self.config.control("CORRID")
        if control is not None and control.datatype != "BYTES" and isinstance(ref.id, str):
            raise InvalidArgument(
                f"model '{self.spec.name}' takes an integer correlation ID (its CORRID control is "
                f"{control.datatype}); sequence id '{ref.id[:64]}' is a string"
            )

    def _placed(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self._wake[sequence.instance].set()

    # ---- the loops -------------------------------------------------------------------------

    async def _reap(self) -> None:
        period_s = min(1.0, max(0.05, self.table.idle_s / 4))
        while True:
            await asyncio.sleep(period_s)
            released, placed = self.table.expire_idle()
            for sequence in released:
                log.info("sequence %s of %s/%s released after %.1f s idle", sequence.id, *self.key, self.table.idle_s)
            self._placed(placed)

    async def _run(self, instance: int) -> None:
        wake = self._wake[instance]
        while True:
            try:
                ready = self._ready(instance)
                if not ready:
                    wake.clear()
                    await wake.wait()
                    continue
                if self._delay_s > 0:
                    ready = await self._gather(instance, ready)
                await self._execute(instance, ready)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: that would strand the sequences
                log.exception("sequence batcher of %s/%s failed a step", *self.key)

    def _ready(self, instance: int) -> list[Sequence]:
        """The sequences of ``instance`` with a request to run, after dropping requests whose deadline passed."""
        now = self._clock()
        ready = []
        for sequence in self.table.on_instance(instance):
            while sequence.ready and sequence.queue[0].deadline_s is not None and sequence.queue[0].deadline_s <= now:
                late = sequence.queue.popleft()
                self.queued -= 1
                self.expired += 1
                if not late.future.done():
                    late.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))
            if sequence.ready:
                ready.append(sequence)
            elif not sequence.queue:
                self._placed(self.table.done(sequence))  # its end request expired: the slot is free
        return ready

    async def _gather(self, instance: int, ready: list[Sequence]) -> list[Sequence]:
        """Wait (``max_queue_delay``) for every active slot, or the target rows, to be ready."""
        target = len(self.table.on_instance(instance)) if self.config.strategy == "direct" else self._target_rows
        deadline = min(s.queue[0].enqueued_s for s in ready) + self._delay_s
        wake = self._wake[instance]
        while len(ready) < target:
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), remaining)
            except TimeoutError:
                break
            ready = self._ready(instance)
        return ready

    # ---- one batch -------------------------------------------------------------------------

    def _rows(self, instance: int, ready: list[Sequence]) -> list[tuple[Sequence, _Pending] | None]:
        """The batch's rows: a (sequence, request) each, or None for a direct slot with nothing to run."""
        if self.config.strategy == "direct":
            first = ready[0].queue[0].signature
            rows: list = [None] * (self.table.highest_slot(instance) + 1)
            for sequence in ready:
                if sequence.queue[0].signature == first:
                    rows[sequence.slot] = (sequence, sequence.queue[0])
            return rows
        ready = sorted(ready, key=lambda s: s.queue[0].enqueued_s)
        first = ready[0].queue[0].signature
        return [(s, s.queue[0]) for s in ready if s.queue[0].signature == first][: self._max_rows]

    async def _execute(self, instance: int, ready: list[Sequence]) -> None:
        rows = self._rows(instance, ready)
        taken = [row for row in rows if row is not None]
        now = self._clock()
        for sequence, pending in taken:
            sequence.queue.popleft()
            sequence.running = True
            self.queued -= 1
            self._queue_wait.observe(now - pending.enqueued_s)
        self.running_batches += 1
        started = time.perf_counter()
        try:
            inputs = self._inputs(rows, taken)
            outputs, compute_ns = await self._run_batch(inputs, self._outputs)
            self._deliver(rows, taken, outputs, compute_ns)
        except Exception as exc:
            if not isinstance(exc, AIWorksError):
                log.exception("sequence batch of %s/%s failed", *self.key)
                exc = Internal(f"batch failed: {exc}")
            for _, pending in taken:
                if not pending.future.done():
                    pending.future.set_exception(type(exc)(exc.message, exc.status))
        finally:
            self.running_batches -= 1
            self._batch_duration.observe(time.perf_counter() - started)
            self._batch_size.observe(len(rows))
            self.batches += 1
            self.rows_done += len(taken)
            for sequence, _ in taken:
                sequence.running = False
                self._placed(self.table.done(sequence))

    def _inputs(self, rows: list, taken: list) -> list[Tensor]:
        """The batch's tensors: the clients' inputs, the control inputs and the state, a row per slot."""
        template = taken[0][1].request.inputs
        tensors = []
        for i, t in enumerate(template):
            row_shape = t.shape[1:] if self._batched else t.shape
            blank = _blank(t.datatype, row_shape)
            parts = [row[1].request.inputs[i].raw if row is not None else blank for row in rows]
            tensors.append(self._tensor(t.name, t.datatype, row_shape, parts, len(rows)))
        for control in self.config.controls:
            tensors.append(self._control(control, rows))
        for state in self.config.states:
            initial = self._initial[state.input_name]
            first = next((self._state_of(s, p, state.input_name) for s, p in taken), initial)
            blank = _blank(state.datatype, first.shape)
            parts = []
            for row in rows:
                value = self._state_of(*row, state.input_name) if row is not None else None
                if value is not None and value.shape != first.shape:
                    raise InvalidArgument(
                        f"state '{state.input_name}' of sequence {row[0].id} has shape {list(value.shape)}, another "
                        f"in the batch {list(first.shape)}"
                    )
                parts.append(value.raw if value is not None else blank)
            tensors.append(self._tensor(state.input_name, state.datatype, first.shape, parts, len(rows)))
        return tensors

    def _state_of(self, sequence: Sequence, pending: _Pending, name: str) -> Tensor:
        if pending.ref.start or name not in sequence.state:
            return self._initial[name]
        return sequence.state[name]

    def _tensor(self, name: str, datatype: str, row_shape: tuple, parts: list, rows: int) -> Tensor:
        shape = (rows, *row_shape) if self._batched else tuple(row_shape)
        return Tensor(name, datatype, shape, parts[0] if len(parts) == 1 else b"".join(parts))

    def _control(self, control, rows: list) -> Tensor:
        if control.kind == "CORRID":
            values = [row[0].id if row is not None else (0 if control.datatype != "BYTES" else "") for row in rows]
            if control.datatype == "BYTES":
                array = np.array([str(v).encode() for v in values], dtype=object).reshape(len(rows), 1)
            else:
                array = np.array(values, dtype=np.uint64).astype(NUMPY_DTYPES[control.datatype]).reshape(len(rows), 1)
        else:
            false, true = control.values
            if control.kind == "READY":
                flags = [row is not None for row in rows]
            else:
                attr = "start" if control.kind == "START" else "end"
                flags = [row is not None and getattr(row[1].ref, attr) for row in rows]
            array = np.array([true if f else false for f in flags], dtype=NUMPY_DTYPES[control.datatype])
            array = array.reshape(len(rows), 1)
        if not self._batched:
            array = array.reshape(1)
        return Tensor(control.name, control.datatype, array.shape, encode(array, control.datatype))

    def _deliver(self, rows: list, taken: list, outputs: list[Tensor], compute_ns: int) -> None:
        count = len(rows)
        by_row: list[dict[str, Tensor]] = [{} for _ in rows]
        for out in outputs:
            if self._batched:
                if not out.shape or out.shape[0] != count:
                    raise Internal(f"model '{self.key[0]}' output '{out.name}' has shape {list(out.shape)}; expected "
                                   f"{count} rows first")  # fmt: skip
                for i, piece in enumerate(split_rows(out.raw, out.datatype, out.shape, [1] * count)):
                    by_row[i][out.name] = Tensor(out.name, out.datatype, (1, *out.shape[1:]), piece)
            else:
                by_row[0][out.name] = out
        share = compute_ns // max(1, len(taken))
        declared = [o.name for o in self.spec.outputs]
        for i, row in enumerate(rows):
            if row is None:
                continue
            sequence, pending = row
            produced = by_row[i]
            for state in self.config.states:
                value = produced[state.output_name]
                shape = value.shape[1:] if self._batched else value.shape
                sequence.state[state.input_name] = Tensor(state.input_name, state.datatype, shape, value.raw)
            wanted = pending.request.outputs or declared
            answer = Answer([produced[name] for name in wanted], share, int((self._clock() - pending.enqueued_s) * 1e9))
            if not pending.future.done():
                pending.future.set_result(answer)

    # ---- lifecycle --------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> bool:
        """Take no new requests; wait until those queued and running are answered (True) or ``timeout_s``."""
        self.closing = True
        return await wait_idle(lambda: self.idle, self._clock, timeout_s)

    async def close(self, error: AIWorksError | None = None) -> None:
        """Stop the loops; requests still queued fail with ``error``; the sequences are dropped."""
        self.closing = True
        for task in self._tasks:
            task.cancel()
        error = error or Unavailable("the runtime replica is shutting down")
        sequences = [s for row in self.table.slots for s in row if s is not None] + list(self.table.backlog)
        for sequence in sequences:
            while sequence.queue:
                pending = sequence.queue.popleft()
                if not pending.future.done():
                    pending.future.set_exception(type(error)(error.message, error.status))
        self.queued = 0


def _blank(datatype: str, row_shape) -> bytes:
    """One row of zeros (empty strings for BYTES): the data of a slot with nothing to run."""
    count = element_count(row_shape)
    return bytes(count * (4 if datatype == "BYTES" else itemsize(datatype)))


def _initial_state(state, model_dir: Path | None) -> Tensor:
    """A state's value on a sequence's start: its initial_state (zeros or its data_file), else zeros."""
    dims = state.initial_dims if state.initial_dims is not None else tuple(1 if d < 0 else d for d in state.dims)
    size = element_count(dims) * (itemsize(state.datatype) or 4)
    if state.initial_file:
        if model_dir is None:
            raise InvalidArgument(f"state '{state.input_name}': initial_state data_file needs the model's folder")
        data = (model_dir / "initial_state" / state.initial_file).read_bytes()
        if state.datatype != "BYTES" and len(data) != size:
            raise InvalidArgument(
                f"state '{state.input_name}': initial_state data_file has {len(data)} bytes, dims {list(dims)} of "
                f"{state.datatype} need {size}"
            )
        return Tensor(state.input_name, state.datatype, dims, data)
    return Tensor(state.input_name, state.datatype, dims, bytes(size))
