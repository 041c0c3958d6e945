"""The monitor's own Prometheus metrics (names from :mod:`aiworks.core.metrics`).

They live in a registry per monitor rather than the process-wide default, so
a test can run several control loops in one process and read each one's
numbers. The server exposes this registry on ``/metrics``, together with the
process' own ``process_*`` figures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from aiworks.core import metrics as m


class MonitorMetrics:
    """Health scores, actions, anomalies and replica counts."""

    def __init__(self, registry: CollectorRegistry | None = None, process: bool = False):
        self.registry = registry or CollectorRegistry()
        if process:
            # The standard names (process_*, python_gc_*, python_info) generic dashboards look for.
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            # The process-wide gauge of the internal token secrets held (aiworks.security.keyring), which a
            # rotation is checked against on every process's /metrics.
            self.registry.register(m.INTERNAL_TOKEN_KEYS)
            self.registry.register(m.TLS_CERT_EXPIRY)  # the certificate it presents (aiworks.security.cert_watch)
        self.health = Gauge(
            m.MONITOR_HEALTH_SCORE, "Health score of a runtime replica, 0 (dead) to 100.", ["replica"],
            registry=self.registry,
        )  # fmt: skip
        self.actions = Counter(
            m.MONITOR_ACTIONS.removesuffix("_total"),
            "Actions the monitor took, by action (restart, scale_out, scale_in, eject) and reason.",
            ["action", "reason"],
            registry=self.registry,
        )
        self.anomalies = Counter(
            m.MONITOR_ANOMALIES.removesuffix("_total"),
            "Anomalies detected against a replica's learned baseline, by kind.",
            ["kind", "replica"],
            registry=self.registry,
        )
        self.replicas = Gauge(
            m.MONITOR_REPLICAS, "Runtime replicas over all pools: desired and running.", ["state"],
            registry=self.registry,
        )  # fmt: skip
        # The event-loop lag every service reports (aiworks.core.looplag) lives in the default registry.
        for shared in (m.EVENT_LOOP_LAG, m.EVENT_LOOP_LAG_MAX, m.EVENT_LOOP_STALL_MAX):
            self.registry.register(shared)
        self._scored: set[str] = set()

    def set_health(self, scores: dict[str, float]) -> None:
        for gone in self._scored - scores.keys():
            self.health.remove(gone)
        for replica, score in scores.items():
            self.health.labels(replica).set(score)
        self._scored = set(scores)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
