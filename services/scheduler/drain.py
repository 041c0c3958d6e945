"""Waiting for retired model versions to drain before runtimes free them.

A version leaves service in three steps (docs/scheduler.md, "Hot update"):

1. it stops taking new requests: resolution no longer picks it (the
   registry's closing and retiring marks), so requests that name no version
   go to the version resolution picks now;
2. its queued requests and running batches finish (this module), on the
   replicas that still hold it, for at most the drain timeout;
3. only then do the runtimes drop it (an unload, or, after a reload, once the
   runtime sees no more batches of it), and the runtime's own unload still
   waits for executions in progress.

:class:`Drainer` only watches: ``busy(key)`` says whether a key still has
queued requests or batches in flight, and the clock is injectable. Drains are
rare, so it polls rather than adding a notification to every batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from aiworks.scheduler.registry import Key

log = logging.getLogger(__name__)


class Drainer:
    """Waits until keys have nothing queued and nothing running, or a timeout."""

    def __init__(
        self,
        busy: Callable[[Key], bool],
        *,
        timeout_s: float,
        poll_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._busy = busy
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self.in_progress: set[Key] = set()
        self.drained = 0
        self.timed_out = 0

    async def wait(self, keys: Iterable[Key], timeout_s: float | None = None) -> list[Key]:
        """Wait for ``keys`` to drain; returns those still busy when the timeout passed."""
        keys = set(keys)
        self.in_progress |= keys
        started = self._clock()
        deadline = started + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            while True:
                busy = sorted(k for k in keys if self._busy(k))
                if not busy:
                    break
                if self._clock() >= deadline:
                    self.timed_out += len(busy)
                    log.warning(
                        "drain of %s timed out after %.1f s with work left",
                        ", ".join(f"{m}/{v}" for m, v in busy),
                        self._clock() - started,
                    )
                    return busy
                await asyncio.sleep(self.poll_s)
            self.drained += len(keys)
            if keys:
                log.info(
                    "drained %s in %.0f ms",
                    ", ".join(f"{m}/{v}" for m, v in sorted(keys)),
                    (self._clock() - started) * 1e3,
                )
            return []
        finally:
            self.in_progress -= keys
