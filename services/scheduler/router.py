"""Chooses the replica for each batch.

1. **Candidates**: live replicas that hold the model version (or still
   retire it while its queue drains), minus those already tried for this
   batch.
2. **Ejection**: replicas ejected as outliers are left out, unless every
   candidate is ejected; then all serve (Envoy's panic routing: better a
   suspect replica than none).
3. **Pools**: if the batch's class has a preferred pool (by default realtime
   → ``device=gpu``, batch → ``device=cpu``) and a candidate matches it, only
   matching candidates serve.
4. **Room**: a replica has room while its batches in flight for the version
   stay under the cap (the model's instance count by default). That cap lets
   batches grow under load: while all are busy, requests wait in the queue
   and leave together.
5. **Power of two choices**: among two random candidates with room, the one
   with the lower expected cost, its latency average for the version ×
   (1 + its batches in flight). A replica not yet measured costs 0, so it gets
   tried. A replica k times slower holds each batch k times longer and loses
   every comparison while the other has room, so it gets about 1/k as many
   batches.
"""

from __future__ import annotations

import random

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, Unavailable
from aiworks.scheduler.qos import Priority
from aiworks.scheduler.registry import Key, Replica, ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector

Selector = tuple[tuple[str, str], ...]


class PoolPolicy:
    """Preferred replicas per class, as ``key=value`` terms on device and labels."""

    def __init__(self, selectors: dict[Priority, Selector] | None = None):
        self.selectors = selectors or {}

    @classmethod
    def parse(cls, by_class: dict[str, str]) -> PoolPolicy:
        """From settings such as ``{"realtime": "device=gpu", "batch": "device=cpu,pool=spot"}``."""
        selectors = {}
        for name, text in by_class.items():
            terms = []
            for term in filter(None, (t.strip() for t in text.split(","))):
                key, sep, value = term.partition("=")
                if not sep:
                    raise ValueError(f"pool term '{term}' for {name} is not key=value")
                terms.append((key.strip(), value.strip()))
            selectors[Priority.named(name)] = tuple(terms)
        return cls(selectors)

    @staticmethod
    def matches(replica: Replica, selector: Selector) -> bool:
        return all((replica.device if k == "device" else replica.labels.get(k)) == v for k, v in selector)

    def prefer(self, priority: Priority, replicas: list[Replica]) -> list[Replica]:
        selector = self.selectors.get(priority)
        if not selector:
            return replicas
        return [r for r in replicas if self.matches(r, selector)] or replicas


class Router:
    """Latency-aware routing with outlier ejection, class pools and a cap on batches in flight."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        max_inflight_batches: int,
        *,
        outliers: OutlierDetector,
        pools: PoolPolicy | None = None,
        ewma_alpha: float = 0.3,
        rng: random.Random | None = None,
    ):
        self.registry = registry
        self.max_inflight = max_inflight_batches  # 0: the model's instance count
        self.outliers = outliers
        self.pools = pools or PoolPolicy()
        self.ewma_alpha = ewma_alpha
        self._rng = rng or random.Random()

    # ---- choice --------------------------------------------------------------------------

    def candidates(
        self, key: Key, priority: Priority, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[Replica]:
        holders = [r for r in self.registry.holders(key) if r.replica_id not in exclude]
        if not holders:
            if self.registry.recovering(key, exclude):
                return []  # a replica's backend is coming back: wait for it (acquire waits on changes)
            raise Unavailable(f"no live replica serves model '{key[0]}' version {key[1]}")
        healthy = [r for r in holders if not self.outliers.ejected(r.health)] or holders
        return self.pools.prefer(priority, healthy)

    def _cap(self, replica: Replica, key: Key) -> int:
        if self.max_inflight:
            return self.max_inflight
        spec = self.registry.spec_on(replica, key)  # a retiring version is no longer in replica.models
        return spec.instance_count if spec is not None else 1

    def _cost(self, replica: Replica, key: Key) -> float:
        inflight = sum(replica.outstanding_batches.values())
        return replica.health.latency_s.get(key, 0.0) * (1 + inflight)

    def _pick(self, key: Key, priority: Priority, exclude) -> Replica | None:
        free = [
            r for r in self.candidates(key, priority, exclude) if r.outstanding_batches.get(key, 0) < self._cap(r, key)
        ]
        if not free:
            return None
        if len(free) > 2:
            free = self._rng.sample(free, 2)
        elif len(free) == 2 and self._rng.random() < 0.5:
            free.reverse()  # ties go either way
        return min(free, key=lambda r: (self._cost(r, key), r.outstanding_rows))

    async def acquire(
        self, key: Key, priority: Priority = Priority.STANDARD, exclude: frozenset[str] | set[str] = frozenset()
    ) -> Replica:
        """Wait until a suitable replica holding ``key`` has room, and reserve one batch slot on it."""
        replica = self._pick(key, priority, exclude)
        if replica is None:
            async with self.registry.changed:
                while (replica := self._pick(key, priority, exclude)) is None:
                    await self.registry.changed.wait()
        replica.outstanding_batches[key] = replica.outstanding_batches.get(key, 0) + 1
        return replica

    def add_rows(self, replica: Replica, rows: int) -> None:
        replica.outstanding_rows += rows

    async def release(self, replica: Replica, key: Key, rows: int) -> None:
        replica.outstanding_batches[key] -= 1
        replica.outstanding_rows -= rows
        async with self.registry.changed:
            self.registry.changed.notify_all()

    # ---- outcomes ------------------------------------------------------------------------

    def succeeded(self, replica: Replica, key: Key, latency_s: float, rows: int) -> None:
        replica.health.observe(key, latency_s, rows, self.ewma_alpha)
        self.outliers.success(replica.health)

    def failed(
        self, replica: Replica, exc: AIWorksError, key: Key | None = None, waited_s: float | None = None
    ) -> None:
        """A failure that was the replica's fault: count it towards ejection; mark it down if unreachable.

        A timeout (``waited_s`` given) also counts as a latency sample, so a
        replica that hangs looks slow once it is back, not unmeasured.
        """
        if key is not None and waited_s is not None:
            replica.health.observe_latency(key, waited_s, self.ewma_alpha)
        population = [r.health for r in self.registry.replicas.values()]
        if self.outliers.failure(replica.health, population):
            metrics.SCHEDULER_EJECTIONS.labels(replica.replica_id, "outlier").inc()
        if exc.status is Unavailable.status:
            self.registry.mark_down(replica, exc.message)
