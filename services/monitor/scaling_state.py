"""When to scale one runtime pool: sustained overload out, sustained quiet in.

Per pool, a small state machine driven by the control loop's clock:

- overloaded: an overload starts with a reading of queued requests per
  running replica at or above ``scale_out_queue_depth``, or of the gateways'
  p99 for the pool's models at or above ``scale_out_p99_s``; it lasts while
  the average of the readings since it started (over at most the last
  ``scale_out_sustain_s``) stays at or above the threshold. The queue depth
  is a point reading of a sawtooth (a batch empties the queue at once), so
  single low readings are expected under real overload and do not end it.
  Overloaded for ``scale_out_sustain_s``, with ``scale_out_cooldown_s``
  passed since the last scaling, and below ``max_replicas``: one replica more.
- quiet: queued requests per running replica at or below
  ``scale_in_queue_depth`` and the p99 (if there were requests) under half the
  overload threshold, in every reading for ``scale_in_sustain_s``, with
  ``scale_in_cooldown_s`` passed since the last scaling, and above
  ``min_replicas``: one replica fewer.

One replica at a time, and both periods start over after each change, so the
pool settles on the new size before it is judged again (the same damping as
Kubernetes' HPA stabilization windows). A round without a queue reading
(the scheduler could not be read) breaks both periods.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from aiworks.monitor.settings import MonitorSettings
from aiworks.monitor.signals import PoolView

QUEUE_DEPTH = "queue_depth"
P99_LATENCY = "p99_latency"
QUIET = "quiet"


@dataclass(frozen=True)
class ScaleDecision:
    """Scale ``pool`` from ``current`` to ``replicas`` because of ``reason``."""

    pool: str
    current: int
    replicas: int
    reason: str
    message: str
    details: dict


class PoolScalingState:
    """Overload and quiet periods of one pool, and when it was last scaled."""

    def __init__(self, name: str, settings: MonitorSettings):
        self.name = name
        self.s = settings
        self.overloaded_since: float | None = None
        self.quiet_since: float | None = None
        self.last_scaled_s: float | None = None
        self._readings: deque[tuple[float, float, float | None]] = deque()  # (time, queue per replica, p99)

    def _since_last(self, now: float) -> float:
        return float("inf") if self.last_scaled_s is None else now - self.last_scaled_s

    def _reset(self) -> None:
        self.overloaded_since = self.quiet_since = None
        self._readings.clear()

    def _trailing(self, now: float, since: float | None) -> tuple[float, float | None]:
        """Mean queue per replica and mean p99 (of the readings that have one) over the sustain window,
        counted from the start of the overload (earlier, lighter readings must not delay it)."""
        while self._readings and self._readings[0][0] <= now - self.s.scale_out_sustain_s and len(self._readings) > 1:
            self._readings.popleft()
        window = [r for r in self._readings if since is None or r[0] >= since] or [self._readings[-1]]
        queues = [q for _, q, _ in window]
        p99s = [p for _, _, p in window if p is not None]
        return sum(queues) / len(queues), (sum(p99s) / len(p99s) if p99s else None)

    def _overload_reasons(self, queue: float, p99: float | None) -> list[str]:
        s = self.s
        reasons = []
        if queue >= s.scale_out_queue_depth:
            reasons.append(QUEUE_DEPTH)
        if s.scale_out_p99_s > 0 and p99 is not None and p99 >= s.scale_out_p99_s:
            reasons.append(P99_LATENCY)
        return reasons

    def decide(self, now: float, pool: PoolView) -> ScaleDecision | None:
        s = self.s
        if pool.queue_depth is None:
            self._reset()
            return None
        per_replica = pool.queue_depth / max(1, pool.running)
        p99 = pool.p99_s
        self._readings.append((now, per_replica, p99))
        if self.overloaded_since is None and self._overload_reasons(per_replica, p99):
            self.overloaded_since = now
        mean_queue, mean_p99 = self._trailing(now, self.overloaded_since)
        reasons = self._overload_reasons(mean_queue, mean_p99)
        if not reasons:
            self.overloaded_since = None
        quiet = per_replica <= s.scale_in_queue_depth and (
            p99 is None or s.scale_out_p99_s <= 0 or p99 < s.scale_out_p99_s / 2
        )
        self.quiet_since = (self.quiet_since if self.quiet_since is not None else now) if quiet else None
        details = {
            "queue_depth": pool.queue_depth,
            "queue_per_replica": round(per_replica, 2),
            "mean_queue_per_replica": round(mean_queue, 2),
            "p99_s": p99,
            "mean_p99_s": mean_p99,
            "running": pool.running,
            "desired": pool.desired,
        }
        if (
            self.overloaded_since is not None
            and reasons
            and now - self.overloaded_since >= s.scale_out_sustain_s
            and self._since_last(now) >= s.scale_out_cooldown_s
            and pool.desired < s.max_replicas
        ):
            p99_text = f"{mean_p99 * 1000:.0f} ms" if mean_p99 is not None else "n/a"
            return self._act(
                now, pool, pool.desired + 1, reasons[0],
                f"overloaded for {now - self.overloaded_since:.0f} s: {mean_queue:.1f} queued per replica on average "
                f"(threshold {s.scale_out_queue_depth:g}), p99 {p99_text} (threshold {s.scale_out_p99_s * 1000:.0f} ms)",
                details,
            )  # fmt: skip
        if (
            self.quiet_since is not None
            and now - self.quiet_since >= s.scale_in_sustain_s
            and self._since_last(now) >= s.scale_in_cooldown_s
            and pool.desired > s.min_replicas
        ):
            p99_text = f"{p99 * 1000:.0f} ms" if p99 is not None else "no requests"
            return self._act(
                now, pool, pool.desired - 1, QUIET,
                f"quiet for {now - self.quiet_since:.0f} s: {per_replica:.1f} queued per replica, p99 {p99_text}",
                details,
            )  # fmt: skip
        return None

    def _act(self, now: float, pool: PoolView, replicas: int, reason: str, message: str, details) -> ScaleDecision:
        self.last_scaled_s = now
        self._reset()
        return ScaleDecision(self.name, pool.desired, replicas, reason, message, details)
