"""The scheduler's settings (env prefix ``AIWORKS_SCHEDULER_``).

The routing settings (retries, outlier ejection, class pools, shadows,
pipelines) are sent to every gateway in the routing table, which applies
them (:class:`aiworks.scheduler.policy.RoutingPolicy`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings

PRIORITY_NAMES = ("realtime", "standard", "batch")


class SchedulerSettings(ServiceSettings):
    """Settings of the scheduler."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_SCHEDULER_")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(8010, description="gRPC port of the SchedulerService.")
    metrics_port: int = Field(8011, description="Port of the Prometheus /metrics endpoint; 0 picks a free one.")
    heartbeat_interval_s: float = Field(1.0, description="Interval replicas are told to heartbeat at.")
    heartbeat_timeout_s: float = Field(3.5, description="A replica silent this long is removed.")
    startup_grace_s: float = Field(
        3.0,
        ge=0,
        description=(
            "After start, gateways get no routing table until a runtime registered and the running ones had "
            "time to register again (two heartbeat intervals and a reconnect backoff), or until this long "
            "passed, so a restarted scheduler never hands them an empty or partial one."
        ),
    )
    max_retries: int = Field(
        2, description="Times a gateway re-sends a request to another replica after a transport failure."
    )
    runtime_timeout_s: float = Field(
        30.0, description="Per-try timeout of one request on a runtime; expiry counts as the replica's failure."
    )

    # ---- QoS (queues, aging and admission are the runtimes' settings: the queues live there) ----
    default_priority: str = Field(
        "standard", description="Class of requests that name none and whose tenant has no default."
    )

    # ---- resilience: retry budget and outlier ejection (Envoy/Istio semantics) ----
    retry_budget_percent: float = Field(
        20.0, description="Concurrent retries allowed, as a percentage of requests in flight (Envoy retry budget)."
    )
    retry_min_concurrency: int = Field(3, description="Concurrent retries always allowed, whatever the percentage.")
    outlier_consecutive_errors: int = Field(
        5, description="Consecutive 5xx-like failures that eject a replica (Istio consecutive5xxErrors); 0: off."
    )
    outlier_base_ejection_s: float = Field(
        30.0, description="Ejection time is this times the number of times the replica was ejected (baseEjectionTime)."
    )
    outlier_max_ejection_s: float = Field(300.0, description="Longest one ejection may last (Envoy max_ejection_time).")
    outlier_max_ejection_percent: float = Field(
        10.0, description="Most replicas ejected at once, in percent; one may always be ejected (maxEjectionPercent)."
    )

    # ---- routing ----
    latency_ewma_alpha: float = Field(
        0.3, description="Weight of the newest request in a replica's latency average (gateways route by it)."
    )
    class_pools: dict[str, str] = Field(
        default_factory=lambda: {"realtime": "device=gpu", "batch": "device=cpu"},
        description=(
            "Preferred replicas per class as comma-separated key=value terms (device=gpu, or a pool label); "
            "used whenever a live replica matches, otherwise any replica serves."
        ),
    )

    # ---- model lifecycle: hot update, shadow traffic, pipelines (docs/scheduler.md) ----
    drain_timeout_s: float = Field(
        30.0, description="Longest a retired model version's queued and running requests may take to finish."
    )
    shadow_max_inflight: int = Field(
        64, description="Copies outstanding per shadow version; more are dropped (and counted), never queued."
    )
    shadow_timeout_s: float = Field(10.0, description="Longest a shadow copy may take; later counts as an error.")
    pipeline_micro_batch_rows: int = Field(
        0,
        description=(
            "Rows per micro-batch of a pipeline request whose config sets no micro_batch_rows; "
            "0: a request flows through the stages whole."
        ),
    )

    # ---- durable traffic policies and high availability (docs/deployment.md) ----
    redis_url: str | None = Field(
        None,
        description=(
            "Redis holding the traffic policies (version weights, shadows) that every scheduler replica "
            "shares and reloads at start; unset: the state file, else memory only."
        ),
    )
    state_file: Path | None = Field(
        None, description="JSON file holding the traffic policies when there is no Redis (`aiworks up` sets one)."
    )
    traffic_poll_s: float = Field(
        0.5, gt=0, description="How often a scheduler checks Redis for policies another scheduler changed."
    )
    traffic_key_prefix: str = Field(
        "aiworks:scheduler:traffic:", description="Prefix of the Redis keys holding the traffic policies."
    )
    traffic_seed: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description=(
            "Version weights per model put in force at start for models with no stored policy, "
            'e.g. {"iris": {"1": 90, "2": 10}} (the chart sets it from the pools\' canary weights).'
        ),
    )

    # ---- audit (docs/security.md) ----
    audit_log: Path | None = Field(
        None, description="Append every traffic-policy change and ejection to this hash-chained audit log."
    )

    @field_validator("default_priority")
    @classmethod
    def _known_priority(cls, value: str) -> str:
        if value.lower() not in PRIORITY_NAMES:
            raise ValueError(f"must be one of {', '.join(PRIORITY_NAMES)}")
        return value.lower()

    @field_validator("class_pools")
    @classmethod
    def _known_classes(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = set(value) - set(PRIORITY_NAMES)
        if unknown:
            raise ValueError(f"unknown class(es) {sorted(unknown)}; use {', '.join(PRIORITY_NAMES)}")
        return value
