"""The scheduler's registry of runtime replicas: registrations, heartbeats, and the marks of retiring versions.

It is the write side of :class:`~aiworks.scheduler.catalog.Catalog`, whose
queries it shares with the gateways' mirrors. A version that vanishes from a
replica while it is protected (:meth:`ReplicaRegistry.guard`, from the start
of a reload until the key is released) or closing becomes retiring, whether
the runtime's heartbeat or the load's answer tells first, and also when a
heartbeat sent before the reload arrives after it.

Every change bumps :attr:`generation` and wakes :attr:`changed`, which the
routing-table watchers wait on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiworks.core.model_config import ModelSpec
from aiworks.scheduler.catalog import Catalog, Key, Replica

log = logging.getLogger(__name__)

__all__ = ["Key", "Replica", "ReplicaRegistry"]


class ReplicaRegistry(Catalog):
    """Replicas keyed by id, plus the catalog of model versions they serve.

    ``connect(address)`` makes the client the scheduler loads and unloads
    models through. ``clock`` is injectable so tests can drive heartbeat expiry
    without sleeping.
    """

    def __init__(self, connect: Callable[[str], object], *, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._connect = connect
        self._clock = clock
        self.changed = asyncio.Condition()
        self.generation = 0
        self.protected: set[Key] = set()  # keys of models being reloaded, until released

    # ---- membership ----------------------------------------------------------------------

    def register(
        self, replica_id: str, address: str, device: str, labels: dict, specs: list[ModelSpec], gpus: list[dict] = ()
    ) -> Replica:
        old = self.replicas.get(replica_id)
        if old is not None and old.address == address:
            replica = old
        else:
            if old is not None:
                self._close(old)
            replica = Replica(replica_id, address, device, dict(labels), client=self._connect(address))
            self.replicas[replica_id] = replica
            log.info("replica %s registered at %s (%s)", replica_id, address, device)
        replica.device, replica.labels, replica.live, replica.stopping = device, dict(labels), True, False
        replica.gpus = list(gpus)
        replica.last_heartbeat_s = self._clock()
        self.set_models(replica, specs)
        return replica

    def heartbeat(self, replica_id: str, specs: list[ModelSpec], gpus: list[dict] = (), *, inflight_batches: int = 0,
                  queues: list | None = None, kv: list | None = None, kv_refresh_s: float = 2.0,
                  stopping: bool = False) -> bool:  # fmt: skip
        """A replica's heartbeat; ``kv``: its generative versions' :class:`~aiworks.scheduler.views.KvRoom`.

        New KV figures change the routing table when they differ from those last published, or when those are
        ``kv_refresh_s`` old: gateways judge their age, so figures that stay the same are refreshed too. A
        ``stopping`` replica (it got its stop signal and finishes what it holds) is routed nothing more; it is
        removed when its heartbeats end.
        """
        replica = self.replicas.get(replica_id)
        if replica is None:
            return False
        replica.gpus = list(gpus)
        now = self._clock()
        replica.last_heartbeat_s = now
        replica.beats += 1
        if stopping or replica.stopping:  # stopping is for good: only a new registration (a new process) ends it
            if not replica.stopping:
                log.info("replica %s is stopping: no new work goes to it", replica_id)
                replica.live, replica.stopping = False, True
                self._notify()
            return True
        if kv or replica.kv is not None:
            figures = {(k.model, k.version): k for k in kv} if kv else None
            if figures != replica.kv or now - replica.kv_at_s >= kv_refresh_s:
                replica.kv, replica.kv_at_s = figures, now
                self._notify()
        replica.inflight_batches = inflight_batches
        replica.queues = queues or []
        if not replica.live:
            log.info("replica %s is back", replica_id)
            replica.live = True
            self._notify()
        if {(s.name, s.version): s for s in specs} != replica.models:
            self.set_models(replica, specs)
        return True

    def set_models(self, replica: Replica, specs: list[ModelSpec]) -> None:
        old = replica.models
        replica.models = {(s.name, s.version): s for s in specs}
        for key, spec in old.items():
            if key not in replica.models and spec.ready and (key in self.closing or key in self.protected):
                self.retiring.setdefault(key, {})[replica.replica_id] = spec
        for key in replica.models:  # loaded again: it is served as usual
            held = self.retiring.get(key)
            if held is not None and held.pop(replica.replica_id, None) is not None and not held:
                del self.retiring[key]
        for s in specs:
            self.known[(s.name, s.version)] = s
        self._notify()

    # ---- retiring versions ---------------------------------------------------------------

    def guard(self, model: str) -> set[Key]:
        """A reload of ``model`` starts: versions it retires stay routable until released; returns them."""
        keys = {k for r in self.live() for k, s in r.models.items() if k[0] == model and s.ready}
        self.protected |= keys
        return keys

    def close(self, keys) -> None:
        """``keys`` take no new requests from now on (their queued and running requests still run)."""
        self.closing.update(keys)
        self._notify()

    def release(self, keys) -> None:
        """Draining ``keys`` is over: forget the closing and retiring marks."""
        for key in keys:
            self.closing.discard(key)
            self.protected.discard(key)
            self.retiring.pop(key, None)
        self._notify()

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.live:
            log.warning("replica %s marked down: %s", replica.replica_id, why)
        replica.live = False
        self._notify()

    def expire(self, timeout_s: float, listening_since: float | None = None) -> list[str]:
        """Remove replicas silent for longer than ``timeout_s`` while this scheduler was listening.

        ``listening_since`` is when this process last ran again after a stall of its own (the clock's time): a
        heartbeat sent while it was not running may still wait unread, so silence counts from then at the most.
        """
        now = self._clock()
        floor = listening_since if listening_since is not None else float("-inf")
        gone = [r for r in self.replicas.values() if now - max(r.last_heartbeat_s, floor) > timeout_s]
        for replica in gone:
            log.warning(
                "replica %s removed: no heartbeat for %.1f s", replica.replica_id, now - replica.last_heartbeat_s
            )
            del self.replicas[replica.replica_id]
            self._close(replica)
        if gone:
            self._notify()
        return [r.replica_id for r in gone]

    def forget_model(self, name: str) -> None:
        for key in [k for k in self.known if k[0] == name]:
            del self.known[key]
        self._notify()

    def _close(self, replica: Replica) -> None:
        close = getattr(replica.client, "close", None)
        if close is not None:
            asyncio.ensure_future(close())

    def _notify(self) -> None:
        self.generation += 1

        async def notify():
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:  # no loop (unit tests of pure logic)
            pass

    def notify(self) -> None:
        """Something the routing table shows changed outside the registry (weights, an ejection)."""
        self._notify()
