"""The scheduler's logic, free of transport.

:class:`Scheduler` wires the parts together: queues and batching
(``batcher``), routing (``router``), retries (``dispatch``), version weights
and shadows (``traffic_state``, ``shadow``), pipelines (``pipeline``) and the
drain that lets a retired version finish its work (``drain``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Unavailable
from aiworks.core.inference import InferRequest, InferResponse, ModelStatistics
from aiworks.core.model_config import ModelSpec, ModelState, check_inputs
from aiworks.core.names import check_model_name, check_version
from aiworks.scheduler.batcher import CHARGE, ModelQueue, QueueLimits
from aiworks.scheduler.dispatch import BatchSender, Charge
from aiworks.scheduler.drain import Drainer
from aiworks.scheduler.pipeline import PipelineRunner, is_pipeline
from aiworks.scheduler.qos import ClassResolver, Priority, parse_timeout_s
from aiworks.scheduler.registry import Key, Replica, ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.router import PoolPolicy, Router
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.shadow import ShadowMirror
from aiworks.scheduler.traffic_state import TrafficPolicy, TrafficState
from aiworks.scheduler.views import QueueView, ReplicaView, StatusView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ejection:
    """The outcome of :meth:`Scheduler.eject_replica`."""

    ejected: bool
    ejected_for_s: float
    message: str


class Scheduler:
    """Queues requests per model version, batches them and routes batches to replicas.

    Its clock (monotonic seconds) is injectable, so ejection and deadlines run
    on a fake one in tests.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        registry: ReplicaRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self.registry = registry
        self.clock = clock
        self.outliers = OutlierDetector(
            OutlierPolicy(
                consecutive_errors=settings.outlier_consecutive_errors,
                base_ejection_s=settings.outlier_base_ejection_s,
                max_ejection_s=settings.outlier_max_ejection_s,
                max_ejection_percent=settings.outlier_max_ejection_percent,
            ),
            clock,
        )
        self.router = Router(
            registry,
            settings.max_inflight_batches,
            outliers=self.outliers,
            pools=PoolPolicy.parse(settings.class_pools),
            ewma_alpha=settings.latency_ewma_alpha,
        )
        self.retry_budget = RetryBudget(settings.retry_budget_percent, settings.retry_min_concurrency)
        self.sender = BatchSender(
            self.router,
            self._run_batch,
            self.retry_budget,
            max_retries=settings.max_retries,
            per_try_timeout_s=settings.runtime_timeout_s,
            clock=clock,
        )
        self.classes = ClassResolver(Priority.named(settings.default_priority))
        self.traffic = TrafficState()
        self._limits = QueueLimits(
            settings.max_queue_requests, settings.max_queue_bytes, settings.priority_aging_ms / 1e3
        )
        self._queues: dict[Key, ModelQueue] = {}
        self._requests = metrics.Children(metrics.SCHEDULER_REQUESTS)
        self.shadows = ShadowMirror(
            self._run_shadow, max_inflight=settings.shadow_max_inflight, timeout_s=settings.shadow_timeout_s
        )
        self.pipelines = PipelineRunner(self._run_stage, micro_batch_rows=settings.pipeline_micro_batch_rows)
        self.drainer = Drainer(self._busy, timeout_s=settings.drain_timeout_s, clock=clock)
        self._background: set[asyncio.Task] = set()

    # ---- the hot path --------------------------------------------------------------------

    async def infer(
        self, request: InferRequest, *, timeout_s: float | None = None, charge: Charge | None = None
    ) -> InferResponse:
        """Run one request; ``timeout_s`` is the transport's deadline, the ``timeout`` parameter applies too.

        ``charge`` receives the runtime time spent on the request (its share of
        each batch it ran in), whether it succeeds or fails.
        """
        priority = self.classes.default
        spec = None
        token = CHARGE.set(charge)  # pipeline steps inherit it; shadow copies run in a context of their own
        try:
            check_model_name(request.model)
            check_version(request.version)
            priority = self.classes.priority(request)
            param_timeout_s = parse_timeout_s(request.parameters.get("timeout"))
            timeouts = [t for t in (timeout_s, param_timeout_s) if t is not None]
            deadline_s = self.clock() + min(timeouts) if timeouts else None
            version = request.version
            if not version and self.traffic.get(request.model) is not None:
                version = self.traffic.choose(request.model, self.registry.versions(request.model)) or ""
            spec = self.registry.resolve(request.model, version)
            rows = check_inputs(spec, request.inputs)
            declared = {o.name for o in spec.outputs}
            for name in request.outputs:
                if name not in declared:
                    raise InvalidArgument(f"model '{spec.name}' has no output '{name}'; it has {sorted(declared)}")
            if is_pipeline(spec):
                outputs = await self.pipelines.run(spec, request, rows, priority, deadline_s)
            else:
                # The copy runs on a task of its own (copies batch together); the client never waits for it.
                copy = self.shadows.begin(self.traffic.shadow(spec.name), request, spec.version)
                outputs = None
                try:
                    outputs = await self._queue(spec).submit(request, rows, priority, deadline_s)
                finally:
                    self.shadows.finish(copy, outputs)
        except BaseException as exc:
            self._count_failure(request, spec, priority, exc)
            raise
        finally:
            CHARGE.reset(token)
        self._requests(spec.name, spec.version, priority.label, "ok").inc()
        response = InferResponse(spec.name, spec.version, outputs, id=request.id)
        if charge is not None:
            response.compute_s = charge.compute_ns / 1e9
        return response

    def _count_failure(self, request: InferRequest, spec: ModelSpec | None, priority: Priority, exc) -> None:
        """Count a failed request; before it resolved, only a known model (and version) becomes a label."""
        known = self.registry.known
        if spec is not None:
            model, version = spec.name, spec.version
        elif (request.model, request.version) in known:
            model, version = request.model, request.version
        elif any(k[0] == request.model for k in known):
            model, version = request.model, ""
        else:
            model, version = "", ""
        status = metrics.status_label(exc)
        self._requests(model, version, priority.label, status).inc()
        if status == "deadline_exceeded":
            metrics.SCHEDULER_TIMEOUTS.labels(model, version).inc()
        elif spec is None and status == "unavailable":  # known, but no live replica holds it
            metrics.SCHEDULER_REJECTIONS.labels(model, version, "no_replica").inc()

    def _queue(self, spec: ModelSpec) -> ModelQueue:
        key = (spec.name, spec.version)
        queue = self._queues.get(key)
        if queue is None or queue.spec != spec:
            if queue is not None:  # the config changed on reload; new batches use the new one
                asyncio.ensure_future(queue.close())
            queue = ModelQueue(
                spec, self.router, self.sender, batching=self.settings.batching, limits=self._limits, clock=self.clock
            )
            self._queues[key] = queue
        return queue

    async def _run_batch(
        self, replica: Replica, model: str, version: str, inputs: list[Tensor], outputs: list[str], timeout_s: float
    ) -> tuple[list[Tensor], int]:
        return await replica.client.execute(model, version, inputs, outputs, timeout_s)

    async def _run_stage(
        self,
        model: str,
        version: str,
        inputs: list[Tensor],
        outputs: list[str],
        priority: Priority,
        deadline_s: float | None,
    ) -> list[Tensor]:
        """One pipeline step: the stage model's own queue, so stage requests batch across pipeline requests."""
        spec = self.registry.resolve(model, version)
        request = InferRequest(model, spec.version, inputs, outputs)
        rows = check_inputs(spec, inputs)
        if is_pipeline(spec):  # a pipeline as a step of another
            return await self.pipelines.run(spec, request, rows, priority, deadline_s)
        return await self._queue(spec).submit(request, rows, priority, deadline_s)

    async def _run_shadow(self, request: InferRequest, timeout_s: float) -> list[Tensor]:
        """A shadow copy: the batch class, its own time limit; errors stay with the shadow's counts."""
        spec = self.registry.resolve(request.model, request.version)
        rows = check_inputs(spec, request.inputs)
        return await self._queue(spec).submit(request, rows, Priority.BATCH, self.clock() + timeout_s)

    # ---- traffic policy ------------------------------------------------------------------

    def set_traffic(self, policy: TrafficPolicy, *, keep_shadow: bool = False) -> TrafficPolicy:
        """Put ``policy`` in force; ``keep_shadow``: its shadow is ignored and the one in force stays."""
        known = {k[1] for k in self.registry.known if k[0] == policy.model}
        if not known:
            raise NotFound(f"unknown model '{policy.model}'")
        if keep_shadow:
            policy = TrafficPolicy(policy.model, policy.weights, self.traffic.shadow(policy.model))
        unknown = sorted(set(policy.weights) - known)
        if unknown:
            raise InvalidArgument(f"model '{policy.model}' has no version(s) {unknown}; it has {sorted(known)}")
        shadow = policy.shadow
        if shadow is not None:
            if shadow.version not in known:
                raise InvalidArgument(
                    f"model '{policy.model}' has no version {shadow.version} to shadow; it has {sorted(known)}"
                )
            if any(is_pipeline(s) for k, s in self.registry.known.items() if k[0] == policy.model):
                raise InvalidArgument(f"model '{policy.model}' is a pipeline; shadow its stage models instead")
        self.traffic.set(policy)
        log.info(
            "traffic policy of %s: %s%s",
            policy.model,
            dict(policy.weights) or "latest version",
            f", shadow v{shadow.version} ({shadow.fraction:.0%} of requests, {shadow.compare})" if shadow else "",
        )
        return policy

    def get_traffic(self, model: str) -> TrafficPolicy:
        return self.traffic.get(model) or TrafficPolicy(model)

    # ---- ejection on request (the monitor) -------------------------------------------------

    def eject_replica(self, replica_id: str, duration_s: float, reason: str) -> Ejection:
        """Take a replica out of routing for ``duration_s`` (0: the base ejection time).

        Refused (``ejected`` False, with a message) when it would exceed
        ``outlier_max_ejection_percent``; an unknown replica is NOT_FOUND.
        Batches already running on it finish.
        """
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise InvalidArgument(f"duration_s must be a finite number of seconds, 0 or more, not {duration_s}")
        replica = self.registry.replicas.get(replica_id)
        if replica is None:
            raise NotFound(f"unknown replica '{replica_id}'; known: {sorted(self.registry.replicas)}")
        reason = reason or "unspecified"
        population = [r.health for r in self.registry.replicas.values()]
        ejected, for_s = self.outliers.eject(replica.health, population, duration_s, reason)
        if not ejected:
            percent = self.outliers.policy.max_ejection_percent
            message = (
                f"replica {replica_id} not ejected: with it, more than {percent:g}% of "
                f"{len(population)} replica(s) would be out (outlier_max_ejection_percent)"
            )
            log.warning("%s (asked because: %s)", message, reason)
            return Ejection(False, 0.0, message)
        metrics.SCHEDULER_EJECTIONS.labels(replica_id, "monitor").inc()
        message = f"replica {replica_id} ejected for {for_s:.1f} s: {reason}"
        log.warning("%s", message)
        return Ejection(True, for_s, message)

    # ---- model management ----------------------------------------------------------------

    def ready(self) -> bool:
        return bool(self.registry.live())

    def model_ready(self, model: str, version: str) -> bool:
        spec = self.registry.resolve(model, version)
        if is_pipeline(spec):  # ready when every step's model is
            try:
                return all(self.model_ready(s.model, s.version) for s in self.pipelines.steps(spec))
            except AIWorksError:
                return False
        return bool(self.registry.holders((spec.name, spec.version)))

    def metadata(self, model: str, version: str) -> tuple[ModelSpec, list[str]]:
        spec = self.registry.resolve(model, version)
        return spec, self.registry.versions(model)

    def _replicas(self) -> list[Replica]:
        replicas = self.registry.live()
        if not replicas:
            raise Unavailable("no runtime replica is live")
        return replicas

    async def _on_all(self, call, what: str) -> list:
        """Run ``call(replica)`` on every live replica; fail only if all fail."""
        replicas = self._replicas()
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        for r, e in zip(replicas, results):
            if isinstance(e, BaseException):
                log.warning("%s failed on replica %s: %s", what, r.replica_id, e)
        if len(errors) == len(results):
            raise errors[0]
        return list(zip(replicas, results))

    async def load(self, model: str) -> list[ModelSpec]:
        """(Re)load ``model`` on every replica; versions the reload retires drain before they go.

        While the reload runs, a version that vanishes from a replica stays
        routable there (the registry's guard); once all replicas answered,
        such versions that no replica still serves are drained in the
        background: the runtimes keep them until no batch arrives any more.
        """
        check_model_name(model)
        started = time.perf_counter()

        async def one(replica: Replica):
            specs = await replica.client.load(model)
            others = [s for s in replica.models.values() if s.name != model]
            self.registry.set_models(replica, others + specs)
            return specs

        protected = self.registry.guard(model)
        try:
            results = await self._on_all(one, f"load of {model}")
        finally:
            # Gone from every replica: drain. Still served somewhere: those replicas take its queue.
            retired = [k for k in protected if k in self.registry.retiring and not self.registry.advertisers(k)]
            self.registry.release(protected - set(retired))
            self._drain_later(retired)
        log.info(
            "loaded model %s on %d replica(s) in %.0f ms", model, len(results), (time.perf_counter() - started) * 1e3
        )
        return next(r for _, r in results if not isinstance(r, BaseException))

    async def unload(self, model: str) -> None:
        """Stop taking requests for ``model``, let its queued and running batches finish, then unload it."""
        check_model_name(model)
        keys = {k for r in self.registry.live() for k in r.models if k[0] == model}
        self.registry.close(keys)
        try:
            await self.drainer.wait(keys)

            async def one(replica: Replica):
                await replica.client.unload(model)
                self.registry.set_models(replica, [s for s in replica.models.values() if s.name != model])

            await self._on_all(one, f"unload of {model}")
        except BaseException:
            self.registry.release(keys)  # still loaded somewhere: it serves again
            raise
        self.registry.release(keys)
        self._forget_queues(keys)
        self.registry.forget_model(model)
        log.info("unloaded model %s", model)

    # ---- draining retired versions ----------------------------------------------------------

    def _busy(self, key: Key) -> bool:
        queue = self._queues.get(key)
        if queue is not None and (queue.depth or queue.running):
            return True
        return any(r.outstanding_batches.get(key, 0) for r in self.registry.replicas.values())

    def _drain_later(self, keys: list[Key]) -> None:
        if not keys:
            return
        log.info("retiring %s: draining", ", ".join(f"{m}/{v}" for m, v in keys))

        async def drain():
            try:
                await self.drainer.wait(keys)
            finally:
                self.registry.release(keys)
                self._forget_queues(keys)

        task = asyncio.get_running_loop().create_task(drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _forget_queues(self, keys) -> None:
        """Close the queues of retired versions (failing whatever is left after a drain timeout)."""
        for key in keys:
            if self.registry.advertisers(key):  # loaded again meanwhile
                continue
            queue = self._queues.pop(key, None)
            if queue is not None:
                asyncio.ensure_future(
                    queue.close(Unavailable(f"model '{key[0]}' version {key[1]} was retired before this request ran"))
                )

    async def index(self, ready_only: bool) -> list[ModelSpec]:
        results = await self._on_all(lambda r: r.client.index(ready_only), "repository index")
        merged: dict[Key, ModelSpec] = {}
        for _, specs in results:
            if isinstance(specs, BaseException):
                continue
            for s in specs:
                key = (s.name, s.version)
                if key not in merged or (s.state is ModelState.READY and not merged[key].ready):
                    merged[key] = s
        # A model loaded somewhere is not also "unavailable" with no version.
        loaded = {k[0] for k, s in merged.items() if s.ready}
        return sorted(
            (s for k, s in merged.items() if s.ready or k[0] not in loaded), key=lambda s: (s.name, s.version)
        )

    async def statistics(self, model: str, version: str) -> list[tuple[str, list[ModelStatistics]]]:
        if model:
            spec = self.registry.resolve(model, version)
            model, version = spec.name, (version and spec.version)
        results = await self._on_all(lambda r: r.client.statistics(model, version), "statistics")
        return [(r.replica_id, s) for r, s in results if not isinstance(s, BaseException)]

    # ---- visible state ---------------------------------------------------------------------

    def status(self) -> StatusView:
        now = time.monotonic()
        replicas = [
            ReplicaView(
                replica_id=r.replica_id,
                address=r.address,
                device=r.device,
                live=r.live,
                outstanding_batches=sum(r.outstanding_batches.values()),
                outstanding_rows=r.outstanding_rows,
                last_heartbeat_age_s=now - r.last_heartbeat_s,
                models=sorted(f"{k[0]}:{k[1]}" for k, s in r.models.items() if s.ready),
                labels=dict(r.labels),
                ejected=self.outliers.ejected(r.health),
                ejected_for_s=self.outliers.remaining_s(r.health),
                times_ejected=r.health.times_ejected,
                consecutive_errors=r.health.consecutive_errors,
                ewma_latency_ms=r.health.mean_latency_s() * 1e3,
                batches_done=r.health.batches,
                rows_done=r.health.rows,
                gpus=list(r.gpus),
            )
            for r in self.registry.replicas.values()
        ]
        queues = [
            QueueView(
                model=k[0],
                version=k[1],
                queued_requests=q.depth,
                queued_rows=q.queued_rows,
                batches=q.batches,
                rows=q.rows_done,
                queued_realtime=q.state.counts[Priority.REALTIME],
                queued_standard=q.state.counts[Priority.STANDARD],
                queued_batch=q.state.counts[Priority.BATCH],
                queued_bytes=q.state.nbytes,
                rejected=q.rejected,
                expired=q.expired,
                retries=self.sender.retries.get(k, 0),
                draining=self.registry.draining(k),
            )
            for k, q in self._queues.items()
        ]
        active = {p.model: p.shadow for p in self.traffic.policies() if p.shadow is not None}
        return StatusView(
            replicas, queues, self.traffic.policies(), self.retry_budget, shadows=self.shadows.views(active)
        )

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_timeout_s / 4)
            self.registry.expire(self.settings.heartbeat_timeout_s)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for queue in self._queues.values():
            await queue.close()
