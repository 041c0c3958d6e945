"""Judging a canary against stable: window metrics per version, and the verdict.

A rollout step is judged on what happened during its dwell window only, so
both metric sources answer the same question, "per version, since the window
began": how many requests, how many failed, and the p99 latency.

- :class:`ScrapeSource` reads every ``/metrics`` endpoint itself at the start
  of the window and again at its end, and subtracts (counters and histogram
  buckets are cumulative; a series that went down was reset by a restart and
  counts from zero). The p99 comes from the bucket deltas, interpolated as
  Prometheus' ``histogram_quantile`` does.
- :class:`PrometheusSource` asks Prometheus' HTTP API for ``increase()`` and
  ``histogram_quantile()`` over the window's length.

Where the numbers come from, and why:

- Requests and errors from the gateway's ``aiworks_gateway_requests_total``
  ``{model, version, status}``, summed over tenants and protocols: what
  clients got. The gateway gives a request that names no version (all canary
  traffic) its version from the scheduler's weights, and labels the answer,
  a failure included, with that version.
- Latency from the gateway's ``aiworks_gateway_request_duration_seconds``
  ``{model, version}``: end to end, as clients feel it, and labelled with the
  version that served once the request succeeded.
- Every answer other than ``ok`` is an error. Errors clients cause (bad
  inputs) fall on both versions alike and cancel out in the comparison, while
  a canary that refuses inputs stable accepted is caught.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core.errors import Unavailable
from aiworks.monitor import signals
from aiworks.monitor.collect import MetricsReader

log = logging.getLogger(__name__)

REQUESTS = "aiworks_gateway_requests_total"
LATENCY_BUCKET = "aiworks_gateway_request_duration_seconds_bucket"
QUANTILE = 0.99

Targets = Sequence[str] | Callable[[], Sequence[str] | Awaitable[Sequence[str]]]


# ---- numbers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionStats:
    """One version's traffic over a window."""

    requests: int = 0
    errors: int = 0
    p99_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 6),
            "p99_s": None if self.p99_s is None else round(self.p99_s, 6),
        }


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts ``{le: count}`` (``+Inf`` included), as Prometheus computes it."""
    return signals.histogram_quantile(q, buckets.items())


# ---- the judgement ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """What a canary must hold, relative to stable, to be promoted."""

    max_error_rate_increase: float = 0.01  # absolute: 0.01 is one percentage point
    max_p99_ratio: float = 1.5
    min_requests: int = 50  # canary requests in the window before it is judged at all
    p99_floor_s: float = 0.005  # a canary p99 below this is never "slow" (timer and scheduling noise)


Verdict = Literal["pass", "fail", "insufficient"]


@dataclass(frozen=True)
class Judgement:
    """The outcome of comparing canary against stable over one window."""

    verdict: Verdict
    reason: str  # within_slo, error_rate, p99_latency, insufficient_data
    message: str
    canary: VersionStats
    stable: VersionStats | None  # the baseline used; None when there was none
    baseline: str  # "window" (this window's stable traffic), "earlier" (a previous window's) or "none"
    window_s: float
    p99_ratio: float | None = None
    limits: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "message": self.message,
            "window_s": round(self.window_s, 3),
            "canary": self.canary.to_json(),
            "stable": None if self.stable is None else self.stable.to_json(),
            "baseline": self.baseline,
            "p99_ratio": None if self.p99_ratio is None else round(self.p99_ratio, 3),
            "limits": dict(self.limits),
        }


def _pct(rate: float) -> str:
    return f"{rate * 100:.3g}%"


def _points(increase: float) -> str:
    value = f"{increase * 100:g}"
    return f"+{value} point" + ("" if value == "1" else "s")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def judge(
    canary: VersionStats, stable: VersionStats | None, slo: SLO, *, window_s: float, baseline: str = "window"
) -> Judgement:
    """Compare ``canary`` with the ``stable`` baseline (None: no baseline, stable taken as error-free).

    ``baseline`` says where stable's numbers come from: ``"window"`` (stable
    served alongside the canary in this window) or ``"earlier"`` (a previous
    window's, when stable served too little now, as at 100%). Latency is
    compared only within one window: p99 depends on the load and on how many
    versions share the replicas' instances, so a p99 from another window is no
    fair yardstick. The error rate is compared against either.
    """
    limits = {
        "max_error_rate_increase": slo.max_error_rate_increase,
        "max_p99_ratio": slo.max_p99_ratio,
        "min_requests": slo.min_requests,
        "p99_floor_s": slo.p99_floor_s,
    }
    if stable is None:
        baseline = "none"

    def verdict(v: Verdict, reason: str, message: str, ratio: float | None = None) -> Judgement:
        return Judgement(v, reason, message, canary, stable, baseline, window_s, ratio, limits)

    if canary.requests < slo.min_requests:
        return verdict(
            "insufficient",
            "insufficient_data",
            f"{canary.requests} canary request(s) in {window_s:.0f} s (need {slo.min_requests})",
        )
    stable_rate = stable.error_rate if stable is not None else 0.0
    if canary.error_rate - stable_rate > slo.max_error_rate_increase + 1e-12:
        return verdict(
            "fail",
            "error_rate",
            f"canary error rate {_pct(canary.error_rate)} vs stable {_pct(stable_rate)} "
            f"(allowed {_points(slo.max_error_rate_increase)})",
        )
    ratio = None
    same_window = stable is not None and baseline == "window"
    if same_window and stable.p99_s is not None and canary.p99_s is not None:
        ratio = canary.p99_s / max(stable.p99_s, 1e-9)
        if canary.p99_s > slo.p99_floor_s and ratio > slo.max_p99_ratio:
            return verdict(
                "fail",
                "p99_latency",
                f"canary p99 {ratio:.1f}x stable ({_ms(canary.p99_s)} vs {_ms(stable.p99_s)}; "
                f"allowed {slo.max_p99_ratio:g}x)",
                ratio,
            )
    if same_window:
        latency = f", p99 {_ms(canary.p99_s)} vs {_ms(stable.p99_s)}"
        latency += f" ({ratio:.2f}x)" if ratio is not None else ""
    else:
        latency = f", p99 {_ms(canary.p99_s)} (not compared: no stable traffic in this window)"
    return verdict(
        "pass",
        "within_slo",
        f"canary error rate {_pct(canary.error_rate)} vs stable {_pct(stable_rate)}{latency}; "
        f"{canary.requests} canary request(s)",
        ratio,
    )


# ---- metric sources ---------------------------------------------------------------------------


class MetricSource(Protocol):
    """Per-version traffic over a window: :class:`ScrapeSource`, :class:`PrometheusSource`, or a test's fake."""

    async def begin(self, model: str) -> Any:
        """Start a window now; the returned token goes to :meth:`read`. Never raises."""
        ...

    async def read(self, model: str, versions: Sequence[str], token: Any) -> dict[str, VersionStats]:
        """Each version's traffic since ``begin`` returned ``token`` (reading again extends the window)."""
        ...

    async def close(self) -> None: ...


@dataclass
class _Cumulative:
    """One target's cumulative series of one model, as last scraped."""

    requests: dict[tuple[str, str], float] = field(default_factory=dict)  # (version, status) -> count
    buckets: dict[tuple[str, float], float] = field(default_factory=dict)  # (version, le) -> count


def parse_cumulative(text: str, model: str) -> _Cumulative:
    """The model's request counters and latency buckets out of one exposition, summed over other labels."""
    out = _Cumulative()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in (REQUESTS, LATENCY_BUCKET) or s.labels.get("model") != model:
                continue
            version = s.labels.get("version", "")
            if s.name == REQUESTS:
                key = (version, s.labels.get("status", ""))
                out.requests[key] = out.requests.get(key, 0.0) + s.value
            else:
                bucket = (version, float(s.labels.get("le", "+Inf")))
                out.buckets[bucket] = out.buckets.get(bucket, 0.0) + s.value
    return out


def _delta(now: dict, before: dict) -> dict:
    # A series below its earlier value was reset (the process restarted): all of it is new.
    return {k: (v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v) for k, v in now.items()}


@dataclass
class _ScrapeWindow:
    start: dict[str, _Cumulative]  # per target; a target first seen later joins from that scrape


class ScrapeSource:
    """Scrapes ``http://<target>/metrics`` of the gateways and schedulers at both ends of a window.

    ``targets`` is a list of ``host:port`` or a (sync or async) callable
    returning one, so discovery can add replicas while a rollout runs.
    """

    def __init__(self, targets: Targets, timeout_s: float = 2.0):
        self._targets = targets
        self._reader = MetricsReader(timeout_s)

    async def _target_list(self) -> list[str]:
        found = self._targets() if callable(self._targets) else self._targets
        if inspect.isawaitable(found):
            found = await found
        return list(found)

    async def _scrape(self, target: str, model: str) -> _Cumulative | None:
        text = await self._reader.text(target)
        return None if text is None else parse_cumulative(text, model)

    async def _scrape_all(self, model: str) -> dict[str, _Cumulative]:
        try:
            targets = await self._target_list()
        except Exception as exc:  # discovery failed: this scrape sees nothing
            log.warning("no metrics targets: %s", exc)
            return {}
        results = await asyncio.gather(*(self._scrape(t, model) for t in targets))
        return {t: r for t, r in zip(targets, results) if r is not None}

    async def begin(self, model: str) -> _ScrapeWindow:
        return _ScrapeWindow(await self._scrape_all(model))

    async def read(self, model: str, versions: Sequence[str], token: _ScrapeWindow) -> dict[str, VersionStats]:
        now = await self._scrape_all(model)
        if not now:
            raise Unavailable("no metrics endpoint answered")
        requests: dict[tuple[str, str], float] = defaultdict(float)
        buckets: dict[tuple[str, float], float] = defaultdict(float)
        for target, current in now.items():
            start = token.start.get(target)
            if start is None:
                token.start[target] = current
                continue
            for k, v in _delta(current.requests, start.requests).items():
                requests[k] += v
            for k, v in _delta(current.buckets, start.buckets).items():
                buckets[k] += v
        out = {}
        for version in versions:
            total = sum(v for (ver, _), v in requests.items() if ver == version)
            ok = sum(v for (ver, status), v in requests.items() if ver == version and status == "ok")
            latency = {le: v for (ver, le), v in buckets.items() if ver == version}
            out[version] = VersionStats(round(total), round(total - ok), histogram_quantile(QUANTILE, latency))
        return out

    async def close(self) -> None:
        await self._reader.close()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class PrometheusSource:
    """Asks Prometheus for each version's ``increase()`` and ``histogram_quantile()`` over the window.

    The window is the wall time since :meth:`begin`, at least ``min_range_s``
    (``increase()`` needs two samples in range, so make that at least twice
    Prometheus' scrape interval, and dwell times longer still).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        *,
        min_range_s: float = 30.0,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.min_range_s = min_range_s
        self._wall = wall_clock
        self._session: aiohttp.ClientSession | None = None

    async def begin(self, model: str) -> float:
        return self._wall()

    def queries(self, model: str, range_s: int) -> tuple[str, str]:
        """The two PromQL queries of a window of ``range_s`` seconds."""
        sel = f'model="{_label(model)}"'
        requests = f"sum by (version, status) (increase({REQUESTS}{{{sel}}}[{range_s}s]))"
        p99 = f"histogram_quantile({QUANTILE}, sum by (version, le) (increase({LATENCY_BUCKET}{{{sel}}}[{range_s}s])))"
        return requests, p99

    async def _query(self, promql: str) -> list[dict]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(f"{self.url}/api/v1/query", params={"query": promql}) as resp:
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Unavailable(f"Prometheus at {self.url} did not answer: {exc}") from None
        if doc.get("status") != "success":
            raise Unavailable(f"Prometheus at {self.url} refused the query: {doc.get('error', doc.get('status'))}")
        return doc.get("data", {}).get("result", [])

    async def read(self, model: str, versions: Sequence[str], token: float) -> dict[str, VersionStats]:
        range_s = math.ceil(max(self._wall() - token, self.min_range_s))
        requests_q, p99_q = self.queries(model, range_s)
        by_status, quantiles = await asyncio.gather(self._query(requests_q), self._query(p99_q))
        total: dict[str, float] = defaultdict(float)
        ok: dict[str, float] = defaultdict(float)
        for series in by_status:
            labels, value = series.get("metric", {}), float(series["value"][1])
            if math.isnan(value):
                continue
            version = labels.get("version", "")
            total[version] += value
            if labels.get("status") == "ok":
                ok[version] += value
        p99: dict[str, float] = {}
        for series in quantiles:
            value = float(series["value"][1])
            if not math.isnan(value):
                p99[series.get("metric", {}).get("version", "")] = value
        return {v: VersionStats(round(total[v]), round(total[v] - ok[v]), p99.get(v)) for v in versions}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
