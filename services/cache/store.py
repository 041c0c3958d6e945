"""Where cache entries live: one interface, two stores.

- :class:`MemoryStore`: an in-process LRU bounded by bytes (the embedded default).
- :class:`aiworks.cache.redis_store.RedisStore`: a Redis server, shared by every
  cache replica (used when a Redis URL is configured).

Entries belong to a model. Each model has an *epoch*, a number that changes
when the model's entries are invalidated; a put carries the epoch its lookup
saw and is refused when it changed since, so a result computed by a model
version that was replaced in the meantime is never stored.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# What one entry costs besides the bytes of its key and value: the OrderedDict node, the
# tuple key, the entry object, the per-model index and two bytes headers (measured with
# tracemalloc on CPython 3.11: about 370 bytes; rounded up; tests/cache/test_store.py checks it).
ENTRY_OVERHEAD_BYTES = 400

STORED = ""
TOO_LARGE = "too_large"
STALE_EPOCH = "stale_epoch"


class StoreError(Exception):
    """The store could not answer (down, refused, or broken)."""


@dataclass(frozen=True)
class StoreUsage:
    """How full a store is, and what it dropped on its own."""

    entries: int
    bytes: int
    max_bytes: int
    evictions: int
    expired: int


class Store(Protocol):
    """The operations the cache's logic needs from a store."""

    name: str

    async def get(self, model: str, key: bytes) -> tuple[int, bytes | None]:
        """The model's epoch, and the value under ``key`` or None."""

    async def put(self, model: str, key: bytes, value: bytes, epoch: int, ttl_s: float) -> str:
        """Store ``value``; returns ``STORED`` or why not (``STALE_EPOCH``, ``TOO_LARGE``)."""

    async def invalidate(self, model: str) -> tuple[int, int]:
        """Drop every entry of ``model``; returns (entries removed, the new epoch)."""

    async def usage(self) -> StoreUsage: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Entry:
    value: bytes
    size: int
    expires_at: float  # 0: never


class MemoryStore:
    """An LRU of entries whose accounted size (key + value + overhead) stays within ``max_bytes``.

    Expired entries are dropped when looked up, or earlier by the LRU.
    ``clock`` is injectable so tests can expire entries without sleeping.
    """

    name = "memory"

    def __init__(self, max_bytes: int, *, clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self._by_model: dict[str, set[bytes]] = {}
        self._epochs: dict[str, int] = {}
        self.bytes = 0
        self.evictions = 0
        self.expired = 0

    async def get(self, model: str, key: bytes) -> tuple[int, bytes | None]:
        epoch = self._epochs.get(model, 0)
        entry = self._entries.get((model, key))
        if entry is None:
            return epoch, None
        if entry.expires_at and self._clock() >= entry.expires_at:
            self._remove(model, key)
            self.expired += 1
            return epoch, None
        self._entries.move_to_end((model, key))
        return epoch, entry.value

    async def put(self, model: str, key: bytes, value: bytes, epoch: int, ttl_s: float) -> str:
        if epoch != self._epochs.get(model, 0):
            return STALE_EPOCH
        size = len(value) + len(key) + len(model) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return TOO_LARGE
        if (model, key) in self._entries:
            self._remove(model, key)
        expires_at = self._clock() + ttl_s if ttl_s > 0 else 0.0
        self._entries[(model, key)] = _Entry(bytes(value), size, expires_at)
        self._by_model.setdefault(model, set()).add(key)
        self.bytes += size
        while self.bytes > self.max_bytes:
            (old_model, old_key), _ = next(iter(self._entries.items()))
            self._remove(old_model, old_key)
            self.evictions += 1
        return STORED

    async def invalidate(self, model: str) -> tuple[int, int]:
        epoch = self._epochs.get(model, 0) + 1
        self._epochs[model] = epoch
        keys = self._by_model.pop(model, set())
        for key in keys:
            entry = self._entries.pop((model, key))
            self.bytes -= entry.size
        return len(keys), epoch

    def _remove(self, model: str, key: bytes) -> None:
        entry = self._entries.pop((model, key))
        self.bytes -= entry.size
        keys = self._by_model[model]
        keys.discard(key)
        if not keys:
            del self._by_model[model]

    async def usage(self) -> StoreUsage:
        return StoreUsage(len(self._entries), self.bytes, self.max_bytes, self.evictions, self.expired)

    async def close(self) -> None:
        self._entries.clear()
        self._by_model.clear()
        self.bytes = 0
