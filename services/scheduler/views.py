"""What the scheduler shows of itself (``aiworks status``), as plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.shadow import ShadowView
from aiworks.scheduler.traffic_state import TrafficPolicy


@dataclass
class ReplicaView:
    replica_id: str
    address: str
    device: str
    live: bool
    outstanding_batches: int
    outstanding_rows: int
    last_heartbeat_age_s: float
    models: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    ejected: bool = False
    ejected_for_s: float = 0.0
    times_ejected: int = 0
    consecutive_errors: int = 0
    ewma_latency_ms: float = 0.0
    batches_done: int = 0
    rows_done: int = 0
    gpus: list[dict] = field(default_factory=list)  # GpuInfo fields, as of the last heartbeat


@dataclass
class QueueView:
    model: str
    version: str
    queued_requests: int
    queued_rows: int
    batches: int
    rows: int
    queued_realtime: int = 0
    queued_standard: int = 0
    queued_batch: int = 0
    queued_bytes: int = 0
    rejected: int = 0
    expired: int = 0
    retries: int = 0
    draining: bool = False


@dataclass
class StatusView:
    replicas: list[ReplicaView]
    queues: list[QueueView]
    traffic: list[TrafficPolicy]
    retry_budget: RetryBudget
    shadows: list[ShadowView] = field(default_factory=list)
