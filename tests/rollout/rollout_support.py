"""Fakes for the rollout controller's unit tests: clock, traffic target, metrics and event sinks.

:class:`SimulatedTraffic` produces window numbers the way real traffic would:
requests arrive at a steady rate and split by the weights the recording
target holds right now, each version failing and taking as long as the test
says. So a test states behaviour ("version 2 fails 20% of requests") and the
controller's own weight changes decide what it then observes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiworks.core.errors import InvalidArgument, Unavailable
from aiworks.monitor.rollout import RolloutController, RolloutPolicy
from aiworks.monitor.rollout_judge import VersionStats


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingTarget:
    """A TrafficTarget that records every split and can be told to fail."""

    name = "recording"

    def __init__(self, serving: str = "1", ready: Sequence[str] = ("1", "2", "3")):
        self.calls: list[tuple[str, str, str, int]] = []
        self.current: dict[str, dict[str, int]] = {}
        self.serving = serving
        self.ready = list(ready)
        self.failing: Exception | None = None
        self.closed = False

    async def set_split(self, model: str, stable: str, canary: str, canary_weight: int) -> None:
        if self.failing is not None:
            raise self.failing
        if stable == canary:
            raise InvalidArgument("stable and canary are the same version")
        self.calls.append((model, stable, canary, canary_weight))
        self.current[model] = {stable: 100 - canary_weight, canary: canary_weight}

    def canary_weights(self, model: str = "m") -> list[int]:
        return [w for m, _, _, w in self.calls if m == model]

    async def weights(self, model: str) -> dict[str, int]:
        return dict(self.current.get(model, {}))

    async def serving_version(self, model: str) -> str:
        return self.serving

    async def ready_versions(self, model: str) -> list[str]:
        return list(self.ready)

    async def close(self) -> None:
        self.closed = True


@dataclass
class Behaviour:
    error_rate: float = 0.0
    p99_s: float = 0.010


@dataclass
class SimulatedTraffic:
    """A MetricSource: ``rate_rps`` requests a second, split by the target's weights in force."""

    clock: FakeClock
    target: RecordingTarget
    rate_rps: float = 100.0
    versions: dict[str, Behaviour] = field(default_factory=dict)
    failing: Exception | None = None
    reads: int = 0

    async def begin(self, model: str) -> float:
        return self.clock()

    async def read(self, model: str, versions: Sequence[str], token: float) -> dict[str, VersionStats]:
        self.reads += 1
        if self.failing is not None:
            raise self.failing
        elapsed = self.clock() - token
        weights = self.target.current.get(model, {})
        out = {}
        for v in versions:
            n = int(self.rate_rps * elapsed * weights.get(v, 0) / 100)
            b = self.versions.get(v, Behaviour())
            out[v] = VersionStats(n, round(n * b.error_rate), b.p99_s if n else None)
        return out

    async def close(self) -> None:
        pass


class Events:
    """Collects emit() and audit() calls."""

    def __init__(self):
        self.events: list[tuple[str, str, str, str, dict[str, Any]]] = []
        self.audits: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, target: str, reason: str, message: str, details: dict[str, Any]) -> None:
        self.events.append((kind, target, reason, message, details))

    def audit(self, action: str, details: dict[str, Any]) -> None:
        self.audits.append((action, details))

    @property
    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


@dataclass
class Rig:
    clock: FakeClock
    target: RecordingTarget
    traffic: SimulatedTraffic
    events: Events
    controller: RolloutController

    async def run_for(self, seconds: float, step_s: float = 1.0) -> None:
        """Advance the clock in ``step_s`` steps, ticking after each."""
        t = 0.0
        while t < seconds:
            self.clock.advance(step_s)
            t += step_s
            await self.controller.tick()


def make_rig(emit: Callable[..., None] | None = None, **policy: Any) -> Rig:
    """A controller with a 60 s dwell (unless ``policy`` says otherwise) on fakes; ``emit`` replaces the recorder."""
    clock = FakeClock()
    target = RecordingTarget()
    traffic = SimulatedTraffic(clock, target)
    events = Events()
    defaults = RolloutPolicy(**{"dwell_s": 60.0, **policy})
    controller = RolloutController(
        target, traffic, emit or events.emit, events.audit, defaults=defaults, clock=clock,
        wall_clock=lambda: 1.7e9 + clock(),
    )  # fmt: skip
    return Rig(clock, target, traffic, events, controller)


def unavailable(message: str = "scheduler unreachable") -> Unavailable:
    return Unavailable(message)
