"""The batch runner's metrics: rows and chunks counted as they are recorded, job progress read at scrape."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.core import GaugeMetricFamily

from aiworks.core.metrics import (
    BATCH_IN_FLIGHT_LIMIT,
    BATCH_JOB_PROGRESS,
    BATCH_JOBS_ACTIVE,
    ScrapeCollector,
    on_loop,
    serve_metrics_or_warn,
)

log = logging.getLogger(__name__)


class BatchCollector(ScrapeCollector):
    """Progress of the jobs not yet ended, from the runner's last look at them (no Redis call at scrape)."""

    def __init__(self, read, in_flight_limit=None):
        self._read = read
        self._in_flight_limit = in_flight_limit

    def collect(self):
        try:
            jobs = self._read()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the loop is busy
            log.debug("batch metrics: %s", exc)
            return
        progress = GaugeMetricFamily(BATCH_JOB_PROGRESS, "Lines done / lines of a batch job not yet ended.",
                                     labels=["job", "tenant"])  # fmt: skip
        active = GaugeMetricFamily(BATCH_JOBS_ACTIVE, "Batch jobs not yet ended, by status.", labels=["status"])
        by_status: dict[str, int] = {}
        for job in jobs:
            if job.total:
                progress.add_metric([job.id, job.tenant], (job.completed + job.failed) / job.total)
            by_status[job.status] = by_status.get(job.status, 0) + 1
        for status, count in sorted(by_status.items()):
            active.add_metric([status], count)
        yield progress
        yield active
        if self._in_flight_limit is not None:
            limit = GaugeMetricFamily(
                BATCH_IN_FLIGHT_LIMIT, "Requests this runner may have in flight now (AIMD; under 1: the share of time one is)."
            )
            limit.add_metric([], self._in_flight_limit())
            yield limit


def serve_runner_metrics(runner, port: int, host: str = "127.0.0.1"):
    """/metrics for one runner; the job gauges come from the runner's event loop."""
    collector = BatchCollector(
        on_loop(asyncio.get_running_loop(), lambda: list(runner.seen.values())), lambda: runner.pacer.limit
    )
    collector.register()
    return serve_metrics_or_warn(port, host)
