"""Anomalies against a learned baseline: latency spikes, error surges, steady memory growth.

Fixed thresholds do not fit every model: 20 ms is fast for one and slow for
another. So each replica's own normal is learned as it runs (an exponentially
weighted mean and variance), and an anomaly is a departure from it:

- latency spike: a round's mean batch latency at least ``latency_spike_ratio``
  times the replica's baseline (and above ``latency_floor_s``), once the
  baseline has ``baseline_min_samples`` samples;
- error surge: the share of failed batches over the recent window at least
  ``error_surge_ratio`` above the replica's usual share (which starts at 0),
  with at least ``error_min_requests`` batches in the window;
- memory growth: resident memory rising steadily over ``memory_window_s``: the
  least-squares slope over the window adds up to ``memory_growth_ratio`` of the
  starting size, and at least 80% of the steps go up (a leak, not a sawtooth).

An anomaly is reported once when it starts and again only after it has
cleared. While a signal is anomalous its baseline learns ten times slower, so
a spike does not become the new normal at once, yet a lasting change is
accepted in the end.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiworks.monitor.settings import MonitorSettings
from aiworks.monitor.signals import ReplicaView

LATENCY_SPIKE = "latency_spike"
ERROR_SURGE = "error_surge"
MEMORY_GROWTH = "memory_growth"

STEADY_SHARE = 0.8  # share of memory steps that must go up for growth to count as steady
MIN_MEMORY_SAMPLES = 10


class Baseline:
    """Exponentially weighted mean and variance of one signal."""

    def __init__(self, alpha: float, min_samples: int, prior: float | None = None):
        self.alpha = alpha
        self.min_samples = min_samples
        self.mean: float | None = prior
        self.var = 0.0
        self.n = min_samples if prior is not None else 0

    @property
    def ready(self) -> bool:
        return self.n >= self.min_samples and self.mean is not None

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: float, slow: bool = False) -> None:
        self.n += 1
        if self.mean is None:
            self.mean = x
            return
        alpha = self.alpha / 10 if slow else self.alpha
        diff = x - self.mean
        step = alpha * diff
        self.mean += step
        self.var = (1 - alpha) * (self.var + diff * step)


class ErrorWindow:
    """Succeeded and failed batches of one replica over a sliding time window."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._rounds: deque[tuple[float, float, float]] = deque()

    def add(self, now: float, ok: float, failed: float) -> None:
        self._rounds.append((now, ok, failed))
        while self._rounds and self._rounds[0][0] <= now - self.window_s:
            self._rounds.popleft()

    @property
    def ok(self) -> float:
        return sum(r[1] for r in self._rounds)

    @property
    def failed(self) -> float:
        return sum(r[2] for r in self._rounds)

    @property
    def total(self) -> float:
        return self.ok + self.failed

    @property
    def ratio(self) -> float:
        total = self.total
        return self.failed / total if total else 0.0

    def clear(self) -> None:
        self._rounds.clear()


@dataclass(frozen=True)
class Anomaly:
    """A departure from a replica's normal that has just started."""

    kind: str
    replica: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class _ReplicaBaselines:
    latency: Baseline
    errors: Baseline
    memory: deque = field(default_factory=deque)  # (time_s, rss_bytes)
    active: set[str] = field(default_factory=set)


