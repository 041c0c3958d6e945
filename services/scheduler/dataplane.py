"""The scheduler's logic, free of transport: the suite's control plane.

The scheduler is off the request path. Runtimes register and heartbeat their
models and queues; gateways watch the :meth:`Scheduler.routing_table` (which
replicas hold which versions, version weights and shadows, ejections asked
for, versions being retired, and the routing settings) and route each request
to a replica themselves (:mod:`aiworks.scheduler.client`), reporting back
what they saw every second. Queues and dynamic batching run in the runtimes,
next to the models. The scheduler loads and unloads models on every replica,
holds traffic policies, and assembles the global view (:meth:`status`):
queues summed over replicas, ejections and retries over gateways.

Why the request path left the scheduler (docs/architecture.md): every hop
between Python processes costs CPU per request; with the scheduler on the
path a request crossed two, and a scheduler restart lost what it held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Unavailable
from aiworks.core.inference import ModelStatistics
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.model_config import ModelSpec, ModelState
from aiworks.core.names import check_model_name
from aiworks.core.rpc import MAX_RECONNECT_BACKOFF_S
from aiworks.scheduler.drain import Drainer
from aiworks.scheduler.pipeline import is_pipeline, parse_steps
from aiworks.scheduler.policy import RoutingPolicy
from aiworks.scheduler.registry import Key, Replica, ReplicaRegistry
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.shadow import ShadowView
from aiworks.scheduler.traffic_state import TrafficPolicy, TrafficState
from aiworks.scheduler.traffic_store import TrafficStore
from aiworks.scheduler.views import (
    DrainingVersion,
    EjectionOrder,
    GatewayView,
    QueueView,
    ReplicaView,
    RouteReplica,
    RoutingReport,
    RoutingTable,
    StatusView,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ejection:
    """The outcome of :meth:`Scheduler.eject_replica`."""

    ejected: bool
    ejected_for_s: float
    message: str


@dataclass
class _Ejected:
    id: int
    until_s: float
    reason: str


class Scheduler:
    """The control plane: replicas, models, traffic policies, ejections, and the routing table gateways watch.

    Its clock (monotonic seconds) is injectable, so ejection and report
    expiry run on a fake one in tests.
    """

    def __init__(self, settings: SchedulerSettings, registry: ReplicaRegistry, *,
                 clock: Callable[[], float] = time.monotonic, store: TrafficStore | None = None):  # fmt: skip
        self.settings = settings
        self.store = store  # where traffic policies outlive this process (aiworks.scheduler.traffic_store)
        self.started_s = clock()
        self.registry = registry
        self.clock = clock
        self.policy = RoutingPolicy.from_settings(settings)
        self.traffic = TrafficState()
        self._ejected: dict[str, _Ejected] = {}
        self._ejection_ids = itertools.count(1)
        self._reports: dict[str, tuple[float, RoutingReport]] = {}
        # Models being (re)loaded -> the versions served before: new versions appear in the routing table
        # only once every replica has loaded them, so all gateways switch together.
        self._loading: dict[str, set[Key]] = {}
        self.drainer = Drainer(self._busy, timeout_s=settings.drain_timeout_s, poll_s=0.1, clock=clock)
        self._background: set[asyncio.Task] = set()

    # ---- the routing table ---------------------------------------------------------------

    def routing_table(self) -> RoutingTable:
        """What gateways route by, now."""
        registry = self.registry
        now = self.clock()
        draining = []
        for key in sorted(registry.closing | set(registry.retiring)):
            held = registry.retiring.get(key, {})
            spec = next(iter(held.values()), None) if held else None
            draining.append(DrainingVersion(key[0], key[1], key in registry.closing, tuple(sorted(held)), spec))
        return RoutingTable(
            generation=registry.generation,
            replicas=[
                RouteReplica(r.replica_id, r.address, r.device, dict(r.labels),
                             tuple(s for k, s in r.models.items() if _routable(s) and self._published(k)),
                             tuple(r.kv.values()) if r.kv else (), now - r.kv_at_s if r.kv else 0.0,
                             r.stopping)  # fmt: skip
                # A stopping replica stays in the table while it drains, for the sequences it holds.
                for r in registry.replicas.values() if r.live or r.stopping
            ],
            traffic=self.traffic.policies(),
            draining=draining,
            ejections=[EjectionOrder(rid, e.until_s - now, e.reason, e.id)
                       for rid, e in sorted(self._ejected.items()) if e.until_s > now],  # fmt: skip
            known=sorted(registry.known),
            policy=self.policy,
        )

    async def warmed_up(self, poll_s: float = 0.05) -> None:
        """Return when the first table may go out: a runtime is live and every running one had its
        chance to register again, or ``startup_grace_s`` passed.

        A scheduler that just (re)started knows no replica yet; the running runtimes register again
        at their next heartbeat, one by one: within two heartbeat intervals, plus the channel's
        longest reconnect backoff (:data:`aiworks.core.rpc.MAX_RECONNECT_BACKOFF_S`). A table holding
        only the first of them would send a gateway every request to the versions that one holds (a
        90/10 split became 0/100 for a moment, and a model on a later runtime had no replica).
        Meanwhile a gateway keeps routing by the table it has. On a fresh start the runtimes load
        their models first, so the wait mostly overlaps that.
        """
        settle_s = min(2 * self.settings.heartbeat_interval_s + MAX_RECONNECT_BACKOFF_S, self.settings.startup_grace_s)
        while True:
            elapsed = self.clock() - self.started_s
            if elapsed >= self.settings.startup_grace_s or (elapsed >= settle_s and self.registry.live()):
                return
            await asyncio.sleep(poll_s)

    def _published(self, key: Key) -> bool:
        before = self._loading.get(key[0])
        return before is None or key in before

    async def changes(self, generation: int) -> int:
        """Wait until the routing table's generation differs from ``generation``; return the new one."""
        changed = self.registry.changed
        async with changed:
            await changed.wait_for(lambda: self.registry.generation != generation)
        return self.registry.generation

    def report(self, report: RoutingReport) -> None:
        """A gateway's routing state, for the global view (:meth:`status`)."""
        self._reports[report.gateway_id] = (self.clock(), report)

    def forget_gateway(self, gateway_id: str) -> None:
        self._reports.pop(gateway_id, None)

    # ---- traffic policy ------------------------------------------------------------------

    def set_traffic(self, policy: TrafficPolicy, *, keep_shadow: bool = False) -> TrafficPolicy:
        """Put ``policy`` in force; ``keep_shadow``: its shadow is ignored and the one in force stays."""
        policy = self._checked_traffic(policy, keep_shadow)
        self._put_traffic(policy)
        return policy

    async def store_traffic(self, policy: TrafficPolicy, *, keep_shadow: bool = False) -> TrafficPolicy:
        """As :meth:`set_traffic`, stored first where policies outlive this process (Unavailable if it cannot be)."""
        policy = self._checked_traffic(policy, keep_shadow)
        if self.store is not None:  # the seed it was reconciled with stays: a restart must not re-apply it
            await self.store.save(policy, self.store.seeds.get(policy.model))
        self._put_traffic(policy)
        return policy

    def _checked_traffic(self, policy: TrafficPolicy, keep_shadow: bool) -> TrafficPolicy:
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
            if any(is_pipeline(s) for k, s in self.registry.known.items() if k[0] == policy.model and s):
                raise InvalidArgument(f"model '{policy.model}' is a pipeline; shadow its stage models instead")
        return policy

    def _put_traffic(self, policy: TrafficPolicy, how: str = "") -> None:
        self.traffic.set(policy)
        self.registry.notify()
        shadow = policy.shadow
        log.info(
            "traffic policy of %s%s: %s%s",
            policy.model,
            how,
            dict(policy.weights) or "latest version",
            f", shadow v{shadow.version} ({shadow.fraction:.0%} of requests, {shadow.compare})" if shadow else "",
        )

    def apply_stored(self, policies: dict[str, TrafficPolicy], how: str = " (stored)") -> int:
        """Make the policies in force those ``policies`` (from the store): the rest are cleared; returns changes.

        Stored policies are taken as they are: their versions may not be registered yet (a scheduler
        that just started); versions without a live replica simply get no traffic (see TrafficState).
        """
        changed = 0
        for current in self.traffic.policies():
            if current.model not in policies:
                self._put_traffic(TrafficPolicy(current.model), how)
                changed += 1
        for model, policy in sorted(policies.items()):
            if self.traffic.get(model) != policy:
                self._put_traffic(policy, how)
                changed += 1
        return changed

    async def restore_traffic(self, seed: list[TrafficPolicy] = ()) -> None:
        """At start: the stored policies in force, then the deployment's ``seed`` (the chart's canary weights).

        A seed is put in force (and stored) when the model has no stored policy, or when the seed
        differs from the one its stored policy was last reconciled with: a new value in the chart is
        a deliberate change. The same seed again (a restart, a rollout of another setting) leaves
        the stored policy alone, whatever ``aiworks traffic`` or the monitor made of it since.
        """
        stored = await self.store.load() if self.store is not None else {}
        self.apply_stored(stored)
        seeds = self.store.seeds if self.store is not None else {}
        for policy in seed:
            weights = dict(policy.weights)
            if policy.empty or (policy.model in stored and seeds.get(policy.model) == weights):
                continue
            if self.store is not None:
                try:
                    await self.store.save(policy, weights)
                except AIWorksError as exc:
                    log.warning("seed traffic policy of %s not stored: %s", policy.model, exc.message)
            self._put_traffic(policy, " (seeded)")
        if stored:
            log.info("restored %d traffic policy(ies) from the %s", len(stored), self.store.describe)

    async def follow_store(self) -> None:
        """Keep the policies in force equal to the store's (another scheduler changed them); until cancelled."""
        if self.store is not None:
            await self.store.watch(self.apply_stored)

    def get_traffic(self, model: str) -> TrafficPolicy:
        return self.traffic.get(model) or TrafficPolicy(model)

    # ---- ejection on request (the monitor) -------------------------------------------------

    def eject_replica(self, replica_id: str, duration_s: float, reason: str) -> Ejection:
        """Take a replica out of every gateway's routing for ``duration_s`` (0: the base ejection time).

        Refused (``ejected`` False, with a message) when it would exceed
        ``outlier_max_ejection_percent``; an unknown replica is NOT_FOUND.
        Requests already sent to it finish.
        """
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise InvalidArgument(f"duration_s must be a finite number of seconds, 0 or more, not {duration_s}")
        if replica_id not in self.registry.replicas:
            raise NotFound(f"unknown replica '{replica_id}'; known: {sorted(self.registry.replicas)}")
        reason = reason or "unspecified"
        now = self.clock()
        ejected_now = {rid for rid, e in self._ejected.items() if e.until_s > now and rid in self.registry.replicas}
        population = len(self.registry.replicas)
        allowed = max(1, math.floor(population * self.policy.outlier_max_ejection_percent / 100))
        if replica_id not in ejected_now and len(ejected_now) + 1 > allowed:
            percent = self.policy.outlier_max_ejection_percent
            message = (
                f"replica {replica_id} not ejected: with it, more than {percent:g}% of "
                f"{population} replica(s) would be out (outlier_max_ejection_percent)"
            )
            log.warning("%s (asked because: %s)", message, reason)
            return Ejection(False, 0.0, message)
        for_s = min(duration_s or self.policy.outlier_base_ejection_s, self.policy.outlier_max_ejection_s)
        earlier = self._ejected.get(replica_id)
        if earlier is not None and earlier.until_s > now + for_s:  # an earlier, longer ejection stands
            for_s = earlier.until_s - now
        else:
            self._ejected[replica_id] = _Ejected(next(self._ejection_ids), now + for_s, reason)
            self.registry.notify()
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
                return all(self.model_ready(s.model, s.version) for s in parse_steps(spec))
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

    async def load(self, model: str, overrides: LoadOverrides | None = None) -> list[ModelSpec]:
        """(Re)load ``model`` on every replica; versions the reload retires drain before they go.

        While the reload runs, gateways keep routing by the versions served
        before it: new versions appear once every replica has loaded them, so
        all gateways switch at once. A version that vanishes from a replica is
        marked retiring (the registry's guard); once all replicas answered,
        such versions that no replica still serves are released when no
        replica reports a queue of them any more (the runtimes keep them until
        idle).

        ``overrides`` (Triton's ``config`` and ``file:`` load parameters) go
        to every replica as they are; each applies them to its repository.
        """
        check_model_name(model)
        started = time.perf_counter()

        async def one(replica: Replica):
            specs = await replica.client.load(model, overrides)
            others = [s for s in replica.models.values() if s.name != model]
            self.registry.set_models(replica, others + specs)
            return specs

        protected = self.registry.guard(model)
        self._loading[model] = set(protected)
        try:
            results = await self._on_all(one, f"load of {model}")
        finally:
            del self._loading[model]
            retired = [k for k in protected if k in self.registry.retiring and not self.registry.advertisers(k)]
            self.registry.release(protected - set(retired))  # notifies: the new versions show from now on
            self._drain_later(retired)
        log.info(
            "loaded model %s on %d replica(s) in %.0f ms", model, len(results), (time.perf_counter() - started) * 1e3
        )
        return next(r for _, r in results if not isinstance(r, BaseException))

    async def unload(self, model: str) -> None:
        """Stop routing new requests to ``model``, let each replica answer its queued ones, then unload it."""
        check_model_name(model)
        keys = {k for r in self.registry.live() for k in r.models if k[0] == model}
        if not keys and not any(k[0] == model for k in self.registry.known):
            raise NotFound(f"unknown model '{model}'")
        self.registry.close(keys)  # gateways stop sending new requests as soon as their table says so
        try:

            async def one(replica: Replica):
                # The runtime drains its queues of the model before it unloads it.
                await replica.client.unload(model, timeout_s=self.settings.drain_timeout_s + 10)
                await self._beat_without(replica, model)
                self.registry.set_models(replica, [s for s in replica.models.values() if s.name != model])

            await self._on_all(one, f"unload of {model}")
        except BaseException:
            self.registry.release(keys)  # still loaded somewhere: it serves again
            raise
        self.registry.release(keys)
        self.registry.forget_model(model)
        log.info("unloaded model %s", model)

    async def _beat_without(self, replica: Replica, model: str) -> None:
        """Wait (three heartbeat intervals at most) for a heartbeat of ``replica`` that no longer lists ``model``.

        A heartbeat the runtime sent before its unload finished may still arrive after it, listing the model
        ready again: the gateways' tables would show it loaded after the unload answered. The runtime sends one
        heartbeat at a time, each an interval after the last one's sending, so the first one sent after its
        unload returned (within an interval) no longer lists the model.
        """
        seen = replica.beats
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3 * self.settings.heartbeat_interval_s
        while loop.time() < deadline:
            if replica.beats > seen and not any(k[0] == model for k in replica.models):
                return
            await asyncio.sleep(0.01)

    # ---- draining retired versions ----------------------------------------------------------

    def _busy(self, key: Key) -> bool:
        """Whether a replica still reports a queue of ``key`` (its heartbeat; the runtime drops it once idle)."""
        return any((q.model, q.version) == key for r in self.registry.live() for q in r.queues)

    def _drain_later(self, keys: list[Key]) -> None:
        if not keys:
            return
        log.info("retiring %s: draining", ", ".join(f"{m}/{v}" for m, v in keys))

        async def drain():
            try:
                await self.drainer.wait(keys)
            finally:
                self.registry.release(keys)

        task = asyncio.get_running_loop().create_task(drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    # ---- the global view -------------------------------------------------------------------

    def _fresh_reports(self) -> list[RoutingReport]:
        limit = 3 * self.settings.heartbeat_interval_s + 2
        now = self.clock()
        for gateway_id, (at, _) in list(self._reports.items()):
            if now - at > limit:
                del self._reports[gateway_id]
        return [report for _, report in self._reports.values()]

    def status(self) -> StatusView:
        now = self.clock()
        reports = self._fresh_reports()
        seen: dict[str, list[ReplicaView]] = {}
        for report in reports:
            for view in report.replicas:
                seen.setdefault(view.replica_id, []).append(view)
        replicas = []
        for r in self.registry.replicas.values():
            views = seen.get(r.replica_id, [])
            ordered = self._ejected.get(r.replica_id)
            ordered_left = max(0.0, ordered.until_s - now) if ordered else 0.0
            replicas.append(
                ReplicaView(
                    replica_id=r.replica_id,
                    address=r.address,
                    device=r.device,
                    live=r.live,
                    stopping=r.stopping,
                    outstanding_batches=r.inflight_batches,
                    outstanding_rows=sum(q.queued_rows for q in r.queues),
                    last_heartbeat_age_s=now - r.last_heartbeat_s,
                    models=sorted(f"{k[0]}:{k[1]}" for k, s in r.models.items() if s.ready),
                    labels=dict(r.labels),
                    ejected=ordered_left > 0 or any(v.ejected for v in views),
                    ejected_for_s=max([ordered_left, *(v.ejected_for_s for v in views)]),
                    times_ejected=max([0, *(v.times_ejected for v in views)]),
                    consecutive_errors=max([0, *(v.consecutive_errors for v in views)]),
                    ewma_latency_ms=_mean([v.ewma_latency_ms for v in views if v.ewma_latency_ms]),
                    batches_done=sum(v.batches_done for v in views),
                    rows_done=sum(v.rows_done for v in views),
                    gpus=list(r.gpus),
                    kv=sorted(r.kv.values(), key=lambda k: (k.model, k.version)) if r.kv else [],
                    kv_age_s=now - r.kv_at_s if r.kv else 0.0,
                )
            )
        queues: dict[Key, QueueView] = {}
        for r in self.registry.live():
            for q in r.queues:
                view = queues.setdefault((q.model, q.version), QueueView(q.model, q.version))
                for name in ("queued_requests", "queued_rows", "batches", "rows", "queued_realtime",
                             "queued_standard", "queued_batch", "queued_bytes", "rejected", "expired"):  # fmt: skip
                    setattr(view, name, getattr(view, name) + getattr(q, name))
        for report in reports:
            for key, retries in report.retries.items():
                queues.setdefault(key, QueueView(*key)).retries += retries
        for key, view in queues.items():
            view.draining = self.registry.draining(key)
        budget = RetryBudget(self.policy.retry_budget_percent, self.policy.retry_min_concurrency)
        for report in reports:
            b = report.retry_budget
            budget.active += b.active
            budget.active_retries += b.active_retries
            budget.allowed += b.allowed
            budget.denied += b.denied
        gateways = [
            GatewayView(gid, now - at, report.requests, sum(report.retries.values()))
            for gid, (at, report) in sorted(self._reports.items())
        ]
        return StatusView(
            replicas, [queues[k] for k in sorted(queues)], self.traffic.policies(), budget,
            shadows=_merge_shadows(reports, self.traffic.policies()), gateways=gateways,
        )  # fmt: skip

    async def expire_loop(self) -> None:
        """Remove silent replicas, judging silence only over time this process was running.

        When the loop wakes more than a heartbeat interval late, this process (or the machine) was stalled:
        the replicas' heartbeats of that time may still wait unread, and removing them for it would turn one
        stall of the scheduler into "no live replica" for every model. Silence then counts from the wake-up.
        """
        period = self.settings.heartbeat_timeout_s / 4
        listening_since = self.clock()
        while True:
            before = self.clock()
            await asyncio.sleep(period)
            late = self.clock() - before - period
            if late > self.settings.heartbeat_interval_s:
                listening_since = self.clock()
                log.warning("the scheduler did not run for %.1f s: replicas' silence counts from now", late + period)
            self.registry.expire(self.settings.heartbeat_timeout_s, listening_since)
            now = self.clock()
            for replica_id in [rid for rid, e in self._ejected.items() if e.until_s <= now]:
                del self._ejected[replica_id]

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.store is not None:
            await self.store.close()


def _routable(spec: ModelSpec) -> bool:
    """Ready, or LOADING: its backend is coming back (a restarting tritonserver) and requests wait for it."""
    return spec.ready or spec.state is ModelState.LOADING


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _merge_shadows(reports: list[RoutingReport], policies: list[TrafficPolicy]) -> list[ShadowView]:
    """Shadow counts summed over gateways; a shadow in force shows before its first copy too."""
    active = {p.model: p.shadow for p in policies if p.shadow is not None}
    merged: dict[tuple[str, str, str], ShadowView] = {}
    for report in reports:
        for s in report.shadows:
            key = (s.model, s.shadow_version, s.compare)
            view = merged.get(key)
            if view is None:
                merged[key] = ShadowView(**{**vars(s), "active": False})
                continue
            for name in ("mirrored", "compared", "agreed", "errors", "dropped", "inflight"):
                setattr(view, name, getattr(view, name) + getattr(s, name))
    for model, shadow in active.items():
        merged.setdefault((model, shadow.version, shadow.compare),
                          ShadowView(model, shadow.version, True, 0, 0, 0, 0, 0, 0.0, 0, shadow.compare))  # fmt: skip
    for (model, version, compare), view in merged.items():
        policy = active.get(model)
        view.active = policy is not None and policy.version == version and policy.compare == compare
        view.agreement = view.agreed / view.compared if view.compared else 0.0
    return [merged[k] for k in sorted(merged)]
