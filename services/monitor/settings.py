"""The monitor's settings (env prefix ``AIWORKS_MONITOR_``).

Every threshold of the control loop lives here, so a deployment tunes the
monitor through its environment (``aiworks up`` passes the local ones, the
Helm chart and docker-compose the cluster ones) and the unit tests build the
same object with short times. docs/monitor.md explains each rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class MonitorSettings(ServiceSettings):
    """Settings of the monitor: where it looks, how it judges, when it acts."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_MONITOR_")

    host: str = Field("127.0.0.1", description="Interface the HTTP server (events API and /metrics) binds.")
    port: int = Field(8040, description="Port of the events API, /v1/replicas, /healthz and /metrics.")

    # ---- where it looks and acts ----
    platform: Literal["local", "kubernetes"] = Field(
        "local", description="local: the processes of `aiworks up`; kubernetes: the pods of a Helm release."
    )
    scheduler_address: str = Field(..., description="host:port of the scheduler, asked to eject replicas (required).")
    supervisor_url: str | None = Field(
        None, description="Control API of `aiworks up` (local platform); unset: observe only, no restarts or scaling."
    )
    static_services: list[str] = Field(
        default_factory=list,
        description=(
            "Services to watch when there is no supervisor and no Kubernetes API (docker-compose), as "
            "NAME=KIND@HOST:PORT terms, HOST:PORT being the /metrics endpoint; observe and eject only."
        ),
    )
    prometheus_url: str | None = Field(
        None, description="Prometheus to query instead of scraping every /metrics endpoint itself; unset: scrape."
    )
    namespace: str = Field("default", description="Kubernetes namespace of the release (kubernetes platform).")
    release: str = Field("aiworks", description="Helm release whose pods and Deployments are watched (kubernetes).")
    interval_s: float = Field(1.0, gt=0, description="Seconds between two rounds of the control loop.")
    scrape_timeout_s: float = Field(2.0, gt=0, description="Timeout of one /metrics scrape or Prometheus query.")

    # ---- events ----
    events_max: int = Field(1000, ge=1, description="Events kept in memory for the events API (oldest dropped).")
    events_file: Path | None = Field(None, description="JSON-lines file every event is appended to; unset: none.")

    # ---- restarts ----
    restart: bool = Field(True, description="Restart services that died.")
    restart_grace_s: float = Field(
        0.0, ge=0, description="How long a service must stay dead before it is restarted (0: at once)."
    )
    restart_max: int = Field(5, ge=1, description="Restarts of one service within restart_window_s before giving up.")
    restart_window_s: float = Field(300.0, gt=0, description="Window over which restart_max is counted.")

    # ---- autoscaling of runtime replicas ----
    autoscale: bool = Field(True, description="Scale runtime replicas on queue depth and p99 latency.")
    min_replicas: int = Field(1, ge=0, description="Fewest runtime replicas per pool the monitor scales in to.")
    max_replicas: int = Field(4, ge=1, description="Most runtime replicas per pool the monitor scales out to.")
    scale_out_queue_depth: float = Field(
        16.0, gt=0, description="Queued requests per running replica that count as overload."
    )
    scale_out_p99_s: float = Field(
        0.5, ge=0, description="Gateway p99 latency (s) that counts as overload; 0: latency is not a trigger."
    )
    scale_out_sustain_s: float = Field(5.0, ge=0, description="How long overload must last before scaling out.")
    scale_out_cooldown_s: float = Field(30.0, ge=0, description="Seconds after any scaling before the next scale-out.")
    scale_in_queue_depth: float = Field(
        1.0, ge=0, description="Queued requests per running replica at or below which the pool counts as quiet."
    )
    scale_in_sustain_s: float = Field(60.0, ge=0, description="How long the pool must be quiet before scaling in.")
    scale_in_cooldown_s: float = Field(60.0, ge=0, description="Seconds after any scaling before the next scale-in.")

    # ---- ejection through the scheduler ----
    eject: bool = Field(True, description="Ask the scheduler to eject replicas that keep failing.")
    eject_window_s: float = Field(10.0, gt=0, description="Window over which a replica's errors are counted.")
    eject_min_errors: int = Field(
        5, ge=1, description="Failed batches within the window before ejection is considered."
    )
    eject_error_ratio: float = Field(
        0.5, gt=0, le=1, description="Share of failed batches within the window that ejects a replica."
    )
    eject_duration_s: float = Field(30.0, gt=0, description="How long an ejected replica stays out of routing.")

    # ---- learned baselines and anomalies ----
    baseline_alpha: float = Field(0.1, gt=0, le=1, description="Weight of the newest sample in a learned baseline.")
    baseline_min_samples: int = Field(10, ge=1, description="Samples a baseline needs before it judges anything.")
    latency_spike_ratio: float = Field(
        3.0, gt=1, description="Latency this many times the replica's baseline is a latency spike."
    )
    latency_floor_s: float = Field(
        0.001, ge=0, description="Latencies below this are never a spike (timer noise on tiny models)."
    )
    error_surge_ratio: float = Field(
        0.2, gt=0, le=1, description="Error share this far above the replica's baseline share is an error surge."
    )
    error_min_requests: int = Field(10, ge=1, description="Batches in the window needed to judge an error surge.")
    memory_window_s: float = Field(300.0, gt=0, description="Window of resident memory samples judged for growth.")
    memory_growth_ratio: float = Field(
        0.2, gt=0, description="Steady growth of resident memory by this share of its size within the window."
    )
    saturation_batches: float = Field(
        4.0, gt=0, description="Batches in flight on a replica that count as fully saturated in its health score."
    )

    @field_validator("prometheus_url", "supervisor_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return value or None

    @field_validator("static_services")
    @classmethod
    def _static_terms(cls, value: list[str]) -> list[str]:
        from aiworks.monitor.discovery import from_static

        from_static(value)  # ValueError naming the bad term
        return value

    @model_validator(mode="after")
    def _bounds(self) -> MonitorSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self

    # ---- canary rollouts (docs/rollouts.md) ----
    rollout_steps: str = Field("5,20,50,100", description="Default canary percent per rollout step, rising, ending at 100.")
    rollout_dwell_s: float = Field(60.0, gt=0, description="Default time at each rollout step before it is judged.")
    rollout_max_error_rate_increase: float = Field(
        0.01, ge=0, le=1, description="Canary error rate above stable's (a fraction: 0.01 = 1 point) that rolls back."
    )
    rollout_max_p99_ratio: float = Field(1.5, ge=1, description="Canary p99 over stable p99 that rolls back.")
    rollout_min_requests: int = Field(50, ge=1, description="Canary requests a window needs before it is judged.")
    rollout_max_extensions: int = Field(3, ge=0, description="Dwell extensions while short of data; then it rolls back.")
    rollout_p99_floor_s: float = Field(0.005, ge=0, description="A canary p99 below this never counts as slow.")
    rollout_prometheus_min_range_s: float = Field(
        30.0, gt=0, description="Shortest increase() window asked of Prometheus (at least 2 scrape intervals)."
    )
    audit_log: Path | None = Field(
        None, description="Append every rollout step to this hash-chained audit log (aiworks audit verify)."
    )
