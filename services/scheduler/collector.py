"""The scheduler's global view as Prometheus gauges, read when Prometheus scrapes.

Each replica's liveness, and its ejection and latency as the gateways report
them: this collector asks for :meth:`Scheduler.status` at scrape time, on the
event loop's thread (:func:`aiworks.core.metrics.on_loop`), and turns it into
the catalogue's gauges. Queue depths are exported by the runtimes, where the
queues are.

Shadow traffic (:mod:`aiworks.scheduler.shadow`) is exported here too, under
the ``aiworks_scheduler_shadow_*`` names below, labelled by model, shadow
version and comparison: counters of copies mirrored, compared, agreed, failed
and dropped, and gauges of the agreement ratio and copies in flight. Retiring
versions show as ``aiworks_scheduler_queue_draining``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aiworks.core import metrics
from aiworks.scheduler.views import StatusView

log = logging.getLogger(__name__)

# Shadow traffic and draining; documented in docs/scheduler.md.
SHADOW_COUNTERS = {
    "aiworks_scheduler_shadow_mirrored": ("mirrored", "Requests sampled for a copy to the shadow version."),
    "aiworks_scheduler_shadow_compared": ("compared", "Shadow answers compared with the primary's."),
    "aiworks_scheduler_shadow_agreed": ("agreed", "Shadow answers that agreed with the primary's."),
    "aiworks_scheduler_shadow_errors": ("errors", "Shadow copies that failed or timed out."),
    "aiworks_scheduler_shadow_dropped": ("dropped", "Shadow copies not run: bound reached or shadow queue full."),
}
SHADOW_AGREEMENT = "aiworks_scheduler_shadow_agreement_ratio"
SHADOW_INFLIGHT = "aiworks_scheduler_shadow_inflight_requests"
QUEUE_DRAINING = "aiworks_scheduler_queue_draining"


class SchedulerCollector(metrics.ScrapeCollector):
    """Replica up/ejected/in-flight/latency, shadow counts, and versions draining."""

    def __init__(self, read_status: Callable[[], StatusView]):
        self._read_status = read_status

    def collect(self):
        try:
            view = self._read_status()
        except Exception as exc:  # a stuck loop or a bug: the scrape still answers the other metrics
            log.warning("scheduler state not exported this scrape: %s", exc or type(exc).__name__)
            return
        up = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_UP, "1 while a runtime replica is live, else 0.", labels=["replica", "device"]
        )
        ejected = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_EJECTED, "1 while a replica is ejected from routing.", labels=["replica"]
        )
        stopping = GaugeMetricFamily(
            metrics.SCHEDULER_REPLICA_STOPPING,
            "1 while a replica drains after its stop signal (not live, on purpose), else 0.",
            labels=["replica"],
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
            stopping.add_metric([r.replica_id], 1.0 if r.stopping else 0.0)
            inflight.add_metric([r.replica_id], r.outstanding_batches)
            latency.add_metric([r.replica_id], r.ewma_latency_ms / 1e3)
        yield from (up, ejected, stopping, inflight, latency)
        yield from self._lifecycle(view)

    @staticmethod
    def _lifecycle(view: StatusView):
        labels = ["model", "shadow_version", "compare"]
        counters = {
            name: (field, CounterMetricFamily(name, text, labels=labels))
            for name, (field, text) in SHADOW_COUNTERS.items()
        }
        agreement = GaugeMetricFamily(SHADOW_AGREEMENT, "Shadow answers agreed / compared.", labels=labels)
        shadow_inflight = GaugeMetricFamily(SHADOW_INFLIGHT, "Shadow copies not answered yet.", labels=labels)
        for s in view.shadows:
            values = [s.model, s.shadow_version, s.compare]
            for field, family in counters.values():
                family.add_metric(values, getattr(s, field))
            agreement.add_metric(values, s.agreement)
            shadow_inflight.add_metric(values, s.inflight)
        draining = GaugeMetricFamily(
            QUEUE_DRAINING, "1 while a model version is retiring and its work drains.", labels=["model", "version"]
        )
        for q in view.queues:
            draining.add_metric([q.model, q.version], 1.0 if q.draining else 0.0)
        yield from (family for _, family in counters.values())
        yield from (agreement, shadow_inflight, draining)
