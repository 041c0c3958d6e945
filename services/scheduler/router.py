"""Chooses the replica for each batch: the least outstanding work among those with room."""

from __future__ import annotations

import itertools

from aiworks.core.errors import Unavailable
from aiworks.scheduler.registry import Key, Replica, ReplicaRegistry


class Router:
    """Least-outstanding-work routing with a per-replica cap on batches in flight.

    The cap on batches in flight per replica and model version (by default the
    model's instance count: what the replica can execute at once) is what lets
    batches grow under load: while every replica is busy, requests wait in the
    queue and leave together in the next batch, instead of queueing one by one
    inside the runtime.
    """

    def __init__(self, registry: ReplicaRegistry, max_inflight_batches: int):
        self.registry = registry
        self.max_inflight = max_inflight_batches  # 0: the model's instance count
        self._tiebreak = itertools.count()

    def _pick(self, key: Key, exclude: set[str]) -> Replica | None:
        holders = [r for r in self.registry.holders(key) if r.replica_id not in exclude]
        if not holders:
            raise Unavailable(f"no live replica serves model '{key[0]}' version {key[1]}")
        free = [r for r in holders if r.outstanding_batches.get(key, 0) < self._cap(r, key)]
        if not free:
            return None
        turn = next(self._tiebreak)
        return min(
            free,
            key=lambda r: (r.outstanding_rows, r.outstanding_batches.get(key, 0), hash((r.replica_id, turn)) & 0xFF),
        )

    def _cap(self, replica: Replica, key: Key) -> int:
        return self.max_inflight or replica.models[key].instance_count

    async def acquire(self, key: Key, rows: int, exclude: set[str] = frozenset()) -> Replica:
        """Wait until a replica holding ``key`` has room, and reserve it."""
        replica = self._pick(key, exclude)
        if replica is None:
            async with self.registry.changed:
                while (replica := self._pick(key, exclude)) is None:
                    await self.registry.changed.wait()
        replica.outstanding_batches[key] = replica.outstanding_batches.get(key, 0) + 1
        replica.outstanding_rows += rows
        return replica

    async def release(self, replica: Replica, key: Key, rows: int) -> None:
        replica.outstanding_batches[key] -= 1
        replica.outstanding_rows -= rows
        async with self.registry.changed:
            self.registry.changed.notify_all()
