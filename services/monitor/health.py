"""The health score of a replica: one number from 0 (dead) to 100 (healthy).

A single number lets people sort replicas and lets dashboards colour them;
the parts it is made of stay visible in ``/v1/replicas``. It multiplies four
factors, so any one of them can pull the score down but none can push it up
past what the others allow:

    score = 100 x liveness x (1 - 0.6 x errors) x (1 - 0.25 x slowness) x (1 - 0.15 x saturation)

- liveness: 1 live, 0.5 ejected, 0.25 starting or not yet registered, 0 dead
  (process gone, or the scheduler says it is not live).
- errors: share of its batches that failed by its own fault in the recent
  window (0..1).
- slowness: how far its latency is above its own learned baseline, 0 at the
  baseline, 1 at four times it or more: ``clip((latency / baseline - 1) / 3)``.
- saturation: batches in flight over ``saturation_batches`` (0..1).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiworks.monitor.discovery import DEAD, STARTING
from aiworks.monitor.signals import ReplicaView

ERROR_WEIGHT = 0.6
SLOWNESS_WEIGHT = 0.25
SATURATION_WEIGHT = 0.15


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x))


@dataclass(frozen=True)
class Health:
    """A replica's score and the factors it was computed from."""

    score: float
    liveness: float
    errors: float
    slowness: float
    saturation: float


def liveness(view: ReplicaView) -> float:
    if view.state == DEAD or view.up is False:
        return 0.0
    if view.ejected:
        return 0.5
    if view.state == STARTING or view.up is None:
        return 0.25
    return 1.0


def health_score(
    view: ReplicaView,
    *,
    error_ratio: float,
    baseline_latency_s: float | None,
    saturation_batches: float,
) -> Health:
    """Score ``view``; ``error_ratio`` is over the recent window, the baseline is ``None`` until learned."""
    live = liveness(view)
    errors = _clip(error_ratio)
    slowness = 0.0
    if view.latency_s is not None and baseline_latency_s:
        slowness = _clip((view.latency_s / baseline_latency_s - 1.0) / 3.0)
    saturation = _clip((view.inflight or 0.0) / saturation_batches)
    score = (
        100.0
        * live
        * (1 - ERROR_WEIGHT * errors)
        * (1 - SLOWNESS_WEIGHT * slowness)
        * (1 - SATURATION_WEIGHT * saturation)
    )
    return Health(round(score, 1), live, errors, slowness, saturation)
