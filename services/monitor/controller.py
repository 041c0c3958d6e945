"""The monitor's control loop: observe, judge, act, and say so.

Each round (``interval_s``):

1. ask the :class:`~aiworks.monitor.platform.Platform` what runs where;
2. collect the metrics of every target and turn them into signals;
3. restart services that died (at most ``restart_max`` times per
   ``restart_window_s``, then give up and say so: a crash loop needs a person);
4. score each replica's health, and report anomalies against its learned
   baseline;
5. ask the scheduler to eject a replica whose recent batches keep failing;
6. scale each runtime pool out or in (:mod:`aiworks.monitor.scaling_state`).

Every action, refused action and anomaly becomes an event and a metric. The
loop owns no I/O of its own: the platform, the collector and the clock are
handed in, so the unit tests run it round by round against fakes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiworks.core.errors import AIWorksError
from aiworks.monitor import events as ev
from aiworks.monitor.anomaly import AnomalyDetector, ErrorWindow
from aiworks.monitor.collect import Collector
from aiworks.monitor.discovery import DEAD, RUNNING, Inventory
from aiworks.monitor.events import EventLog
from aiworks.monitor.health import Health, health_score
from aiworks.monitor.metrics import MonitorMetrics
from aiworks.monitor.platform import Platform
from aiworks.monitor.scaling_state import PoolScalingState
from aiworks.monitor.settings import MonitorSettings
from aiworks.monitor.signals import Observation, Observer

log = logging.getLogger(__name__)

DEAD_REASON = "dead"
ERRORS_REASON = "errors"


class Controller:
    """One monitor's control loop; :meth:`tick` is one round, :meth:`run` loops until stopped."""

    def __init__(
        self,
        settings: MonitorSettings,
        platform: Platform,
        collector: Collector,
        events: EventLog,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: MonitorMetrics | None = None,
    ):
        self.s = settings
        self.platform = platform
        self.collector = collector
        self.events = events
        self.clock = clock
        self.metrics = metrics or MonitorMetrics()
        self.observer = Observer()
        self.anomalies = AnomalyDetector(settings)
        self.health: dict[str, Health] = {}
        self.last: Observation | None = None
        self._windows: dict[str, ErrorWindow] = {}
        self._scaling: dict[str, PoolScalingState] = {}
        self._dead_since: dict[str, float] = {}
        self._restarts: dict[str, deque[float]] = {}
        self._gave_up: set[str] = set()
        self._ejected_at: dict[str, float] = {}

    # ---- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                await self.tick()
            except Exception:  # a bug in one round must not end the monitor
                log.exception("control loop round failed")
            wait_s = max(0.0, self.s.interval_s - (self.clock() - started))
            try:
                await asyncio.wait_for(stop.wait(), wait_s)
            except TimeoutError:
                pass

    async def tick(self) -> Observation | None:
        """One round; returns what it saw, or ``None`` when discovery failed."""
        now = self.clock()
        try:
            inventory = await self.platform.inventory()
        except AIWorksError as exc:
            log.warning("discovery through %s failed: %s", self.platform.name, exc)
            return None
        targets = inventory.targets()
        samples = await self.collector.collect(targets) if targets else {}
        obs = self.observer.observe(now, inventory, samples)
        if self.s.restart:
            await self._restart_dead(now, inventory)
        self._judge(now, obs)
        if self.s.eject:
            await self._eject_failing(now, obs)
        if self.s.autoscale:
            await self._autoscale(now, obs)
        self.metrics.replicas.labels("desired").set(sum(p.desired for p in obs.pools.values()))
        self.metrics.replicas.labels("running").set(sum(p.running for p in obs.pools.values()))
        self.last = obs
        return obs

    # ---- events and metrics ----------------------------------------------------------------

    def _acted(self, action: str, target: str, reason: str, message: str, **details: Any) -> None:
        self.metrics.actions.labels(action, reason).inc()
        self.events.record(action, target, reason, message, **details)

    def _failed(self, action: str, target: str, reason: str, exc: AIWorksError) -> None:
        self.events.record(
            ev.ACTION_FAILED, target, reason, f"{action} of {target} failed: {exc}",
            action=action, status=exc.status.name.lower(),
        )  # fmt: skip

    # ---- restarts --------------------------------------------------------------------------

    async def _restart_dead(self, now: float, inventory: Inventory) -> None:
        s = self.s
        present = {svc.name for svc in inventory.services}
        for name in list(self._dead_since):
            if name not in present:
                del self._dead_since[name]
        for svc in inventory.services:
            if svc.kind == "monitor":
                continue
            if svc.state != DEAD:
                self._dead_since.pop(svc.name, None)
                continue
            since = self._dead_since.setdefault(svc.name, now)
            if now - since < s.restart_grace_s:
                continue
            history = self._restarts.setdefault(svc.name, deque())
            while history and history[0] <= now - s.restart_window_s:
                history.popleft()
            if len(history) >= s.restart_max:
                if svc.name not in self._gave_up:
                    self._gave_up.add(svc.name)
                    self.events.record(
                        ev.RESTART_GAVE_UP, svc.name, "crash_loop",
                        f"{svc.name} died {len(history)} times within {s.restart_window_s:.0f} s; "
                        "not restarting it again until the window passes",
                        restarts=len(history), window_s=s.restart_window_s,
                    )  # fmt: skip
                continue
            self._gave_up.discard(svc.name)
            history.append(now)
            try:
                done = await self.platform.restart(svc)
            except AIWorksError as exc:
                self._failed(ev.RESTART, svc.name, DEAD_REASON, exc)
                continue
            self._dead_since.pop(svc.name, None)
            self._acted(
                ev.RESTART, svc.name, DEAD_REASON, f"{svc.name} {svc.detail or 'was dead'}; {done}",
                service_kind=svc.kind, dead_for_s=round(now - since, 3), restarts_in_window=len(history),
            )  # fmt: skip

    # ---- health and anomalies --------------------------------------------------------------

    def _judge(self, now: float, obs: Observation) -> None:
        for rid in list(self._windows):
            if rid not in obs.replicas:
                del self._windows[rid]
                self.anomalies.forget(rid)
        health = {}
        for rid, view in obs.replicas.items():
            window = self._windows.setdefault(rid, ErrorWindow(self.s.eject_window_s))
            window.add(now, view.ok, view.failed)
            health[rid] = health_score(
                view,
                error_ratio=window.ratio,
                baseline_latency_s=self.anomalies.baseline_latency_s(rid),
                saturation_batches=self.s.saturation_batches,
            )
            for anomaly in self.anomalies.observe(view, window, now):
                self.metrics.anomalies.labels(anomaly.kind, rid).inc()
                self.events.record(ev.ANOMALY, rid, anomaly.kind, anomaly.message, **anomaly.details)
        self.health = health
        self.metrics.set_health({rid: h.score for rid, h in health.items()})

    # ---- ejection --------------------------------------------------------------------------

    async def _eject_failing(self, now: float, obs: Observation) -> None:
        s = self.s
        for rid, view in obs.replicas.items():
            window = self._windows[rid]
            if view.ejected or view.state != RUNNING:
                continue
            if window.failed < s.eject_min_errors or window.ratio < s.eject_error_ratio:
                continue
            last = self._ejected_at.get(rid)
            if last is not None and now - last < s.eject_duration_s:
                continue  # asked already; the scheduler's gauge has not caught up yet
            self._ejected_at[rid] = now
            why = f"{window.failed:.0f} of {window.total:.0f} batches failed in the last {s.eject_window_s:.0f} s"
            details = {"failed": window.failed, "total": window.total, "ratio": round(window.ratio, 3)}
            try:
                result = await self.platform.eject(rid, s.eject_duration_s, f"monitor: {why}")
            except AIWorksError as exc:
                self._failed(ev.EJECT, rid, ERRORS_REASON, exc)
                continue
            if result.ejected:
                window.clear()
                self._acted(
                    ev.EJECT, rid, ERRORS_REASON, f"ejected {rid} for {result.ejected_for_s:.0f} s: {why}",
                    ejected_for_s=result.ejected_for_s, **details,
                )  # fmt: skip
            else:
                self.events.record(
                    ev.EJECT_REFUSED, rid, ERRORS_REASON, f"the scheduler kept {rid} ({result.message}): {why}",
                    **details,
                )  # fmt: skip

    # ---- autoscaling -----------------------------------------------------------------------

    async def _autoscale(self, now: float, obs: Observation) -> None:
        for name, pool in obs.pools.items():
            state = self._scaling.setdefault(name, PoolScalingState(name, self.s))
            decision = state.decide(now, pool)
            if decision is None:
                continue
            action = ev.SCALE_OUT if decision.replicas > decision.current else ev.SCALE_IN
            try:
                await self.platform.scale(name, decision.replicas)
            except AIWorksError as exc:
                self._failed(action, name, decision.reason, exc)
                continue
            self._acted(
                action, name, decision.reason,
                f"{name}: {decision.current} -> {decision.replicas} replicas; {decision.message}",
                replicas=decision.replicas, previous=decision.current, **decision.details,
            )  # fmt: skip

    # ---- reports (the HTTP API) ------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Replicas with their health and signals, and pools with theirs, as of the last round."""
        obs = self.last
        if obs is None:
            return {"replicas": [], "pools": []}
        replicas = []
        for rid, view in sorted(obs.replicas.items()):
            h = self.health.get(rid)
            window = self._windows.get(rid)
            replicas.append(
                {
                    "replica": rid,
                    "service": view.service,
                    "pool": view.pool,
                    "state": view.state,
                    "up": view.up,
                    "ejected": view.ejected,
                    "score": h.score if h else None,
                    "factors": {
                        "liveness": h.liveness, "errors": h.errors, "slowness": h.slowness, "saturation": h.saturation
                    } if h else None,
                    "errors_in_window": window.failed if window else 0.0,
                    "batches_in_window": window.total if window else 0.0,
                    "latency_s": view.latency_s,
                    "baseline_latency_s": self.anomalies.baseline_latency_s(rid),
                    "inflight": view.inflight,
                    "rss_bytes": view.rss_bytes,
                    "anomalies": sorted(self.anomalies.active(rid)),
                }
            )  # fmt: skip
        pools = [
            {
                "pool": p.name,
                "desired": p.desired,
                "running": p.running,
                "queue_depth": p.queue_depth,
                "p99_s": p.p99_s,
                "requests": p.requests,
            }
            for p in obs.pools.values()
        ]
        return {"replicas": replicas, "pools": pools, "platform": self.platform.name}
