"""The cache's logic, free of transport: lookups, stores, invalidation, counters.

Every store call is bounded by ``store_timeout_s`` and guarded by a circuit
breaker. A store that fails or is slow turns lookups into misses and stores
into no-ops ("bypassed", counted), so the serving path never waits on a sick
Redis; when the breaker's probe succeeds, caching resumes on its own.
An invalidation that could not reach the store is remembered and replayed
before the model's entries are used again, so a reload during a Redis outage
cannot resurface results of the replaced model afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from aiworks.cache.store import STORED, TOO_LARGE, Store, StoreError
from aiworks.core.breaker import CircuitBreaker
from aiworks.core.errors import Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
BYPASSED = "bypassed"


@dataclass(frozen=True, slots=True)
class Lookup:
    """The answer to a lookup."""

    value: bytes | None
    epoch: int
    bypassed: bool = False

    @property
    def found(self) -> bool:
        return self.value is not None


@dataclass
class CacheCounters:
    """What the cache did since it started."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0
    invalidations: int = 0
    store_errors: int = 0
    bypassed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CacheStats:
    store: str
    store_available: bool
    entries: int
    bytes: int
    max_bytes: int
    evictions: int
    expired: int
    counters: CacheCounters


class CacheDataPlane:
    """Get, Put, Invalidate and Stats over one :class:`~aiworks.cache.store.Store`."""

    def __init__(
        self,
        store: Store,
        *,
        max_entry_bytes: int = 4 * 1024 * 1024,
        default_ttl_s: float = 3600.0,
        store_timeout_s: float = 0.005,
        retry_after_s: float = 0.5,
        failure_threshold: int = 10,
        admin_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.max_entry_bytes = max_entry_bytes
        self.default_ttl_s = default_ttl_s
        self.store_timeout_s = store_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.counters = CacheCounters()
        self.breaker = CircuitBreaker(failure_threshold=failure_threshold, retry_after_s=retry_after_s, clock=clock)
        self._pending_invalidations: set[str] = set()
        self._last_warning_s = -1e9
        self._clock = clock

    # ---- store calls, bounded and guarded ---------------------------------------------------

    async def _call(self, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Run one store call; a failure or timeout counts against the breaker and raises StoreError.

        A call that times out is not cancelled: it finishes in the background,
        so its Redis connection stays usable instead of being torn down and
        opened again, which under load turns slowness into a spiral.
        """
        task = asyncio.ensure_future(call())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.add_done_callback(_consume)
                raise TimeoutError(f"no answer within {timeout_s * 1e3:g} ms")
            result = task.result()
        except (StoreError, TimeoutError, OSError) as exc:
            self.counters.store_errors += 1
            self.breaker.failure()
            now = self._clock()
            if now - self._last_warning_s > 5:
                self._last_warning_s = now
                log.warning("%s store failing, bypassing it: %s", self.store.name, exc or type(exc).__name__)
            raise StoreError(str(exc) or type(exc).__name__) from None
        if self.breaker.is_open:
            log.info("%s store is back; caching resumes", self.store.name)
        self.breaker.success()
        return result

    async def _replay_invalidations(self) -> None:
        for model in sorted(self._pending_invalidations):
            removed, epoch = await self._call(lambda m=model: self.store.invalidate(m), self.admin_timeout_s)
            self._pending_invalidations.discard(model)
            log.info("replayed the invalidation of %s: %d entries removed, epoch %d", model, removed, epoch)

    async def _usable(self) -> bool:
        """Whether the store may be asked now; replays invalidations it missed first."""
        if not self.breaker.allow():
            return False
        if self._pending_invalidations:
            try:
                await self._replay_invalidations()
            except StoreError:
                return False
        return True

    # ---- the operations ---------------------------------------------------------------------

    async def get(self, model: str, key: bytes) -> Lookup:
        if not await self._usable():
            self.counters.bypassed += 1
            return Lookup(None, 0, bypassed=True)
        try:
            epoch, value = await self._call(lambda: self.store.get(model, key), self.store_timeout_s)
        except StoreError:
            self.counters.bypassed += 1
            return Lookup(None, 0, bypassed=True)
        if value is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1
        return Lookup(value, epoch)

    async def put(self, model: str, key: bytes, value: bytes, epoch: int, ttl_s: float = 0.0) -> tuple[bool, str]:
        """Store a value; returns (stored, why not)."""
        if len(value) > self.max_entry_bytes:
            self.counters.rejected_puts += 1
            return False, TOO_LARGE
        if not await self._usable():
            self.counters.bypassed += 1
            return False, BYPASSED
        ttl = ttl_s if ttl_s > 0 else self.default_ttl_s
        try:
            outcome = await self._call(lambda: self.store.put(model, key, value, epoch, ttl), self.store_timeout_s)
        except StoreError:
            self.counters.bypassed += 1
            return False, BYPASSED
        if outcome != STORED:
            self.counters.rejected_puts += 1
            return False, outcome
        self.counters.puts += 1
        return True, STORED

    async def invalidate(self, model: str) -> tuple[int, int]:
        """Drop ``model``'s entries; returns (removed, new epoch).

        When the store cannot be reached the invalidation is remembered and
        replayed first thing once it can; meanwhile the cache is bypassed.
        Raises Unavailable so the caller knows it is pending.
        """
        self.counters.invalidations += 1
        self._pending_invalidations.add(model)
        try:
            removed, epoch = await self._call(lambda: self.store.invalidate(model), self.admin_timeout_s)
        except StoreError as exc:
            raise Unavailable(f"the invalidation of {model} is pending: the store is unavailable ({exc})") from None
        self._pending_invalidations.discard(model)
        return removed, epoch

    async def stats(self) -> CacheStats:
        try:
            usage = await self._call(self.store.usage, self.admin_timeout_s)
            available = True
        except StoreError:
            usage, available = None, False
        return CacheStats(
            store=self.store.name,
            store_available=available and not self.breaker.is_open,
            entries=usage.entries if usage else 0,
            bytes=usage.bytes if usage else 0,
            max_bytes=usage.max_bytes if usage else 0,
            evictions=usage.evictions if usage else 0,
            expired=usage.expired if usage else 0,
            counters=self.counters,
        )

    async def close(self) -> None:
        await self.store.close()


def _consume(task: asyncio.Future) -> None:
    """Retrieve a late call's outcome so it is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
