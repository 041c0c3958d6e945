"""A circuit breaker: after failures, skip a dependency for a while, then probe it again.

Both ends of the cache use it: the cache service in front of Redis, and the
gateway in front of the cache service. While it is open, callers treat the
dependency as a miss instead of waiting on it, so a dead or hung Redis costs
the request path nothing; after ``retry_after_s`` one call is let through,
and its success closes the breaker: caching resumes on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed (calls go through), open (calls are skipped), half-open (one probe at a time).

    ``clock`` is injectable so tests can move time without sleeping.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 1,
        retry_after_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failure_threshold = max(1, failure_threshold)
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._consecutive = 0
        self._open_until: float | None = None
        self._probe_started: float | None = None

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a call may go to the dependency now."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        # One probe at a time; a probe that never reported back is replaced after a while.
        if self._probe_started is not None and now - self._probe_started < self.retry_after_s:
            return False
        self._probe_started = now
        return True

    def success(self) -> None:
        self._consecutive = 0
        self._open_until = None
        self._probe_started = None

    def failure(self) -> None:
        self._consecutive += 1
        self._probe_started = None
        if self._open_until is not None or self._consecutive >= self.failure_threshold:
            self._open_until = self._clock() + self.retry_after_s
