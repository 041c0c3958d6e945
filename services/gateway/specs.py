"""Model specs for the gateway's request path, fetched from the scheduler and reused (see :class:`ModelSpecs`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiworks.core.errors import AIWorksError, Status
from aiworks.core.model_config import ModelSpec

Metadata = Callable[[str, str], Awaitable[tuple[ModelSpec, list[str]]]]


class ModelSpecs:
    """Model specs for the request path (input filters, masking), fetched from the scheduler and reused.

    A spec younger than ``ttl_s`` is answered from memory. An older one is
    still answered while one background fetch refreshes it, so a request waits
    for the scheduler only the first time a model version is asked for.
    Unknown models (NOT_FOUND) are remembered for ``ttl_s`` as well, so a
    client sending made-up names costs no metadata call per request; other
    errors are not remembered.
    """

    def __init__(
        self,
        fetch: Metadata,
        ttl_s: float = 1.0,
        *,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._fetch = fetch
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[tuple[str, str], tuple[float, ModelSpec | AIWorksError]] = {}
        self._pending: dict[tuple[str, str], asyncio.Task] = {}

    async def get(self, name: str, version: str) -> ModelSpec:
        ref = (name, version)
        entry = self._entries.get(ref)
        if entry is not None:
            expires, value = entry
            fresh = self._clock() < expires
            if isinstance(value, ModelSpec):
                if not fresh:
                    self._refresh(ref)
                return value
            if fresh:
                raise type(value)(value.message, value.status)
        value = await asyncio.shield(self._refresh(ref))
        if isinstance(value, AIWorksError):
            raise type(value)(value.message, value.status)
        return value

    def _refresh(self, ref: tuple[str, str]) -> asyncio.Task:
        task = self._pending.get(ref)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(ref))
            self._pending[ref] = task
            task.add_done_callback(lambda _: self._pending.pop(ref, None))
        return task

    async def _load(self, ref: tuple[str, str]) -> ModelSpec | AIWorksError:
        try:
            spec, _ = await self._fetch(*ref)
        except AIWorksError as exc:
            if exc.status is Status.NOT_FOUND:
                self._store(ref, exc)
            return exc  # a transient error: a stale spec, if any, is kept
        except Exception as exc:  # never leave a background refresh's exception unretrieved
            return AIWorksError(f"model metadata of '{ref[0]}' could not be read: {exc}")
        self._store(ref, spec)
        return spec

    def _store(self, ref: tuple[str, str], value: ModelSpec | AIWorksError) -> None:
        if ref not in self._entries and len(self._entries) >= self.max_entries:
            self._entries.pop(next(iter(self._entries)))
        self._entries[ref] = (self._clock() + self.ttl_s, value)

    def forget(self, name: str) -> None:
        """Drop what is known about ``name`` (after a load or unload through this gateway)."""
        for ref in [r for r in self._entries if r[0] == name]:
            del self._entries[ref]
