"""Keeping an event loop responsive: a lag probe every service runs, and a way to move large work off the loop.

Each service's ``serve()`` starts one :class:`LoopLagProbe`. It asks the loop
to run a callback every ``interval_s`` and records how late the callback ran:
a loop busy with something (a long parse, a regex, a blocking call) runs it
late by that long. The lag goes to ``aiworks_event_loop_lag_seconds`` and its
maximum since start to ``aiworks_event_loop_lag_max_seconds``, both labelled
with the service (docs/observability.md).

A loop also runs late when its thread waits for a CPU that other processes
hold, which says nothing about this service's code. On Linux the probe reads
that wait from the thread's ``schedstat`` and subtracts it:
``aiworks_event_loop_stall_max_seconds`` is the longest lag the service's
own work caused (the fuzz tests hold it under 100 ms on a loaded machine). A
stall longer than ``warn_after_s`` is logged as a WARNING, at most once per
``warn_every_s``.

:func:`offload` runs a function in the default thread pool when its input is
large and inline when it is small, so a small request pays no thread hop. A
thread helps only with work written in Python, which gives up the GIL every
few milliseconds; one long C call (a regex, orjson, a numpy conversion)
holds it throughout, so such work must be bounded by a cap instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from aiworks.core import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopLagProbe:
    """Measures the lag of the running event loop, for ``service``'s metrics."""

    def __init__(
        self,
        service: str,
        *,
        interval_s: float = 0.025,
        warn_after_s: float = 0.25,
        warn_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.service = service
        self.interval_s = interval_s
        self.warn_after_s = warn_after_s
        self.warn_every_s = warn_every_s
        self.max_s = 0.0
        self.stall_max_s = 0.0
        self._clock = clock
        self._lag = metrics.EVENT_LOOP_LAG.labels(service)
        self._max = metrics.EVENT_LOOP_LAG_MAX.labels(service)
        self._stall_max = metrics.EVENT_LOOP_STALL_MAX.labels(service)
        self._max.set(0.0)
        self._stall_max.set(0.0)
        self._schedstat: int | None = None
        self._waited_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._warned_at = -float("inf")

    def start(self) -> LoopLagProbe:
        """Start probing the running loop (call from a coroutine on it)."""
        self._loop = asyncio.get_running_loop()
        try:
            self._schedstat = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:  # not Linux, or no schedstat: stalls are counted as the whole lag
            self._schedstat = None
        self._waited_s = self._runqueue_wait_s()
        self._schedule()
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def _runqueue_wait_s(self) -> float:
        """Seconds this thread has waited for a CPU since it started (0.0 where unknown)."""
        if self._schedstat is None:
            return 0.0
        try:
            return int(os.pread(self._schedstat, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _schedule(self) -> None:
        self._due = self._clock() + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = self._clock()
        waited = self._runqueue_wait_s()
        lag = max(0.0, now - self._due)
        self.record(lag, now, waited_s=waited - self._waited_s)
        self._waited_s = waited
        self._schedule()

    def record(self, lag_s: float, now: float | None = None, *, waited_s: float = 0.0) -> None:
        """Count one measured lag, of which ``waited_s`` the thread spent waiting for a CPU."""
        self._lag.observe(lag_s)
        if lag_s > self.max_s:
            self.max_s = lag_s
            self._max.set(lag_s)
        stall_s = max(0.0, lag_s - waited_s)
        if stall_s > self.stall_max_s:
            self.stall_max_s = stall_s
            self._stall_max.set(stall_s)
        if stall_s >= self.warn_after_s:
            now = self._clock() if now is None else now
            if now - self._warned_at >= self.warn_every_s:
                self._warned_at = now
                log.warning(
                    "%s: the event loop was blocked for %.0f ms; every request waited that long "
                    "(aiworks_event_loop_stall_max_seconds)",
                    self.service,
                    stall_s * 1e3,
                )


def start_loop_lag_probe(service: str, **options) -> LoopLagProbe:
    """A started :class:`LoopLagProbe` on the running loop; ``stop()`` it at shutdown."""
    return LoopLagProbe(service, **options).start()


async def offload(fn: Callable[..., T], *args, large: bool) -> T:
    """``fn(*args)`` in a worker thread when ``large``, else right here on the loop."""
    if not large:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
