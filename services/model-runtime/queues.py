"""Requests on their way to the model: one queue and batcher per loaded version (:mod:`.batcher`).

The gateway sends each request here with its version already resolved and
its options parsed (:class:`aiworks.core.options.RequestOptions`); this is the
one place that checks it against the model (inputs, outputs), queues it by
class and deadline, and answers it with its outputs and its share of the
batch's compute.

A version's queue is made on its first request and follows the version: a
reload that changes its config gets a new queue for new requests while the
old one finishes; an unload drains the queues of the model first
(:meth:`RequestQueues.drain`), and a queue whose version is gone and which is
idle is closed by :meth:`sweep`, which the heartbeat calls every second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiworks.core import metrics, tracing
from aiworks.core.errors import AIWorksError, InvalidArgument, Unavailable
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import check_inputs
from aiworks.core.options import Priority, RequestOptions
from aiworks.runtime import classification
from aiworks.runtime.batcher import ModelQueue, QueueLimits
from aiworks.runtime.sequence_batcher import SequenceBatcher

log = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass
class QueueStats:
    """One queue as the heartbeat reports it (``aiworks.scheduler.v1.QueueStatus``)."""

    model: str
    version: str
    queued_requests: int
    queued_rows: int
    batches: int
    rows: int
    queued_realtime: int
    queued_standard: int
    queued_batch: int
    queued_bytes: int
    rejected: int
    expired: int
    draining: bool


@dataclass
class SequenceStats:
    """The sequences of one stateful model version on this replica (Prometheus, at scrape)."""

    model: str
    version: str
    active: int  # holding a slot (its state lives there)
    waiting: int  # started, waiting for a slot
    started: int
    ended: int  # by a request with the end flag
    idled: int  # released after max_sequence_idle_microseconds without a request
    refused: int  # a start refused: every slot and the backlog full


class RequestQueues:
    """The queues of one replica, over its :class:`~aiworks.runtime.dataplane.RuntimeDataPlane`."""

    def __init__(self, dataplane, *, batching: bool = True, limits: QueueLimits = QueueLimits(),
                 drain_timeout_s: float = 30.0):  # fmt: skip
        self.dataplane = dataplane
        self.batching = batching
        self.limits = limits
        self.drain_timeout_s = drain_timeout_s
        self._queues: dict[Key, ModelQueue] = {}
        self._requests = metrics.Children(metrics.SCHEDULER_REQUESTS)

    async def infer(self, request: InferRequest, options: RequestOptions) -> Answer:
        """Check, queue and run one request; raises the error to answer it with. Counted by outcome."""
        labels = ("", "")
        try:
            loaded = self.dataplane.version_for(request.model, request.version)
            labels = (loaded.spec.name, loaded.spec.version)  # only a loaded version becomes a label
            answer = await self._infer(loaded, request, options)
        except BaseException as exc:
            self._requests(*labels, options.priority.label, metrics.status_label(exc)).inc()
            raise
        self._requests(*labels, options.priority.label, "ok").inc()
        return answer

    def decoupled(self, model: str, version: str) -> bool:
        """Whether the version a request names answers with a stream (False when unknown: the error comes later)."""
        try:
            return self.dataplane.version_for(model, version).spec.decoupled
        except AIWorksError:
            return False

    async def infer_stream(self, request: InferRequest, options: RequestOptions) -> AsyncIterator[Answer]:
        """A decoupled model's answers to one request as its backend makes them; counted by outcome at the end.

        The backend's ``stream`` runs the request (its own scheduling: a
        generation joins a running batch); cancelling the caller cancels it.
        """
        labels = ("", "")
        status = "ok"
        try:
            loaded = self.dataplane.version_for(request.model, request.version)
            labels = (loaded.spec.name, loaded.spec.version)
            self._check(loaded, request)
            async for answer in self.dataplane.stream(loaded, request, options):
                yield self._classified(loaded, request, answer)
        except BaseException as exc:
            # A consumer that stops early closes the generator: its caller went away, as a cancellation.
            status = "unavailable" if isinstance(exc, GeneratorExit) else metrics.status_label(exc)
            raise
        finally:
            self._requests(*labels, options.priority.label, status).inc()

    def _check(self, loaded, request: InferRequest) -> int:
        """The request's rows, once its inputs and requested outputs are checked against the model."""
        spec = loaded.spec
        if loaded.pipeline:
            raise InvalidArgument(f"model '{spec.name}' is a pipeline: the gateway runs its steps, not a runtime")
        rows = check_inputs(spec, request.inputs)
        if request.outputs:
            declared = {o.name for o in spec.outputs}
            for name in request.outputs:
                if name not in declared:
                    raise InvalidArgument(f"model '{spec.name}' has no output '{name}'; it has {sorted(declared)}")
        if request.classification:
            classification.check(spec, request.classification)
        return rows

    @staticmethod
    def _classified(loaded, request: InferRequest, answer: Answer) -> Answer:
        """``answer`` with the outputs the request classifies as their top classes (Triton's extension)."""
        if request.classification:
            batched = loaded.spec.max_batch_size > 0
            answer.outputs = classification.apply(answer.outputs, request.classification, loaded.labels, batched)
        return answer

    async def _infer(self, loaded, request: InferRequest, options: RequestOptions) -> Answer:
        rows = self._check(loaded, request)
        queue = self._queue(loaded)
        if loaded.spec.sequence is not None:  # a stateful model: its sequences and their batches
            answer = await queue.submit(request, rows, options)
        else:
            answer = await queue.submit(request, rows, options.priority, options.deadline_s)
        return self._classified(loaded, request, answer)

    def _queue(self, loaded) -> ModelQueue | SequenceBatcher:
        spec = loaded.spec
        key = (spec.name, spec.version)
        queue = self._queues.get(key)
        if queue is None or queue.spec is not spec:
            if queue is not None:  # reloaded with a new config: new requests go to a new queue
                old = queue
                asyncio.get_running_loop().create_task(self._retire(old))
            name, version = key
            attributes = {"aiworks.model": name, "aiworks.version": version, "aiworks.replica": self.dataplane.replica_id}

            async def run(inputs, outputs, lane=False):
                # The model's own run, inside the batch's span: what the batch spent outside it is queueing overhead.
                with tracing.child_span("runtime execute", attributes) as span:
                    outputs, compute_ns = await self.dataplane.execute(name, version, inputs, outputs, lane=lane)
                    span.set("aiworks.compute_ms", compute_ns / 1e6)
                return outputs, compute_ns

            async def run_lane(inputs, outputs):
                return await run(inputs, outputs, lane=True)

            if spec.sequence is not None:
                queue = SequenceBatcher(
                    spec, run, model_dir=self.dataplane.repository.folder(name),
                    max_backlog=self.limits.max_sequence_backlog, max_requests=self.limits.max_requests,
                )  # fmt: skip
            else:
                queue = ModelQueue(spec, run, batching=self.batching, limits=self.limits,
                                   run_lane=run_lane if self.dataplane.batch_lane else None)  # fmt: skip
            self._queues[key] = queue
        return queue

    async def _retire(self, queue: ModelQueue) -> None:
        if not await queue.drain(self.drain_timeout_s):
            log.warning("queue of %s/%s still busy after %.0f s; failing the rest", *queue.key, self.drain_timeout_s)
        await queue.close(Unavailable(f"model '{queue.key[0]}' version {queue.key[1]} was reloaded"))

    async def drain(self, model: str) -> None:
        """Before an unload: take no new requests for ``model``, answer the queued and running ones."""
        queues = [q for k, q in self._queues.items() if k[0] == model]
        if not queues:
            return
        started = time.monotonic()
        results = await asyncio.gather(*(q.drain(self.drain_timeout_s) for q in queues))
        for queue, done in zip(queues, results):
            self._queues.pop(queue.key, None)
            await queue.close(Unavailable(f"model '{model}' was unloaded before this request ran"))
            if not done:
                log.warning("queue of %s/%s still busy after %.0f s of draining", *queue.key, self.drain_timeout_s)
        log.info("drained the queues of %s in %.0f ms", model, (time.monotonic() - started) * 1e3)

    def sweep(self) -> None:
        """Close idle queues whose version this replica no longer serves."""
        for key, queue in list(self._queues.items()):
            if queue.idle and not self.dataplane.serves(*key):
                del self._queues[key]
                asyncio.get_running_loop().create_task(queue.close())

    def stats(self) -> list[QueueStats]:
        out = []
        for (model, version), q in self._queues.items():
            counts = q.state.counts
            out.append(
                QueueStats(
                    model, version, q.depth, q.queued_rows, q.batches, q.rows_done,
                    counts[Priority.REALTIME], counts[Priority.STANDARD], counts[Priority.BATCH],
                    q.state.nbytes, q.rejected, q.expired, q.closing,
                )  # fmt: skip
            )
        return out

    def sequence_stats(self) -> list[SequenceStats]:
        out = []
        for (model, version), q in self._queues.items():
            if isinstance(q, SequenceBatcher):
                t = q.table
                waiting = len(t.backlog)
                out.append(SequenceStats(model, version, t.count - waiting, waiting, t.started, t.ended, t.idled,
                                         t.refused))  # fmt: skip
        return out

    def live_sequences(self) -> int:
        """Sequences of stateful models this replica holds now (in a slot, or waiting for one)."""
        return sum(q.table.count for q in self._queues.values() if isinstance(q, SequenceBatcher))

    def busy(self, model: str, version: str) -> bool:
        queue = self._queues.get((model, version))
        return queue is not None and not queue.idle

    async def close(self) -> None:
        for queue in self._queues.values():
            await queue.close()
        self._queues.clear()

