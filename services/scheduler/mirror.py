"""A gateway's copy of the scheduler's routing table, kept current by watching it.

:class:`RoutingMirror` is a :class:`~aiworks.scheduler.catalog.Catalog` built
from the :class:`~aiworks.scheduler.views.RoutingTable` messages the
scheduler streams (``WatchRouting``). Replicas keep their identity across
updates: a replica still in the table keeps its connection, its requests in
flight and its health (latency averages, ejection state); one that left is
closed once its last request is answered. The traffic policies, ejection
orders and routing settings of the table are applied to this gateway's
router state by the :class:`~aiworks.scheduler.dispatch.Dispatcher`.

Every model spec a gateway needs (input checks, masking, the result cache's
policy, metadata) comes from here: one spec cache per gateway, refreshed by
the scheduler's pushes rather than by polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiworks.core.errors import Unavailable
from aiworks.core.model_config import ModelSpec
from aiworks.scheduler.catalog import Catalog, Replica, version_order
from aiworks.scheduler.views import RoutingTable

log = logging.getLogger(__name__)

# How long a replica that left is remembered (aiworks.scheduler.sequence_routing asks about the last minutes).
DEPARTED_KEPT_S = 600.0


class RoutingMirror(Catalog):
    """The routing table as this gateway last received it; ``connect(address)`` dials a replica."""

    def __init__(self, connect: Callable[[str], object]):
        super().__init__()
        self._connect = connect
        self.table: RoutingTable | None = None
        self.received = asyncio.Event()
        self.changed = asyncio.Condition()
        self._closing: set[asyncio.Task] = set()
        # Replicas that left the table: when, and the model versions they held (a stateful model's sequences
        # die with their replica; aiworks.scheduler.sequence_routing tells their clients so).
        self.departed: dict[str, tuple[float, frozenset]] = {}
        # Replicas draining after their stop signal: not in ``replicas`` (nothing new is routed to them), their
        # connections kept for the later requests of the sequences they hold (aiworks.scheduler.sequence_routing).
        self.stopping: dict[str, Replica] = {}

    @property
    def ready(self) -> bool:
        """A table has arrived (until then nothing can be routed)."""
        return self.table is not None

    def apply(self, table: RoutingTable) -> None:
        """Make the mirror match ``table``."""
        current, stopping = {}, {}
        now = time.monotonic()
        kv_keys = set()
        for route in table.replicas:
            replica = self.replicas.get(route.replica_id) or self.stopping.get(route.replica_id)
            if replica is None or replica.address != route.address:
                if replica is not None:
                    self._retire(replica)
                replica = Replica(route.replica_id, route.address, client=self._connect(route.address))
                log.info("routing to replica %s at %s", route.replica_id, route.address)
            replica.device, replica.labels, replica.live = route.device, dict(route.labels), not route.stopping
            replica.models = {(s.name, s.version): s for s in route.models}
            if route.stopping:
                if route.replica_id not in self.stopping:
                    log.info("replica %s is stopping: only the sequences it holds go to it now", route.replica_id)
                stopping[route.replica_id] = replica
                continue
            if route.kv:  # generative versions: their KV room, read kv_age_s ago (on this gateway's clock)
                read_s = now - route.kv_age_s
                replica.kv, replica.kv_at_s = {(k.model, k.version): k for k in route.kv}, read_s
                replica.kv_sent = [sent for sent in replica.kv_sent if sent[0] > read_s]  # the rest it counted
                kv_keys.update(replica.kv)
            elif replica.kv is not None:
                replica.kv, replica.kv_sent = None, []
            current[route.replica_id] = replica
        for replica_id, replica in [*self.replicas.items(), *self.stopping.items()]:
            if replica_id not in current and replica_id not in stopping:
                log.info("replica %s left the routing table", replica_id)
                self.departed[replica_id] = (now, frozenset(replica.models))
                self._retire(replica)
        for replica_id, (left_s, _) in list(self.departed.items()):
            if replica_id in current or now - left_s > DEPARTED_KEPT_S:
                del self.departed[replica_id]
        self.replicas, self.stopping = current, stopping
        self.kv_keys = kv_keys
        self.known = {key: None for key in table.known}
        for replica in current.values():
            for key, spec in replica.models.items():
                self.known[key] = spec
        self.closing = {(d.model, d.version) for d in table.draining if d.closing}
        self.retiring = {
            (d.model, d.version): {rid: d.spec for rid in d.retiring_on}
            for d in table.draining
            if d.retiring_on and d.spec is not None
        }
        self.table = table
        self.received.set()
        self._wake()

    def resolve(self, model: str, version: str) -> ModelSpec:
        """As :meth:`Catalog.resolve`; when no live replica has the version but a stopping one holds it and it is
        stateful, its spec: the sequences that replica holds go on until they end (a pool of one replica in a
        rolling update). Starts still find no live holder (aiworks.scheduler.sequence_routing: 503)."""
        try:
            return super().resolve(model, version)
        except Unavailable:
            held = {
                k: s
                for r in self.stopping.values()
                for k, s in r.models.items()
                if k[0] == model and (not version or k[1] == version) and s.ready and s.sequence is not None
                and k not in self.closing
            }  # fmt: skip
            if not held:
                raise
            return held[max(held, key=lambda k: version_order(k[1]))]

    def _retire(self, replica: Replica) -> None:
        """Close a replica's connection once the requests this gateway has in flight there are answered."""
        replica.live = False

        async def close_when_idle():
            for _ in range(600):  # at most a minute; requests still waiting then fail with the connection
                if replica.outstanding <= 0:
                    break
                await asyncio.sleep(0.1)
            close = getattr(replica.client, "close", None)
            if close is not None:
                await close()

        try:
            task = asyncio.get_running_loop().create_task(close_when_idle())
        except RuntimeError:  # no loop: unit tests of pure logic
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _wake(self) -> None:
        async def notify():
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:
            pass

    async def next_change(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the next table; False when none came."""
        generation = self.table.generation if self.table is not None else -1
        return await self.caught_up(generation + 1, timeout_s)

    async def caught_up(self, generation: int, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until a table of at least ``generation`` arrived."""
        def seen() -> bool:
            return self.table is not None and self.table.generation >= generation

        try:
            async with asyncio.timeout(timeout_s):
                async with self.changed:
                    await self.changed.wait_for(seen)
        except TimeoutError:
            return False
        return True

    def departed_holders(self, key, within_s: float) -> list[str]:
        """Replicas that held ``key`` and left the table within the last ``within_s`` seconds, latest first."""
        now = time.monotonic()
        found = [(left_s, rid) for rid, (left_s, keys) in self.departed.items() if key in keys and now - left_s <= within_s]
        return [rid for _, rid in sorted(found, reverse=True)]

    def stopping_holders(self, key) -> list[Replica]:
        """Stopping replicas that hold ``key``: the sequences they hold may still end there."""
        return [r for r in self.stopping.values() if r.holds(key)]

    def spec_known(self, model: str) -> bool:
        return any(k[0] == model for k in self.known)

    async def close(self) -> None:
        for replica in [*self.replicas.values(), *self.stopping.values()]:
            close = getattr(replica.client, "close", None)
            if close is not None:
                await close()
        self.replicas, self.stopping = {}, {}
        for task in list(self._closing):
            task.cancel()
