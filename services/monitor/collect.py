"""Collecting the suite's metrics: scrape each ``/metrics``, or ask Prometheus.

Both ways give the same thing: the current samples of the ``aiworks_*``
metrics the monitor reads (names from :mod:`aiworks.core.metrics`), grouped
by the ``host:port`` they were scraped from. The rest of the monitor maps a
target to its service through discovery, so it never cares which way the
samples came. Scraping directly is the local default: it sees a replica the
moment the supervisor starts it. Behind Prometheus (``prometheus_url``), one
instant query returns every target's samples, grouped by Prometheus' own
``instance`` label, which is the same ``host:port``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core import metrics as m

log = logging.getLogger(__name__)

# What the monitor reads, as exposition sample names.
RUNTIME_EXECUTIONS = "aiworks_runtime_executions_total"
RUNTIME_COMPUTE_SUM = "aiworks_runtime_compute_duration_seconds_sum"
RUNTIME_COMPUTE_COUNT = "aiworks_runtime_compute_duration_seconds_count"
RUNTIME_INFLIGHT = "aiworks_runtime_inflight_batches"
PROCESS_RSS = "process_resident_memory_bytes"
QUEUE_DEPTH = m.SCHEDULER_QUEUE_DEPTH
REPLICA_UP = m.SCHEDULER_REPLICA_UP
REPLICA_EJECTED = m.SCHEDULER_REPLICA_EJECTED
REPLICA_INFLIGHT = m.SCHEDULER_REPLICA_INFLIGHT
REPLICA_LATENCY = m.SCHEDULER_REPLICA_LATENCY
GATEWAY_DURATION_BUCKET = "aiworks_gateway_request_duration_seconds_bucket"

READ = (
    RUNTIME_EXECUTIONS, RUNTIME_COMPUTE_SUM, RUNTIME_COMPUTE_COUNT, RUNTIME_INFLIGHT, PROCESS_RSS,
    QUEUE_DEPTH, REPLICA_UP, REPLICA_EJECTED, REPLICA_INFLIGHT, REPLICA_LATENCY, GATEWAY_DURATION_BUCKET,
)  # fmt: skip
_READ_SET = frozenset(READ)


class Sample(NamedTuple):
    """One sample of one series."""

    name: str
    labels: dict[str, str]
    value: float


class Collector(Protocol):
    """Where samples come from: :class:`Scraper` or :class:`PrometheusCollector` (or a test's fake)."""

    async def collect(self, targets: Sequence[str]) -> dict[str, list[Sample]]:
        """Samples per ``host:port`` target; a target that could not be read is missing."""
        ...

    async def close(self) -> None: ...


def parse_exposition(text: str) -> list[Sample]:
    """The samples the monitor reads out of a Prometheus text exposition."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in _READ_SET
    ]


class MetricsReader:
    """Fetches ``http://<target>/metrics`` over one lazily opened session (the monitor's and the rollouts' scrapes)."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def text(self, target: str) -> str | None:
        """The exposition text, or None when the target did not answer in time (logged at DEBUG)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(f"http://{target}/metrics") as resp:
                resp.raise_for_status()
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("scrape of %s failed: %s", target, exc)
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Scraper(MetricsReader):
    """Reads ``http://<target>/metrics`` of every target concurrently."""

    async def _scrape(self, target: str) -> list[Sample] | None:
        text = await self.text(target)
        return None if text is None else parse_exposition(text)

    async def collect(self, targets: Sequence[str]) -> dict[str, list[Sample]]:
        results = await asyncio.gather(*(self._scrape(t) for t in targets))
        return {t: r for t, r in zip(targets, results) if r is not None}



class PrometheusCollector:
    """One instant query to Prometheus' HTTP API for every series the monitor reads."""

    QUERY = '{__name__=~"' + "|".join(READ) + '"}'

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def collect(self, targets: Sequence[str]) -> dict[str, list[Sample]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(f"{self.url}/api/v1/query", params={"query": self.QUERY}) as resp:
                resp.raise_for_status()
                doc = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("query to Prometheus at %s failed: %s", self.url, exc)
            return {}
        return group_by_instance(doc, targets)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def group_by_instance(doc: dict, targets: Sequence[str]) -> dict[str, list[Sample]]:
    """An instant-query answer (``resultType: vector``) as samples per wanted ``instance``."""
    wanted = set(targets)
    out: dict[str, list[Sample]] = {}
    if doc.get("status") != "success":
        log.warning("Prometheus answered %s: %s", doc.get("status"), doc.get("error"))
        return out
    for series in doc.get("data", {}).get("result", []):
        labels = dict(series.get("metric", {}))
        name = labels.pop("__name__", "")
        instance = labels.pop("instance", "")
        labels.pop("job", None)
        if instance not in wanted:
            continue
        out.setdefault(instance, []).append(Sample(name, labels, float(series["value"][1])))
    return out
