"""Progressive canary rollouts with automatic rollback: the controller.

A rollout moves a model's unversioned traffic from its stable version to a
canary version in steps (5 -> 20 -> 50 -> 100 % by default). Each step dwells;
at the end of the dwell the canary's error rate and p99 latency over that
window are compared with stable's (:mod:`aiworks.monitor.rollout_judge`). Within
the SLO the next step follows; a breach sends all traffic back to stable at
once, with the numbers that broke it. When the 100 % step passes too, the
rollout is complete and the canary is the new stable; ``rollback`` still
returns the model to the version it replaced.

Why the shape:

- One class, no transport. The HTTP routes (``rollout_routes``) translate and
  delegate; weights go through the :class:`~aiworks.monitor.rollout_targets.TrafficTarget`
  port and numbers come from a :class:`~aiworks.monitor.rollout_judge.MetricSource`,
  so the unit tests drive this class with a fake clock, fake numbers and a
  recording target, and the end-to-end test with the real scheduler and gateway.
- Time comes from ``clock`` (monotonic, for dwell times) and ``wall_clock``
  (for the times shown); ``tick()`` does one round and ``run()`` calls it.
- The canary must have served ``min_requests`` in the window before it is
  judged at all; until then the dwell is extended, at most ``max_extensions``
  times. A canary still short of data after that is **rolled back**
  (reason ``insufficient_data``): a version nobody could measure is not
  promoted, and a half-promoted canary left waiting for traffic is a risk
  nobody watches. Start it again when there is traffic, or with a longer dwell.
- The final (100 %) step dwells and is judged too, to catch what shows only
  under all the traffic. Stable serves nothing then, so the canary's error
  rate is compared with stable's from the last window that had enough stable
  traffic; its p99 is not compared, because latency depends on the load of
  the moment and is only compared between versions serving side by side.
- Weights that could not be applied (scheduler or API server unreachable)
  stay wanted: the rollout shows ``applied: false`` with the error, and each
  tick tries again before anything else; a window starts only once its
  weights are in force.
- One rollout per model at a time; state lives in memory (a restarted monitor
  forgets rollouts, while the weights last written stay in force).

Every transition is an event through ``emit(kind, target, reason, message,
details)``, and every change of weights goes to ``audit(action, details)``
(details are short scalars only, as audit logs require).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Status
from aiworks.monitor.rollout_judge import SLO, Judgement, MetricSource, VersionStats, judge
from aiworks.monitor.rollout_targets import TrafficTarget, split_weights

log = logging.getLogger(__name__)

Emit = Callable[[str, str, str, str, dict[str, Any]], None]
Audit = Callable[[str, dict[str, Any]], None]

# Event kinds (the ``kind`` of each event).
ROLLOUT_STARTED = "rollout_started"
ROLLOUT_PROMOTED = "rollout_promoted"
ROLLOUT_EXTENDED = "rollout_extended"
ROLLOUT_COMPLETED = "rollout_completed"
ROLLOUT_ROLLED_BACK = "rollout_rolled_back"
ROLLOUT_ABORTED = "rollout_aborted"
ACTION_FAILED = "action_failed"

HISTORY_MAX = 200


class Phase(StrEnum):
    PROGRESSING = "progressing"
    COMPLETED = "completed"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"


def _precondition(message: str) -> AIWorksError:
    return AIWorksError(message, Status.FAILED_PRECONDITION)


@dataclass(frozen=True)
class RolloutPolicy:
    """Steps, dwell and SLO of a rollout; the controller's defaults, overridable per rollout."""

    steps: tuple[int, ...] = (5, 20, 50, 100)  # canary percent per step, rising, ending at 100
    dwell_s: float = 60.0  # time at each step before it is judged
    max_error_rate_increase: float = 0.01  # canary error rate minus stable's, as a fraction (0.01 = 1 point)
    max_p99_ratio: float = 1.5  # canary p99 / stable p99
    min_requests: int = 50  # canary requests a window needs before it is judged
    max_extensions: int = 3  # dwell extensions while short of data, then roll back
    p99_floor_s: float = 0.005  # a canary p99 under this never counts as slow

    def __post_init__(self):
        steps = tuple(self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps:
            raise InvalidArgument("a rollout needs at least one step")
        for s in steps:
            if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 100:
                raise InvalidArgument(f"step {s!r} is not a whole percent in 1..100")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise InvalidArgument(f"steps must rise: {list(steps)}")
        if steps[-1] != 100:
            raise InvalidArgument(f"the last step must be 100 (the canary takes over), not {steps[-1]}")
        if not self.dwell_s > 0:
            raise InvalidArgument(f"dwell_s must be positive, not {self.dwell_s}")
        if not 0 <= self.max_error_rate_increase <= 1:
            raise InvalidArgument(
                f"max_error_rate_increase is a fraction (0.01 = 1 point), not {self.max_error_rate_increase}"
            )
        if not self.max_p99_ratio >= 1:
            raise InvalidArgument(f"max_p99_ratio must be at least 1, not {self.max_p99_ratio}")
        if self.min_requests < 1 or self.max_extensions < 0 or self.p99_floor_s < 0:
            raise InvalidArgument("min_requests must be >= 1, max_extensions and p99_floor_s >= 0")

    def with_overrides(self, **overrides: Any) -> RolloutPolicy:
        """This policy with the given fields replaced (None leaves a field as it is)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidArgument(f"unknown rollout setting(s) {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in overrides.items() if v is not None}
        try:
            if "steps" in values:
                steps = values["steps"]
                if isinstance(steps, str):
                    values["steps"] = parse_steps(steps)
                else:
                    values["steps"] = tuple(int(x) if isinstance(x, str) else x for x in steps)
            for name in ("dwell_s", "max_error_rate_increase", "max_p99_ratio", "p99_floor_s"):
                if name in values:
                    values[name] = float(values[name])
            for name in ("min_requests", "max_extensions"):
                if name in values:
                    values[name] = int(values[name])
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad rollout setting: {exc}") from None
        return dataclasses.replace(self, **values)

    @property
    def slo(self) -> SLO:
        return SLO(self.max_error_rate_increase, self.max_p99_ratio, self.min_requests, self.p99_floor_s)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps": list(self.steps)}


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Rollout:
    """One model's rollout and everything status shows about it."""

    model: str
    stable: str
    canary: str
    policy: RolloutPolicy
    started_at: float  # wall clock
    phase: Phase = Phase.PROGRESSING
    step: int = 0  # index into policy.steps
    canary_weight: int = 0
    applied: bool = False
    apply_error: str | None = None
    reason: str = "started"
    message: str = ""
    updated_at: float = 0.0
    finished_at: float | None = None
    window: Any = None  # the metric source's token
    window_started: float = 0.0  # monotonic
    dwell_ends: float = 0.0  # monotonic
    extensions: int = 0
    baseline: VersionStats | None = None  # stable's numbers from the last window with enough stable traffic
    last_judgement: Judgement | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def weights(self) -> dict[str, int]:
        return split_weights(self.stable, self.canary, self.canary_weight)

    @property
    def where(self) -> str:
        return f"step {self.step + 1}/{len(self.policy.steps)} ({self.canary_weight}% to v{self.canary})"

    def to_json(self, now: float) -> dict[str, Any]:
        progressing = self.phase is Phase.PROGRESSING
        return {
            "model": self.model,
            "stable": self.stable,
            "canary": self.canary,
            "phase": str(self.phase),
            "reason": self.reason,
            "message": self.message,
            "step": self.step + 1,
            "steps": list(self.policy.steps),
            "canary_weight": self.canary_weight,
            "weights": self.weights,
            "applied": self.applied,
            "apply_error": self.apply_error,
            "dwell_left_s": round(max(0.0, self.dwell_ends - now), 3) if progressing and self.applied else None,
            "extensions": self.extensions,
            "policy": self.policy.to_json(),
            "started": _iso(self.started_at),
            "updated": _iso(self.updated_at),
            "finished": _iso(self.finished_at),
            "last_judgement": self.last_judgement.to_json() if self.last_judgement else None,
            "history": list(self.history),
        }


class RolloutController:
    """Starts, advances, judges, promotes and rolls back canary rollouts, one per model."""

    def __init__(
        self,
        target: TrafficTarget,
        metrics: MetricSource,
        emit: Emit,
        audit: Audit | None = None,
        *,
        defaults: RolloutPolicy | None = None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.target = target
        self.metrics = metrics
        self._emit = emit
        self._audit = audit
        self.defaults = defaults or RolloutPolicy()
        self.interval_s = interval_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._rollouts: dict[str, Rollout] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- the API (HTTP routes delegate here) ------------------------------------------------

    async def start(self, model: str, canary: str, *, stable: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Start moving ``model``'s traffic to version ``canary``; the first step's weights are in force on return.

        ``stable`` defaults to the version serving now. ``overrides`` are
        :class:`RolloutPolicy` fields. Refused while another rollout of the
        model is in progress; nothing changes when the first weights cannot be applied.
        """
        if not model or not canary:
            raise InvalidArgument("a rollout needs a model and a canary version")
        canary = str(canary)
        policy = self.defaults.with_overrides(**overrides)
        async with self._lock(model):
            current = self._rollouts.get(model)
            if current is not None and current.phase is Phase.PROGRESSING:
                raise AIWorksError(
                    f"a rollout of {model} is in progress (v{current.stable} -> v{current.canary}, {current.where}); "
                    "abort it first",
                    Status.ALREADY_EXISTS,
                )
            stable = str(stable) if stable else await self.target.serving_version(model)
            if stable == canary:
                raise InvalidArgument(f"version {canary} of {model} already serves; nothing to roll out")
            ready = await self.target.ready_versions(model)
            missing = [v for v in (stable, canary) if ready and v not in ready]
            if missing:
                raise _precondition(f"{model} version(s) {missing} are not ready on any replica; ready: {ready}")
            now = self.wall_clock()
            r = Rollout(model, stable, canary, policy, started_at=now, canary_weight=policy.steps[0], updated_at=now)
            await self.target.set_split(model, stable, canary, r.canary_weight)  # raises: nothing started
            r.applied = True
            await self._open_window(r)
            self._rollouts[model] = r
            r.message = f"v{stable} -> v{canary}: {r.where}, {policy.dwell_s:g} s per step"
            self._record(r, ROLLOUT_STARTED, "started", r.message, audit_action="rollout_start")
            return r.to_json(self.clock())

    def status(self, model: str | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """One model's latest rollout (NOT_FOUND if none), or every model's."""
        now = self.clock()
        if model is not None:
            return self._get(model).to_json(now)
        return [self._rollouts[m].to_json(now) for m in sorted(self._rollouts)]

    async def abort(self, model: str) -> dict[str, Any]:
        """Stop a rollout in progress where it is and send all traffic to stable."""
        async with self._lock(model):
            r = self._get(model)
            if r.phase is not Phase.PROGRESSING:
                hint = f"; `rollback` returns {model} to v{r.stable}" if r.phase is Phase.COMPLETED else ""
                raise _precondition(f"the rollout of {model} is {r.phase}, not in progress{hint}")
            message = f"aborted at {r.where}; all traffic back to v{r.stable}"
            await self._finish(r, Phase.ABORTED, "aborted", message, ROLLOUT_ABORTED, "rollout_abort")
            return r.to_json(self.clock())

    async def rollback(self, model: str) -> dict[str, Any]:
        """All traffic back to the version the latest rollout replaced, in progress or completed."""
        async with self._lock(model):
            r = self._get(model)
            if r.phase in (Phase.ROLLED_BACK, Phase.ABORTED):
                if not r.applied:  # asked again while the weights are still pending: try now
                    await self._apply(r)
                    return r.to_json(self.clock())
                raise _precondition(f"{model} is already back on v{r.stable} (the rollout was {r.phase})")
            was = "after completion" if r.phase is Phase.COMPLETED else f"at {r.where}"
            message = f"rolled back on request {was}; all traffic to v{r.stable}"
            await self._finish(r, Phase.ROLLED_BACK, "manual", message, ROLLOUT_ROLLED_BACK, "rollout_rollback")
            return r.to_json(self.clock())

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """``tick()`` every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.tick()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        """One round: re-apply pending weights, judge every step whose dwell is over."""
        for model in list(self._rollouts):
            async with self._lock(model):
                r = self._rollouts.get(model)
                if r is None:
                    continue
                try:
                    await self._advance(r)
                except Exception:  # a bug must not stop the other rollouts, nor the loop
                    log.exception("rollout of %s: round failed", model)

    async def close(self) -> None:
        await self.metrics.close()
        await self.target.close()

    # ---- the state machine ------------------------------------------------------------------

    async def _advance(self, r: Rollout) -> None:
        if not r.applied:
            if await self._apply(r) and r.phase is Phase.PROGRESSING:
                await self._open_window(r)
            return
        if r.phase is not Phase.PROGRESSING:
            return
        now = self.clock()
        if now < r.dwell_ends:
            return
        window_s = now - r.window_started
        try:
            stats = await self.metrics.read(r.model, [r.stable, r.canary], r.window)
        except Exception as exc:
            judgement = Judgement(
                "insufficient", "insufficient_data", f"metrics unavailable: {exc}", VersionStats(), r.baseline,
                "earlier" if r.baseline else "none", window_s,
            )  # fmt: skip
        else:
            judgement = self._judge(r, stats, window_s)
        r.last_judgement = judgement
        if judgement.verdict == "insufficient":
            if r.extensions < r.policy.max_extensions:
                r.extensions += 1
                r.dwell_ends = now + r.policy.dwell_s
                message = (
                    f"{judgement.message}; dwell at {r.where} extended by {r.policy.dwell_s:g} s "
                    f"({r.extensions}/{r.policy.max_extensions})"
                )
                self._record(r, ROLLOUT_EXTENDED, "insufficient_data", message, judgement)
                return
            message = f"insufficient data after {window_s:.0f} s at {r.where}: {judgement.message}"
            await self._finish(
                r, Phase.ROLLED_BACK, "insufficient_data", message, ROLLOUT_ROLLED_BACK, "rollout_auto_rollback",
                judgement,
            )  # fmt: skip
        elif judgement.verdict == "fail":
            message = f"{judgement.message} at {r.where}; all traffic back to v{r.stable}"
            await self._finish(
                r, Phase.ROLLED_BACK, judgement.reason, message, ROLLOUT_ROLLED_BACK, "rollout_auto_rollback",
                judgement,
            )  # fmt: skip
        elif r.step == len(r.policy.steps) - 1:
            message = f"v{r.canary} serves all traffic and replaces v{r.stable}: {judgement.message}"
            r.phase, r.reason, r.message = Phase.COMPLETED, "completed", message
            r.finished_at = self.wall_clock()
            self._record(r, ROLLOUT_COMPLETED, "completed", message, judgement, audit_action="rollout_complete")
        else:
            passed = r.where
            r.step += 1
            r.canary_weight = r.policy.steps[r.step]
            r.applied = False
            r.reason, r.message = "within_slo", f"{passed} within SLO ({judgement.message}); now {r.where}"
            if await self._apply(r):
                await self._open_window(r)
            self._record(r, ROLLOUT_PROMOTED, "within_slo", r.message, judgement, audit_action="rollout_promote")

    def _judge(self, r: Rollout, stats: dict[str, VersionStats], window_s: float) -> Judgement:
        canary = stats.get(r.canary, VersionStats())
        stable = stats.get(r.stable, VersionStats())
        if stable.requests >= r.policy.min_requests:
            r.baseline = stable
            baseline, source = stable, "window"
        elif r.baseline is not None:
            baseline, source = r.baseline, "earlier"
        elif stable.requests:
            baseline, source = stable, "window"
        else:
            baseline, source = None, "none"
        return judge(canary, baseline, r.policy.slo, window_s=window_s, baseline=source)

    async def _finish(
        self,
        r: Rollout,
        phase: Phase,
        reason: str,
        message: str,
        kind: str,
        audit_action: str,
        judgement: Judgement | None = None,
    ) -> None:
        """Every way back to stable: all traffic to stable, then the event (applied or pending)."""
        r.phase, r.reason, r.message = phase, reason, message
        r.canary_weight = 0
        r.applied = False
        r.finished_at = self.wall_clock()
        await self._apply(r)
        self._record(r, kind, reason, message, judgement, audit_action=audit_action)

    async def _apply(self, r: Rollout) -> bool:
        try:
            await self.target.set_split(r.model, r.stable, r.canary, r.canary_weight)
        except Exception as exc:
            error = str(exc) or type(exc).__name__
            if error != r.apply_error:  # once per distinct failure, not every round
                self._send(
                    ACTION_FAILED, r.model, "traffic_target",
                    f"could not set {r.model} to {r.weights} through {self.target.name}: {error}; retrying",
                    {"weights": r.weights, "error": error},
                )  # fmt: skip
            r.apply_error = error
            return False
        if r.apply_error is not None:
            log.info("rollout of %s: weights %s applied after an earlier failure", r.model, r.weights)
        r.applied, r.apply_error = True, None
        return True

    async def _open_window(self, r: Rollout) -> None:
        r.window_started = self.clock()  # set before the await, so status never shows the last window's end
        r.dwell_ends = r.window_started + r.policy.dwell_s
        r.extensions = 0
        try:
            r.window = await self.metrics.begin(r.model)
        except Exception as exc:  # read() will then report the trouble
            log.warning("rollout of %s: metrics window did not start: %s", r.model, exc)
            r.window = None

    # ---- records -------------------------------------------------------------------------------

    def _record(
        self,
        r: Rollout,
        kind: str,
        reason: str,
        message: str,
        judgement: Judgement | None = None,
        *,
        audit_action: str | None = None,
    ) -> None:
        r.updated_at = self.wall_clock()
        entry = {
            "time": _iso(r.updated_at),
            "event": kind,
            "step": r.step + 1,
            "canary_weight": r.canary_weight,
            "applied": r.applied,
            "reason": reason,
            "message": message,
        }
        if judgement is not None:
            entry["judgement"] = judgement.to_json()
        r.history.append(entry)
        del r.history[:-HISTORY_MAX]
        details = {
            "stable": r.stable,
            "canary": r.canary,
            "step": r.step + 1,
            "steps": list(r.policy.steps),
            "canary_weight": r.canary_weight,
            "weights": r.weights,
            "applied": r.applied,
            "judgement": judgement.to_json() if judgement else None,
        }
        self._send(kind, r.model, reason, message, details)
        if audit_action and self._audit is not None:
            try:
                self._audit(
                    audit_action,
                    {"model": r.model, "stable": r.stable, "canary": r.canary, "canary_weight": r.canary_weight,
                     "reason": reason, "applied": r.applied},
                )  # fmt: skip
            except Exception:
                log.exception("audit of %s failed", audit_action)

    def _send(self, kind: str, target: str, reason: str, message: str, details: dict[str, Any]) -> None:
        try:
            self._emit(kind, target, reason, message, details)
        except Exception:  # the event sink must never stop a rollback
            log.exception("emitting %s for %s failed", kind, target)

    def _get(self, model: str) -> Rollout:
        r = self._rollouts.get(model)
        if r is None:
            raise NotFound(f"no rollout of {model}")
        return r

    def _lock(self, model: str) -> asyncio.Lock:
        lock = self._locks.get(model)
        if lock is None:
            lock = self._locks[model] = asyncio.Lock()
        return lock


def parse_steps(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"5,20,50,100"`` (or a list) as a steps tuple; validated by :class:`RolloutPolicy`."""
    if not isinstance(text, str):
        return tuple(text)
    try:
        return tuple(int(p.strip().rstrip("%")) for p in text.split(",") if p.strip())
    except ValueError:
        raise InvalidArgument(f"steps {text!r} are not comma-separated percents such as 5,20,50,100") from None
