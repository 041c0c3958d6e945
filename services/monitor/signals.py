"""From raw samples to what the control loop judges: per-replica and per-pool signals.

Counters only mean something as changes, so the :class:`Observer` remembers
the previous round's values and reports what happened since (a counter that
went down belongs to a restarted process, and its value is all new).
Histograms become a p99 over the round from their bucket changes, the way
Prometheus' ``histogram_quantile(0.99, rate(...))`` computes it. Where a signal
could not be read, it is ``None``, never a guess: the rules act only on what
was measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from aiworks.monitor import collect as c
from aiworks.monitor.collect import Sample
from aiworks.monitor.discovery import DEAD, RUNNING, Inventory, Pool

# Execution statuses that are the replica's fault (the request's own faults,
# such as invalid_argument, say nothing about the replica).
FAULT_STATUSES = frozenset({"internal", "unavailable", "deadline_exceeded"})


@dataclass
class ReplicaView:
    """One runtime replica during one round."""

    replica_id: str
    service: str | None = None  # its service in the inventory; None when only the scheduler knows it
    pool: str | None = None
    state: str = RUNNING
    up: bool | None = None  # the scheduler's view: live; None while it does not list the replica
    ejected: bool = False
    ok: float = 0.0  # batches that succeeded this round
    failed: float = 0.0  # batches that failed by the replica's fault this round
    latency_s: float | None = None  # mean compute time of a batch this round
    inflight: float | None = None  # batches in flight now
    rss_bytes: float | None = None


@dataclass
class PoolView:
    """One runtime pool during one round."""

    name: str
    desired: int
    running: int
    queue_depth: float | None  # queued requests for the pool's models; None: the scheduler was not read
    p99_s: float | None  # gateway p99 latency of the pool's models this round; None: no requests
    requests: float = 0.0  # requests the gateways answered for the pool's models this round


@dataclass
class Observation:
    """Everything the control loop sees in one round."""

    time_s: float
    inventory: Inventory
    replicas: dict[str, ReplicaView]
    pools: dict[str, PoolView]


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative count) pairs.

    Linear interpolation inside the bucket that holds the rank, as Prometheus
    does; a rank in the ``+Inf`` bucket gives the largest finite bound.
    """
    points, running = [], 0.0
    for le, count in sorted(buckets):
        # Deltas of separately reset series can dip a little; cumulative counts only grow with le.
        running = max(running, count)
        points.append((le, running))
    if not points or points[-1][1] <= 0:
        return None
    rank = q * points[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in points:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _key(target: str, s: Sample) -> tuple:
    return (target, s.name, tuple(sorted(s.labels.items())))


class Observer:
    """Turns each round's samples into :class:`Observation` s, remembering counters between rounds."""

    def __init__(self) -> None:
        self._previous: dict[tuple, float] = {}
        self._current: dict[tuple, float] = {}
        self._seen_targets: set[str] = set()

    def _delta(self, target: str, s: Sample) -> float:
        key = _key(target, s)
        self._current[key] = s.value
        before = self._previous.get(key)
        if before is None:
            # A series new on a target read last round was created since: all of it is this round's.
            # On a target read for the first time, what it counted before is not.
            return s.value if target in self._seen_targets else 0.0
        return s.value - before if s.value >= before else s.value

    def observe(self, now: float, inventory: Inventory, samples: dict[str, list[Sample]]) -> Observation:
        self._current = {}
        by_target = inventory.by_target()
        schedulers = [t for t, svc in by_target.items() if svc.kind == "scheduler" and t in samples]
        gateways = [t for t, svc in by_target.items() if svc.kind == "gateway" and t in samples]

        replicas: dict[str, ReplicaView] = {}
        for svc in inventory.runtimes():
            rid = svc.replica_id or svc.name
            view = replicas[rid] = ReplicaView(rid, svc.name, svc.pool, svc.state)
            if svc.metrics_address and svc.metrics_address in samples:
                self._runtime_signals(view, svc.metrics_address, samples[svc.metrics_address])
        for target in schedulers:
            self._scheduler_signals(replicas, samples[target])

        pools = {p.name: self._pool_view(p, inventory, schedulers, gateways, samples) for p in inventory.pools}
        for target, target_samples in samples.items():  # remember every series, read this round or not
            for s in target_samples:
                self._current.setdefault(_key(target, s), s.value)
        self._previous = self._current
        self._seen_targets = set(samples)
        return Observation(now, inventory, replicas, pools)

    def _runtime_signals(self, view: ReplicaView, target: str, samples: list[Sample]) -> None:
        compute_sum = compute_count = 0.0
        for s in samples:
            if s.name == c.RUNTIME_EXECUTIONS:
                delta = self._delta(target, s)
                status = s.labels.get("status", "ok")
                if status == "ok":
                    view.ok += delta
                elif status in FAULT_STATUSES:
                    view.failed += delta
            elif s.name == c.RUNTIME_COMPUTE_SUM:
                compute_sum += self._delta(target, s)
            elif s.name == c.RUNTIME_COMPUTE_COUNT:
                compute_count += self._delta(target, s)
            elif s.name == c.PROCESS_RSS:
                view.rss_bytes = s.value
            elif s.name == c.RUNTIME_INFLIGHT:
                view.inflight = (view.inflight or 0.0) + s.value
        if compute_count > 0:
            view.latency_s = compute_sum / compute_count

    @staticmethod
    def _scheduler_signals(replicas: dict[str, ReplicaView], samples: list[Sample]) -> None:
        for s in samples:
            rid = s.labels.get("replica")
            if rid is None:
                continue
            view = replicas.get(rid)
            if view is None:  # a replica the scheduler knows and discovery does not (started by hand)
                view = replicas[rid] = ReplicaView(rid)
            if s.name == c.REPLICA_UP:
                view.up = s.value > 0
                if view.service is None:
                    view.state = RUNNING if view.up else DEAD
            elif s.name == c.REPLICA_EJECTED:
                view.ejected = s.value > 0
            elif s.name == c.REPLICA_INFLIGHT and view.inflight is None:
                view.inflight = s.value
            elif s.name == c.REPLICA_LATENCY and view.service is None and s.value > 0:
                view.latency_s = s.value

    def _pool_view(
        self, pool: Pool, inventory: Inventory, schedulers: list[str], gateways: list[str], samples
    ) -> PoolView:
        def serves(labels: dict[str, str]) -> bool:
            return not pool.models or labels.get("model") in pool.models

        # The queues are in the runtime replicas: the pool's depth is what the replicas that were read report
        # for the pool's models (any pool's replicas, as the scheduler's one queue per model used to count).
        targets = {r.metrics_address for r in inventory.runtimes() if r.metrics_address}
        replicas = [t for t in samples if t in targets]
        depth = None
        if replicas:
            depth = sum(s.value for t in replicas for s in samples[t] if s.name == c.QUEUE_DEPTH and serves(s.labels))
        buckets: dict[float, float] = {}
        for t in gateways:
            for s in samples[t]:
                if s.name == c.GATEWAY_DURATION_BUCKET and serves(s.labels):
                    le = float(s.labels.get("le", "+Inf"))
                    buckets[le] = buckets.get(le, 0.0) + self._delta(t, s)
        requests = buckets.get(math.inf, 0.0)
        running = sum(1 for r in inventory.runtimes(pool.name) if r.state == RUNNING)
        return PoolView(pool.name, pool.desired, running, depth, histogram_quantile(0.99, buckets.items()), requests)
