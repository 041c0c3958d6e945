"""Health of one replica as the router sees it: outlier ejection and recent latency.

Outlier ejection follows Istio's ``outlierDetection`` (Envoy's outlier
detection) semantics:

- ``consecutive_errors`` (``consecutive5xxErrors``): that many batch failures
  in a row that are the replica's fault (unreachable, internal error, per-try
  timeout) eject it. Errors the request caused (bad input, its own deadline)
  do not count. Unlike Envoy, which acts at the next ``interval``, the
  ejection happens at once.
- ``base_ejection_s`` (``baseEjectionTime``): an ejection lasts this times the
  number of times the replica has been ejected, capped at ``max_ejection_s``
  (Envoy's ``max_ejection_time``). For each full base period a returned
  replica stays healthy, that count drops by one, as Envoy decrements its
  multiplier.
- ``max_ejection_percent``: at most this share of the replicas is ejected at
  once; one replica may always be ejected, as in Envoy.
- An ejected replica comes back by itself once its time is up.
- :meth:`OutlierDetector.eject` takes a replica out on request (the
  monitor's ``EjectReplica``) for a given time, within the same
  ``max_ejection_percent``; it does not change the multiplier above.

Every method takes the time from the injected clock, so tests drive it with a
fake one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (model, version)


@dataclass(frozen=True)
class OutlierPolicy:
    """Istio-style outlier detection settings; ``consecutive_errors`` 0 turns ejection off."""

    consecutive_errors: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 10.0


@dataclass
class ReplicaHealth:
    """Counters of one replica; changed only through :class:`OutlierDetector` and :meth:`observe`."""

    name: str = ""
    consecutive_errors: int = 0
    times_ejected: int = 0
    ejected_until_s: float | None = None
    returned_s: float | None = None
    ejection_reason: str = ""  # why the current (or last) ejection happened
    # Moving average of request latency per model version, in seconds, and when it was last updated.
    latency_s: dict[Key, float] = field(default_factory=dict)
    latency_at_s: dict[Key, float] = field(default_factory=dict)
    batches: int = 0  # requests answered (batches, when the scheduler still sent batches)
    rows: int = 0

    def observe(self, key: Key, latency_s: float, rows: int, alpha: float, now_s: float = 0.0) -> None:
        """Fold one successful request into the latency average."""
        self.observe_latency(key, latency_s, alpha, now_s)
        self.batches += 1
        self.rows += rows

    def observe_latency(self, key: Key, latency_s: float, alpha: float, now_s: float = 0.0) -> None:
        old = self.latency_s.get(key)
        self.latency_s[key] = latency_s if old is None else old + alpha * (latency_s - old)
        self.latency_at_s[key] = now_s

    def mean_latency_s(self) -> float:
        return sum(self.latency_s.values()) / len(self.latency_s) if self.latency_s else 0.0


class OutlierDetector:
    """Ejects replicas that keep failing and lets them back when their time is up."""

    def __init__(self, policy: OutlierPolicy, clock: Callable[[], float]):
        self.policy = policy
        self._clock = clock
        self.ejections = 0

    def ejected(self, health: ReplicaHealth) -> bool:
        """Whether the replica is out now; one whose time is up comes back here."""
        until = health.ejected_until_s
        if until is None:
            return False
        if self._clock() < until:
            return True
        health.ejected_until_s = None
        health.returned_s = until
        log.info("replica %s is back after its ejection", health.name)
        return False

    def remaining_s(self, health: ReplicaHealth) -> float:
        return max(0.0, health.ejected_until_s - self._clock()) if self.ejected(health) else 0.0

    def success(self, health: ReplicaHealth) -> None:
        health.consecutive_errors = 0

    def failure(self, health: ReplicaHealth, population: Iterable[ReplicaHealth]) -> bool:
        """Count one failure that was the replica's fault; True if this ejects it."""
        p = self.policy
        if p.consecutive_errors <= 0 or self.ejected(health):
            return False
        health.consecutive_errors += 1
        if health.consecutive_errors < p.consecutive_errors:
            return False
        if not self._room_for(health, population):
            return False  # keeps counting; a later failure ejects it once there is room
        now = self._clock()
        if health.returned_s is not None and p.base_ejection_s > 0:
            healthy_periods = int((now - health.returned_s) // p.base_ejection_s)
            health.times_ejected = max(0, health.times_ejected - healthy_periods)
        health.times_ejected += 1
        duration = min(p.base_ejection_s * health.times_ejected, max(p.max_ejection_s, p.base_ejection_s))
        health.ejected_until_s = now + duration
        health.ejection_reason = f"{p.consecutive_errors} consecutive errors"
        health.consecutive_errors = 0
        self.ejections += 1
        log.warning(
            "replica %s ejected for %.1f s after %d consecutive errors (ejection %d)",
            health.name, duration, p.consecutive_errors, health.times_ejected,
        )  # fmt: skip
        return True

    def eject(
        self, health: ReplicaHealth, population: Iterable[ReplicaHealth], duration_s: float, reason: str
    ) -> tuple[bool, float]:
        """Take a replica out for ``duration_s`` (0: ``base_ejection_s``) because someone asked; (ejected, for s).

        Refused (False) when it would put more than ``max_ejection_percent`` of
        the replicas out at once. A replica already out stays out for the
        longer of its current and the new time.
        """
        if not self._room_for(health, population):
            return False, 0.0
        now = self._clock()
        duration = duration_s if duration_s > 0 else self.policy.base_ejection_s
        current = health.ejected_until_s if self.ejected(health) else None
        health.ejected_until_s = max(now + duration, current or 0.0)
        health.ejection_reason = reason
        self.ejections += 1
        return True, health.ejected_until_s - now

    def _room_for(self, health: ReplicaHealth, population: Iterable[ReplicaHealth]) -> bool:
        """Whether ejecting ``health`` keeps within ``max_ejection_percent`` (one may always be out)."""
        everyone = list(population)
        out_now = sum(1 for h in everyone if h is not health and self.ejected(h))
        return out_now < max(1, math.floor(len(everyone) * self.policy.max_ejection_percent / 100))
