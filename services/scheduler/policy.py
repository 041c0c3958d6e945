"""How gateways route: the scheduler's routing settings, handed to every gateway in the routing table.

An operator sets retries, outlier ejection, class pools and shadow bounds on
the scheduler (``AIWORKS_SCHEDULER_*``); each gateway applies them as it
routes, as Envoy applies the cluster settings its control plane sends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from aiworks.core.options import Priority
from aiworks.scheduler.replica_state import OutlierPolicy


@dataclass(frozen=True)
class RoutingPolicy:
    """The routing settings in force; defaults match :class:`~aiworks.scheduler.settings.SchedulerSettings`."""

    default_priority: str = "standard"
    max_retries: int = 2
    per_try_timeout_s: float = 30.0
    retry_budget_percent: float = 20.0
    retry_min_concurrency: int = 3
    outlier_consecutive_errors: int = 5
    outlier_base_ejection_s: float = 30.0
    outlier_max_ejection_s: float = 300.0
    outlier_max_ejection_percent: float = 10.0
    latency_ewma_alpha: float = 0.3
    class_pools: dict[str, str] = field(default_factory=lambda: {"realtime": "device=gpu", "batch": "device=cpu"})
    shadow_max_inflight: int = 64
    shadow_timeout_s: float = 10.0
    pipeline_micro_batch_rows: int = 0

    @classmethod
    def from_settings(cls, settings) -> RoutingPolicy:
        """The policy a :class:`SchedulerSettings` describes (field for field; runtime_timeout_s is the per-try timeout)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        values["per_try_timeout_s"] = settings.runtime_timeout_s
        return cls(**values)

    @property
    def priority(self) -> Priority:
        return Priority.named(self.default_priority)

    def outliers(self) -> OutlierPolicy:
        return OutlierPolicy(
            consecutive_errors=self.outlier_consecutive_errors,
            base_ejection_s=self.outlier_base_ejection_s,
            max_ejection_s=self.outlier_max_ejection_s,
            max_ejection_percent=self.outlier_max_ejection_percent,
        )