def memory_trend(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(slope in bytes/s, fitted value at the first point, share of steps that go up) of a series."""
    n = len(points)
    t0 = points[0][0]
    ts = [t - t0 for t, _ in points]
    ys = [y for _, y in points]
    mt, my = sum(ts) / n, sum(ys) / n
    var_t = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var_t if var_t else 0.0
    steps = [b - a for a, b in zip(ys, ys[1:])]
    up = sum(1 for d in steps if d >= 0) / len(steps) if steps else 0.0
    return slope, my - slope * mt, up


class AnomalyDetector:
    """Learns each replica's baselines and reports the anomalies that start."""

    def __init__(self, settings: MonitorSettings):
        self.s = settings
        self._replicas: dict[str, _ReplicaBaselines] = {}

    def _state(self, replica: str) -> _ReplicaBaselines:
        state = self._replicas.get(replica)
        if state is None:
            s = self.s
            state = self._replicas[replica] = _ReplicaBaselines(
                Baseline(s.baseline_alpha, s.baseline_min_samples),
                Baseline(s.baseline_alpha, s.baseline_min_samples, prior=0.0),
            )
        return state

    def baseline_latency_s(self, replica: str) -> float | None:
        state = self._replicas.get(replica)
        return state.latency.mean if state is not None and state.latency.ready else None

    def active(self, replica: str) -> set[str]:
        """Kinds of anomaly the replica shows now."""
        state = self._replicas.get(replica)
        return set(state.active) if state is not None else set()

    def forget(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def observe(self, view: ReplicaView, window: ErrorWindow, now: float) -> list[Anomaly]:
        """Judge one round of ``view`` (errors over ``window``); returns the anomalies that start now."""
        state = self._state(view.replica_id)
        found = []
        for kind, anomalous, message, details in (
            self._latency(state, view),
            self._errors(state, window),
            self._memory(state, view, now),
        ):
            if anomalous is None:
                continue  # not measured this round: the state stays as it was
            if anomalous and kind not in state.active:
                state.active.add(kind)
                found.append(Anomaly(kind, view.replica_id, message, details))
            elif not anomalous:
                state.active.discard(kind)
        return found

    def _latency(self, state: _ReplicaBaselines, view: ReplicaView):
        x = view.latency_s
        if x is None:
            return LATENCY_SPIKE, None, "", {}
        base = state.latency
        ratio = x / base.mean if base.ready and base.mean else 0.0
        spike = base.ready and x >= self.s.latency_floor_s and ratio >= self.s.latency_spike_ratio
        message = (
            f"batch latency {x * 1000:.1f} ms is {ratio:.1f}x its baseline of {base.mean * 1000:.1f} ms"
            if spike
            else ""
        )
        details = {"latency_s": x, "baseline_s": base.mean, "ratio": round(ratio, 2)} if spike else {}
        base.update(x, slow=spike)
        return LATENCY_SPIKE, spike, message, details

    def _errors(self, state: _ReplicaBaselines, window: ErrorWindow):
        if window.total < self.s.error_min_requests:
            return ERROR_SURGE, None, "", {}
        base = state.errors
        ratio = window.ratio
        surge = ratio >= base.mean + self.s.error_surge_ratio
        message = (
            f"{window.failed:.0f} of {window.total:.0f} batches failed in {window.window_s:.0f} s "
            f"({ratio:.0%}, usually {base.mean:.0%})"
        )
        details = {"failed": window.failed, "total": window.total, "ratio": round(ratio, 3), "baseline": base.mean}
        base.update(ratio, slow=surge)
        return ERROR_SURGE, surge, message, details

    def _memory(self, state: _ReplicaBaselines, view: ReplicaView, now: float):
        if view.rss_bytes is None:
            return MEMORY_GROWTH, None, "", {}
        series = state.memory
        series.append((now, view.rss_bytes))
        while series and series[0][0] < now - self.s.memory_window_s:
            series.popleft()
        span = series[-1][0] - series[0][0]
        if len(series) < MIN_MEMORY_SAMPLES or span < self.s.memory_window_s / 2:
            return MEMORY_GROWTH, None, "", {}
        slope, start, up = memory_trend(list(series))
        growth = slope * span
        growing = start > 0 and growth >= self.s.memory_growth_ratio * start and up >= STEADY_SHARE
        message = (
            f"resident memory grew steadily by {growth / 2**20:.0f} MiB ({growth / start:.0%}) in {span:.0f} s, "
            f"{slope / 2**10:.1f} KiB/s"
            if growing
            else ""
        )
        details = {"growth_bytes": growth, "start_bytes": start, "slope_bytes_per_s": slope, "window_s": span}
        return MEMORY_GROWTH, growing, message, details if growing else {}
