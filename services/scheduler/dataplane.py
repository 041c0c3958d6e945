"""The scheduler's logic, free of transport."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, Unavailable
from aiworks.core.inference import InferRequest, InferResponse, ModelStatistics
from aiworks.core.model_config import ModelSpec, ModelState, check_inputs
from aiworks.scheduler.batcher import ModelQueue
from aiworks.scheduler.registry import Key, Replica, ReplicaRegistry
from aiworks.scheduler.router import Router
from aiworks.scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)


@dataclass
class ReplicaView:
    replica_id: str
    address: str
    device: str
    live: bool
    outstanding_batches: int
    outstanding_rows: int
    last_heartbeat_age_s: float
    models: list[str]


@dataclass
class QueueView:
    model: str
    version: str
    queued_requests: int
    queued_rows: int
    batches: int
    rows: int


class Scheduler:
    """Queues requests per model version, batches them and routes batches to replicas."""

    def __init__(self, settings: SchedulerSettings, registry: ReplicaRegistry):
        self.settings = settings
        self.registry = registry
        self.router = Router(registry, settings.max_inflight_batches)
        self._queues: dict[Key, ModelQueue] = {}

    # ---- the hot path --------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        spec = self.registry.resolve(request.model, request.version)
        rows = check_inputs(spec, request.inputs)
        declared = {o.name for o in spec.outputs}
        for name in request.outputs:
            if name not in declared:
                raise InvalidArgument(f"model '{spec.name}' has no output '{name}'; it has {sorted(declared)}")
        outputs = await self._queue(spec).submit(request, rows)
        return InferResponse(spec.name, spec.version, outputs, id=request.id)

    def _queue(self, spec: ModelSpec) -> ModelQueue:
        key = (spec.name, spec.version)
        queue = self._queues.get(key)
        if queue is None or queue.spec != spec:
            if queue is not None:  # the config changed on reload; new batches use the new one
                asyncio.ensure_future(queue.close())
            queue = ModelQueue(
                spec,
                self.router,
                self._run_batch,
                batching=self.settings.batching,
                max_retries=self.settings.max_retries,
                on_transport_error=self._transport_error,
            )
            self._queues[key] = queue
        return queue

    async def _run_batch(self, replica: Replica, model: str, version: str, inputs: list[Tensor], outputs: list[str]):
        return await replica.client.execute(model, version, inputs, outputs)

    def _transport_error(self, replica: Replica, exc: AIWorksError) -> None:
        self.registry.mark_down(replica, exc.message)

    # ---- model management ----------------------------------------------------------------

    def ready(self) -> bool:
        return bool(self.registry.live())

    def model_ready(self, model: str, version: str) -> bool:
        spec = self.registry.resolve(model, version)
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
        started = time.perf_counter()

        async def one(replica: Replica):
            specs = await replica.client.load(model)
            others = [s for s in replica.models.values() if s.name != model]
            self.registry.set_models(replica, others + specs)
            return specs

        results = await self._on_all(one, f"load of {model}")
        log.info("loaded model %s on %d replica(s) in %.0f ms", model, len(results), (time.perf_counter() - started) * 1e3)
        return next(r for _, r in results if not isinstance(r, BaseException))

    async def unload(self, model: str) -> None:
        async def one(replica: Replica):
            await replica.client.unload(model)
            self.registry.set_models(replica, [s for s in replica.models.values() if s.name != model])

        await self._on_all(one, f"unload of {model}")
        self.registry.forget_model(model)
        log.info("unloaded model %s", model)

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

    def status(self) -> tuple[list[ReplicaView], list[QueueView]]:
        now = time.monotonic()
        replicas = [
            ReplicaView(
                r.replica_id,
                r.address,
                r.device,
                r.live,
                sum(r.outstanding_batches.values()),
                r.outstanding_rows,
                now - r.last_heartbeat_s,
                sorted(f"{k[0]}:{k[1]}" for k, s in r.models.items() if s.ready),
            )
            for r in self.registry.replicas.values()
        ]
        queues = [QueueView(k[0], k[1], q.depth, q.queued_rows, q.batches, q.rows_done) for k, q in self._queues.items()]
        return replicas, queues

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_timeout_s / 4)
            self.registry.expire(self.settings.heartbeat_timeout_s)

    async def close(self) -> None:
        for queue in self._queues.values():
            await queue.close()
