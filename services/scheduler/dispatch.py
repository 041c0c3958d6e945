"""Sends each request to a runtime replica, as the scheduler's routing table says: the gateway's side of routing.

The :class:`Dispatcher` applies the table (:meth:`Dispatcher.apply`): version
weights and shadows, ejections the monitor asked for, and the routing
settings. For each request (:meth:`Dispatcher.infer`):

- **version**: the one the request names, else one picked by the version
  weights (smooth weighted round robin, exact over every window), else the
  latest ready one;
- **pipelines** run step by step here, each step a request of its own;
- **sequences** of a stateful model go to the replica that holds them
  (:mod:`~aiworks.scheduler.sequence_routing`), never retried elsewhere;
- **shadow**: a sampled copy goes to the shadow version, whose answer is
  compared with the primary's and discarded;
- **replica**: :class:`~aiworks.scheduler.router.Router`;
- **retries**: a try fails by the replica's fault when the replica is
  unreachable or its stream broke (UNAVAILABLE), when it raises INTERNAL, or
  when the per-try timeout (not the request's deadline) expires. Such
  failures count towards outlier ejection. UNAVAILABLE and per-try timeouts
  are retried on a replica not tried yet, at most ``max_retries`` times and
  only while the retry budget (Envoy's) allows. Other errors (the model
  rejected the request, its deadline passed, a full queue) are final.

The request's deadline is kept here: the client is answered when it passes,
whatever the replica is doing. What each try cost goes into the request's
:class:`~aiworks.runtime.client.Work`, including the answer still to come of
a try given up on, so the gateway charges the work that was done
(docs/tenancy.md, "Compute quota").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, DeadlineExceeded, InvalidArgument, Status, StreamLost, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec, check_inputs
from aiworks.core.options import Priority, RequestOptions
from aiworks.runtime.client import Answer, Work
from aiworks.scheduler.catalog import Key, Replica
from aiworks.scheduler.mirror import RoutingMirror
from aiworks.scheduler.pipeline import PipelineRunner, is_pipeline
from aiworks.scheduler.policy import RoutingPolicy
from aiworks.scheduler.replica_state import OutlierDetector
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.router import PoolPolicy, Recovering, Router, kv_reserve, prompt_head
from aiworks.scheduler.sequence_routing import SequenceRouting
from aiworks.scheduler.shadow import ShadowMirror
from aiworks.scheduler.traffic_state import TrafficState
from aiworks.scheduler.views import ReplicaView, RoutingReport, RoutingTable

log = logging.getLogger(__name__)

_REPLICA_FAULTS = (Status.UNAVAILABLE, Status.INTERNAL)

class _Retryable(Exception):
    """A try failed in a way another replica may not: carries the error to give if no retry happens."""

    def __init__(self, error: AIWorksError):
        super().__init__(error.message)
        self.error = error


class Dispatcher:
    """Routes requests over a :class:`RoutingMirror`; see the module docstring."""

    def __init__(self, mirror: RoutingMirror, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None):  # fmt: skip
        self.mirror = mirror
        self.clock = clock
        self._rng = rng
        self.traffic = TrafficState()
        self.retries: dict[Key, int] = {}
        self.requests = 0
        self._applied_ejections: set[int] = set()
        self.policy: RoutingPolicy | None = None
        self._configure(RoutingPolicy())
        # Stateful models: each sequence stays on one replica (rendezvous hashing, docs in sequence_routing.py).
        self.sequences = SequenceRouting(mirror, self._try_once, lambda r: self.router.is_down(r), clock)

    # ---- the routing table ---------------------------------------------------------------

    def _configure(self, policy: RoutingPolicy) -> None:
        """Build what the routing settings shape; replica health lives on the replicas and carries over."""
        if policy == self.policy:
            return
        self.policy = policy
        self.outliers = OutlierDetector(policy.outliers(), self.clock)
        self.router = Router(self.mirror, outliers=self.outliers, pools=PoolPolicy.parse(policy.class_pools),
                             ewma_alpha=policy.latency_ewma_alpha, rng=self._rng, clock=self.clock)  # fmt: skip
        old = getattr(self, "budget", None)
        self.budget = RetryBudget(policy.retry_budget_percent, policy.retry_min_concurrency)
        if old is not None:  # counts of requests in flight carry over
            self.budget.active, self.budget.active_retries = old.active, old.active_retries
            self.budget.allowed, self.budget.denied = old.allowed, old.denied
        shadows = getattr(self, "shadows", None)
        self.shadows = ShadowMirror(self._run_shadow, max_inflight=policy.shadow_max_inflight,
                                    timeout_s=policy.shadow_timeout_s)  # fmt: skip
        if shadows is not None:
            self.shadows.counts = shadows.counts
        self.pipelines = PipelineRunner(micro_batch_rows=policy.pipeline_micro_batch_rows)

    def apply(self, table: RoutingTable) -> None:
        """Take in a new routing table (the mirror has applied it already)."""
        self._configure(table.policy)
        models = set()
        for policy in table.traffic:
            self.traffic.set(policy)  # the round-robin state survives when the weights did not change
            models.add(policy.model)
        for policy in self.traffic.policies():
            if policy.model not in models:
                self.traffic.clear(policy.model)
        population = [r.health for r in self.mirror.replicas.values()]
        for order in table.ejections:
            replica = self.mirror.replicas.get(order.replica_id)
            if order.id in self._applied_ejections or replica is None:
                continue
            self._applied_ejections.add(order.id)
            ejected, for_s = self.outliers.eject(replica.health, population, order.remaining_s, order.reason)
            if ejected:  # counted by the scheduler, which decided it
                log.warning("replica %s ejected for %.1f s on request: %s", order.replica_id, for_s, order.reason)

    @property
    def default_priority(self) -> Priority:
        return self.policy.priority

    # ---- the request path ----------------------------------------------------------------

    def resolve(self, model: str, version: str) -> ModelSpec:
        """The spec a request gets: its version, else one by the weights, else the latest ready one."""
        if not version and self.traffic.get(model) is not None:
            version = self.traffic.choose(model, self.mirror.versions(model)) or ""
        return self.mirror.resolve(model, version)

    async def infer(self, request: InferRequest, options: RequestOptions, *, spec: ModelSpec | None = None,
                    work: Work | None = None) -> Answer:  # fmt: skip
        """Run one request; ``spec``: its version already resolved (:meth:`resolve`)."""
        if spec is None:
            spec = self.resolve(request.model, request.version)
        if spec.decoupled:
            raise AIWorksError(
                f"model '{spec.name}' is decoupled (it may send several responses per request): this API doesn't "
                "support models with decoupled transaction policy; use a streaming one (gRPC ModelStreamInfer)",
                Status.UNIMPLEMENTED,
            )
        request.version = spec.version
        self.requests += 1
        if is_pipeline(spec):
            return await self._pipeline(spec, request, options, work)
        if spec.sequence is not None:  # stateful: the sequence's own replica, no shadow copy, no retry elsewhere
            try:
                return await self.sequences.send(spec, request, options, work)
            except DeadlineExceeded:
                metrics.SCHEDULER_TIMEOUTS.labels(spec.name, spec.version).inc()
                raise
        # The copy runs on a task of its own; the client never waits for it.
        copy = self.shadows.begin(self.traffic.shadow(spec.name), request, spec.version)
        outputs = None
        try:
            answer = await self._send((spec.name, spec.version), request, options, work)
            outputs = answer.outputs
            return answer
        finally:
            self.shadows.finish(copy, outputs)

    async def infer_stream(self, request: InferRequest, options: RequestOptions, *, spec: ModelSpec | None = None,
                           work: Work | None = None) -> AsyncIterator[Answer]:  # fmt: skip
        """Run one request whose answers may be many (a decoupled model's), yielding them as they come.

        A model that is not decoupled answers once, through :meth:`infer`
        (retries, shadows and pipelines as usual). A decoupled one goes to one
        replica, picked as for any request; it is tried on another only while
        no answer has come (UNAVAILABLE, as :meth:`infer` retries), since
        answers already sent cannot be taken back. No shadow copy: a stream's
        answers are not compared.
        """
        if spec is None:
            spec = self.resolve(request.model, request.version)
        if not spec.decoupled:
            yield await self.infer(request, options, spec=spec, work=work)
            return
        request.version = spec.version
        self.requests += 1
        key = (spec.name, spec.version)
        tried: set[str] = set()
        attempt = 0
        generation = key in self.mirror.kv_keys  # a generative version whose replicas report KV figures
        head, reserve = prompt_head(request, options.tenant), kv_reserve(request) if generation else 0
        self.budget.begin()
        try:
            while True:
                try:
                    replica = self.router.pick(key, options.priority, tried, head, reserve)
                except Recovering as coming:
                    await self._wait_for_recovery(key, options, coming)
                    continue
                answers = 0
                heard = False  # the replica answered something, an error of its own included
                if generation or head:  # a generation's KV reserve counts there until the next figures; its
                    self.router.sent(replica, key, reserve, head)  # prompt's beginning goes there next time too
                else:
                    self.router.sent(replica)
                started = self.clock()
                try:
                    async with contextlib.aclosing(replica.client.infer_stream(request, options, work)) as stream:
                        async for answer in stream:
                            if not answers:
                                self.router.succeeded(replica, key, self.clock() - started)
                            answers += 1
                            heard = True
                            yield answer
                    return
                except DeadlineExceeded:
                    metrics.SCHEDULER_TIMEOUTS.labels(*key).inc()
                    raise
                except AIWorksError as exc:
                    heard = heard or exc.status is not Status.UNAVAILABLE
                    if exc.status in _REPLICA_FAULTS:
                        self.router.failed(replica, exc)
                    if answers and exc.status is Status.UNAVAILABLE:  # responses went out: no retry can resume it
                        raise Unavailable(f"the stream from replica {replica.replica_id} broke after {answers} "
                                          f"response(s): {exc.message}") from None  # fmt: skip
                    if answers or exc.status is not Status.UNAVAILABLE or attempt >= self.policy.max_retries:
                        raise
                    # The budget is asked as for any retry (a lost stream's need not), but not held: a stream
                    # may run for minutes, and the budget bounds retries in flight, not streams.
                    if not isinstance(exc, StreamLost) and not self.budget.try_retry():
                        raise Unavailable(f"{exc.message} (not retried: the retry budget is spent)") from None
                    if not isinstance(exc, StreamLost):
                        self.budget.retry_done()
                    error = exc
                finally:
                    if heard:
                        self.router.answered(replica)
                    else:
                        replica.outstanding -= 1
                tried.add(replica.replica_id)
                log.warning("stream for %s/%s failed on %s (%s); retrying", *key, replica.replica_id, error.message)
                self.retries[key] = self.retries.get(key, 0) + 1
                metrics.SCHEDULER_RETRIES.labels(*key).inc()
                attempt += 1
        finally:
            self.budget.end()

    async def _pipeline(self, spec: ModelSpec, request: InferRequest, options: RequestOptions,
                        work: Work | None) -> Answer:  # fmt: skip
        if request.classification:  # the runtime classifies; no replica sees the pipeline's own outputs
            names = sorted(request.classification)
            raise InvalidArgument(f"model '{spec.name}' is an ensemble: classification of {names} is not supported")
        rows = check_inputs(spec, request.inputs)  # no replica sees the pipeline's own request

        async def stage(model, version, inputs, outputs, stage_options):
            step_spec = self.resolve(model, version)
            step = InferRequest(model, step_spec.version, inputs, outputs, tenant=request.tenant)
            if is_pipeline(step_spec):  # a pipeline as a step of another
                answer = await self._pipeline(step_spec, step, stage_options, work)
            else:
                answer = await self._send((step_spec.name, step_spec.version), step, stage_options, work)
            return answer.outputs

        outputs = await self.pipelines.run(spec, request, rows, options, stage)
        return Answer(outputs)

    async def _run_shadow(self, request: InferRequest, timeout_s: float):
        """A shadow copy: the batch class, its own time limit; errors stay with the shadow's counts."""
        spec = self.mirror.resolve(request.model, request.version)
        options = RequestOptions(Priority.BATCH, self.clock() + timeout_s, request.tenant)
        answer = await self._send((spec.name, spec.version), replace(request, version=spec.version), options, None)
        return answer.outputs

    async def _send(self, key: Key, request: InferRequest, options: RequestOptions,
                    work: Work | None) -> Answer:  # fmt: skip
        try:
            return await self._send_once_or_more(key, request, options, work)
        except DeadlineExceeded:
            metrics.SCHEDULER_TIMEOUTS.labels(*key).inc()  # counted once, here, wherever the deadline passed
            raise

    async def _send_once_or_more(self, key: Key, request: InferRequest, options: RequestOptions,
                                 work: Work | None) -> Answer:  # fmt: skip
        tried: set[str] = set()
        attempt = 0
        holds_retry = False
        self.budget.begin()
        try:
            while True:
                try:
                    replica = self.router.pick(key, options.priority, tried)
                except Recovering as coming:
                    await self._wait_for_recovery(key, options, coming)
                    continue
                try:
                    return await self._try(key, replica, request, options, work)
                except _Retryable as failed:
                    error = failed.error
                finally:
                    if holds_retry:
                        self.budget.retry_done()
                        holds_retry = False
                tried.add(replica.replica_id)
                if attempt >= self.policy.max_retries:
                    raise error
                # A stream that broke under the request means its replica is gone: every request it held fails
                # at once, once, and no retry goes back to it (it is marked down), so these retries cannot
                # feed a storm and take no unit of the budget, which guards against retrying into overload.
                if not isinstance(error, StreamLost):
                    if not self.budget.try_retry():
                        raise Unavailable(f"{error.message} (not retried: the retry budget is spent)")
                    holds_retry = True
                log.warning("request for %s/%s failed on %s (%s); retrying", *key, replica.replica_id, error.message)
                self.retries[key] = self.retries.get(key, 0) + 1
                metrics.SCHEDULER_RETRIES.labels(*key).inc()
                attempt += 1
        finally:
            if holds_retry:
                self.budget.retry_done()
            self.budget.end()

    async def _try_once(self, key: Key, replica: Replica, request: InferRequest, options: RequestOptions,
                        work: Work | None) -> Answer:  # fmt: skip
        """One try on ``replica`` and no other (a sequence's request): a retryable failure is its error."""
        try:
            return await self._try(key, replica, request, options, work)
        except _Retryable as failed:
            raise failed.error from None

    async def _wait_for_recovery(self, key: Key, options: RequestOptions, coming: Recovering) -> None:
        """Wait for the routing table to change while ``key``'s replica brings it back (its deadline at most)."""
        left = options.remaining_s(self.clock())
        wait_s = self.policy.per_try_timeout_s if left is None else min(left, self.policy.per_try_timeout_s)
        if wait_s > 0 and await self.mirror.next_change(wait_s):
            return
        if left is not None and left <= wait_s:
            raise DeadlineExceeded(f"{coming.message}; the request's deadline passed meanwhile")
        raise Unavailable(f"{coming.message}, and it has not come back within {wait_s:g} s")

    async def _try(self, key: Key, replica: Replica, request: InferRequest, options: RequestOptions,
                   work: Work | None) -> Answer:  # fmt: skip
        timeout_s = self.policy.per_try_timeout_s
        per_try_binds = True
        left = options.remaining_s(self.clock())
        if left is not None:
            if left <= 0:
                raise DeadlineExceeded("the deadline passed before the request reached a replica")
            if left < timeout_s:
                timeout_s, per_try_binds = left, False
        started = self.clock()
        self.router.sent(replica)
        answered = False
        try:
            async with asyncio.timeout(timeout_s):
                answer = await replica.client.infer(request, options, work)
            answered = True
        except TimeoutError:
            if not per_try_binds:
                raise DeadlineExceeded("the request's deadline passed before its replica answered") from None
            exc = DeadlineExceeded(
                f"replica {replica.replica_id} did not answer within the per-try timeout of {timeout_s:g} s"
            )
            self.router.failed(replica, exc, key, self.clock() - started)
            raise _Retryable(exc) from None
        except AIWorksError as exc:
            answered = exc.status is not Status.UNAVAILABLE  # the replica itself said so
            if exc.status in _REPLICA_FAULTS:
                self.router.failed(replica, exc)
            if exc.status is Status.UNAVAILABLE:
                raise _Retryable(exc) from None
            raise
        finally:
            if answered:
                self.router.answered(replica)
            else:
                replica.outstanding -= 1
        self.router.succeeded(replica, key, self.clock() - started)
        return answer

    # ---- what this gateway tells the scheduler --------------------------------------------

    def report(self, gateway_id: str) -> RoutingReport:
        replicas = []
        for r in self.mirror.replicas.values():
            h = r.health
            replicas.append(
                ReplicaView(
                    replica_id=r.replica_id, address=r.address, device=r.device, live=r.live,
                    outstanding_batches=r.outstanding, outstanding_rows=0, last_heartbeat_age_s=0.0, models=[],
                    ejected=self.outliers.ejected(h), ejected_for_s=self.outliers.remaining_s(h),
                    times_ejected=h.times_ejected, consecutive_errors=h.consecutive_errors,
                    ewma_latency_ms=h.mean_latency_s() * 1e3, batches_done=h.batches, rows_done=h.rows,
                )  # fmt: skip
            )
        active = {p.model: p.shadow for p in self.traffic.policies() if p.shadow is not None}
        return RoutingReport(gateway_id, replicas, self.budget, self.shadows.views(active), dict(self.retries),
                             self.requests)  # fmt: skip
