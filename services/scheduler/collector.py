"""The scheduler's state as Prometheus gauges, read when Prometheus scrapes.

Queue depth, queued bytes and each replica's health change on every request;
keeping gauges current on the request path would cost every request a few
lock round trips for values read every 15 s. Instead this collector asks for
:meth:`Scheduler.status` at scrape time, on the event loop's thread
(:func:`aiworks.core.metrics.on_loop`), and turns it into the catalogue's
gauges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiworks.scheduler.views import StatusView
from prometheus_client.core import GaugeMetricFamily

from aiworks.core import metrics

log = logging.getLogger(__name__)


class SchedulerCollector(metrics.ScrapeCollector):
    """Queue depth per priority, queued bytes, and replica up/ejected/in-flight/latency."""

    def __init__(self, read_status: Callable[[], StatusView]):
        self._read_status = read_status

    def collect(self):
        try:
            view = self._read_status()
        except Exception as exc:  # a stuck loop or a bug: the scrape still answers the other metrics
            log.warning("scheduler state not exported this scrape: %s", exc or type(exc).__name__)
            return
        depth = GaugeMetricFamily(
            metrics.SCHEDULER_QUEUE_DEPTH, "Requests queued now.", labels=["model", "version", "priority"]
        )
        queued_bytes = GaugeMetricFamily(
            metrics.SCHEDULER_QUEUE_BYTES, "Input bytes queued now.", labels=["model", "version"]
        )
        for q in view.queues:
            for priority, count in (
                ("realtime", q.queued_realtime),
                ("standard", q.queued_standard),
                ("batch", q.queued_batch),
            ):
                depth.add_metric([q.model, q.version, priority], count)
            queued_bytes.add_metric([q.model, q.version], q.queued_bytes)
        up = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_UP, "1 while a runtime replica is live, else 0.", labels=["replica", "device"]
        )
        ejected = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_EJECTED, "1 while a replica is ejected from routing.", labels=["replica"]
        )
        inflight = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_INFLIGHT, "Batches in flight on a replica.", labels=["replica"]
        )
        latency = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_LATENCY,
            "Moving average of a replica's batch latency (0 until measured).",
            labels=["replica"],
        )
        for r in view.replicas:
            up.add_metric([r.replica_id, r.device], 1.0 if r.live else 0.0)
            ejected.add_metric([r.replica_id], 1.0 if r.ejected else 0.0)
            inflight.add_metric([r.replica_id], r.outstanding_batches)
            latency.add_metric([r.replica_id], r.ewma_latency_ms / 1e3)
        yield from (depth, queued_bytes, up, ejected, inflight, latency)
