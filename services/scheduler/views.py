"""What the scheduler shows and sends, as plain values: the status (``aiworks status``) and the routing table."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiworks.core.model_config import ModelSpec
from aiworks.scheduler.policy import RoutingPolicy
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.shadow import ShadowView
from aiworks.scheduler.traffic_state import TrafficPolicy

Key = tuple[str, str]


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
    kv: list[KvRoom] = field(default_factory=list)  # generative versions' KV room, as of the last heartbeat
    kv_age_s: float = 0.0  # the age of those figures
    stopping: bool = False  # it said it is stopping (draining what it holds): not live


@dataclass
class QueueView:
    model: str
    version: str
    queued_requests: int = 0
    queued_rows: int = 0
    batches: int = 0
    rows: int = 0
    queued_realtime: int = 0
    queued_standard: int = 0
    queued_batch: int = 0
    queued_bytes: int = 0
    rejected: int = 0
    expired: int = 0
    retries: int = 0
    draining: bool = False


@dataclass
class GatewayView:
    gateway_id: str
    last_report_age_s: float
    requests: int = 0
    retries: int = 0


@dataclass
class StatusView:
    replicas: list[ReplicaView]
    queues: list[QueueView]
    traffic: list[TrafficPolicy]
    retry_budget: RetryBudget
    shadows: list[ShadowView] = field(default_factory=list)
    gateways: list[GatewayView] = field(default_factory=list)


# ---- the routing table -----------------------------------------------------------------------


@dataclass(frozen=True)
class KvRoom:
    """The KV-cache room of one generative model version on one replica (the proto's KvStatus)."""

    model: str
    version: str
    free_tokens: int
    budget_tokens: int
    waiting_sequences: int = 0
    waiting_by_class: tuple[int, ...] = ()  # the waiting ones by class: realtime, standard, batch (() : unknown)

    def waiting_ahead(self, rank: int) -> int:
        """The waiting sequences a new one of class ``rank`` would wait behind: its class and more urgent ones
        (all of them where the replica does not say by class)."""
        if not self.waiting_by_class:
            return self.waiting_sequences
        return sum(self.waiting_by_class[: rank + 1])


@dataclass(frozen=True)
class RouteReplica:
    replica_id: str
    address: str
    device: str
    labels: dict[str, str]
    models: tuple[ModelSpec, ...]
    # Generative versions' KV room from the replica's last heartbeat, and that heartbeat's age at build time.
    kv: tuple[KvRoom, ...] = ()
    kv_age_s: float = 0.0
    # Draining after its stop signal: only the later requests of the stateful sequences it holds go to it.
    stopping: bool = False


@dataclass(frozen=True)
class DrainingVersion:
    model: str
    version: str
    closing: bool
    retiring_on: tuple[str, ...] = ()
    spec: ModelSpec | None = None


@dataclass(frozen=True)
class EjectionOrder:
    """An ejection the scheduler was asked for; each gateway applies it once (by ``id``)."""

    replica_id: str
    remaining_s: float
    reason: str
    id: int


@dataclass
class RoutingTable:
    generation: int
    replicas: list[RouteReplica]
    traffic: list[TrafficPolicy]
    draining: list[DrainingVersion]
    ejections: list[EjectionOrder]
    known: list[Key]
    policy: RoutingPolicy


@dataclass
class RoutingReport:
    """A gateway's own routing state, sent to the scheduler every second."""

    gateway_id: str
    replicas: list[ReplicaView]
    retry_budget: RetryBudget
    shadows: list[ShadowView]
    retries: dict[Key, int]
    requests: int = 0
