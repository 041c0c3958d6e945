"""``aiworks.scheduler.v1`` messages <-> the scheduler's domain values (the server and its client share them)."""

from __future__ import annotations

from aiworks.core.converters import from_model_spec, to_model_spec
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.scheduler.policy import RoutingPolicy
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.shadow import ShadowView
from aiworks.scheduler.traffic_state import DEFAULT_TOLERANCE, ShadowPolicy, TrafficPolicy
from aiworks.scheduler.views import (
    DrainingVersion,
    EjectionOrder,
    GatewayView,
    KvRoom,
    QueueView,
    ReplicaView,
    RouteReplica,
    RoutingReport,
    RoutingTable,
    StatusView,
)

# ---- traffic policies ------------------------------------------------------------------------


def shadow_from_pb(message: pb.ShadowPolicy) -> ShadowPolicy | None:
    """A shadow with an empty version is "no shadow"; 0 fraction and tolerance mean their defaults."""
    if not message.version:
        return None
    return ShadowPolicy(
        message.version,
        fraction=message.fraction or 1.0,
        compare=message.compare or "allclose",
        tolerance=message.tolerance or DEFAULT_TOLERANCE,
    )


def traffic_to_pb(policy: TrafficPolicy) -> pb.TrafficPolicy:
    message = pb.TrafficPolicy(model=policy.model, weights=dict(policy.weights))
    if policy.shadow is not None:
        s = policy.shadow
        message.shadow.CopyFrom(
            pb.ShadowPolicy(version=s.version, fraction=s.fraction, compare=s.compare, tolerance=s.tolerance)
        )
    return message


def traffic_from_pb(message: pb.TrafficPolicy) -> TrafficPolicy:
    shadow = shadow_from_pb(message.shadow) if message.HasField("shadow") else None
    return TrafficPolicy(message.model, dict(message.weights), shadow)


# ---- status ----------------------------------------------------------------------------------


def _budget_to_pb(budget: RetryBudget) -> pb.RetryBudgetStatus:
    return pb.RetryBudgetStatus(
        active=budget.active, active_retries=budget.active_retries, allowed=budget.allowed, denied=budget.denied
    )


def _budget_from_pb(message: pb.RetryBudgetStatus) -> RetryBudget:
    return RetryBudget(active=message.active, active_retries=message.active_retries, allowed=message.allowed,
                       denied=message.denied)  # fmt: skip


def gpus_from_pb(messages) -> list[dict]:
    """GpuInfo messages as plain dicts (the registry keeps no pb objects)."""
    return [{f.name: getattr(g, f.name) for f in pb.GpuInfo.DESCRIPTOR.fields} for g in messages]


def _replica_to_pb(view: ReplicaView) -> pb.ReplicaStatus:
    values = vars(view)
    return pb.ReplicaStatus(**{**values, "gpus": [pb.GpuInfo(**g) for g in values["gpus"]],
                               "kv": [kv_to_pb(k) for k in values["kv"]]})  # fmt: skip


def _replica_from_pb(message: pb.ReplicaStatus) -> ReplicaView:
    return ReplicaView(**{**_fields(message, ReplicaView), "models": list(message.models), "labels": dict(message.labels),
                          "gpus": gpus_from_pb(message.gpus), "kv": [kv_from_pb(k) for k in message.kv]})  # fmt: skip


def status_to_pb(view: StatusView) -> pb.StatusResponse:
    return pb.StatusResponse(
        replicas=[_replica_to_pb(r) for r in view.replicas],
        queues=[pb.QueueStatus(**vars(q)) for q in view.queues],
        traffic=[traffic_to_pb(p) for p in view.traffic],
        retry_budget=_budget_to_pb(view.retry_budget),
        shadows=[pb.ShadowStatus(**vars(s)) for s in view.shadows],
        gateways=[pb.GatewayStatus(**vars(g)) for g in view.gateways],
    )


def _fields(message, cls):
    return {name: getattr(message, name) for name in cls.__dataclass_fields__}


def status_from_pb(message: pb.StatusResponse) -> StatusView:
    return StatusView(
        replicas=[_replica_from_pb(r) for r in message.replicas],
        queues=[QueueView(**_fields(q, QueueView)) for q in message.queues],
        traffic=[traffic_from_pb(p) for p in message.traffic],
        retry_budget=_budget_from_pb(message.retry_budget),
        shadows=[ShadowView(**_fields(s, ShadowView)) for s in message.shadows],
        gateways=[GatewayView(**_fields(g, GatewayView)) for g in message.gateways],
    )


# ---- the routing table and the gateways' reports ---------------------------------------------


def policy_to_pb(policy: RoutingPolicy) -> pb.RoutingPolicy:
    return pb.RoutingPolicy(**vars(policy))


def policy_from_pb(message: pb.RoutingPolicy) -> RoutingPolicy:
    values = _fields(message, RoutingPolicy)
    values["class_pools"] = dict(message.class_pools)
    return RoutingPolicy(**values)


def kv_to_pb(room: KvRoom) -> pb.KvStatus:
    return pb.KvStatus(**vars(room))


def kv_from_pb(message: pb.KvStatus) -> KvRoom:
    return KvRoom(**{**_fields(message, KvRoom), "waiting_by_class": tuple(message.waiting_by_class)})


def table_to_pb(table: RoutingTable) -> pb.RoutingTable:
    return pb.RoutingTable(
        generation=table.generation,
        replicas=[
            pb.RouteReplica(replica_id=r.replica_id, address=r.address, device=r.device, labels=r.labels,
                            models=[from_model_spec(s) for s in r.models], kv=[kv_to_pb(k) for k in r.kv],
                            kv_age_s=r.kv_age_s, stopping=r.stopping)  # fmt: skip
            for r in table.replicas
        ],
        traffic=[traffic_to_pb(p) for p in table.traffic],
        draining=[
            pb.DrainingVersion(model=d.model, version=d.version, closing=d.closing, retiring_on=d.retiring_on,
                               spec=from_model_spec(d.spec) if d.spec is not None else None)  # fmt: skip
            for d in table.draining
        ],
        ejections=[pb.Ejection(replica_id=e.replica_id, remaining_s=e.remaining_s, reason=e.reason, id=e.id)
                   for e in table.ejections],  # fmt: skip
        known=[pb.ModelRef(name=m, version=v) for m, v in table.known],
        policy=policy_to_pb(table.policy),
    )


def table_from_pb(message: pb.RoutingTable) -> RoutingTable:
    return RoutingTable(
        generation=message.generation,
        replicas=[
            RouteReplica(r.replica_id, r.address, r.device, dict(r.labels), tuple(to_model_spec(s) for s in r.models),
                         tuple(kv_from_pb(k) for k in r.kv), r.kv_age_s, r.stopping)  # fmt: skip
            for r in message.replicas
        ],
        traffic=[traffic_from_pb(p) for p in message.traffic],
        draining=[
            DrainingVersion(d.model, d.version, d.closing, tuple(d.retiring_on),
                            to_model_spec(d.spec) if d.HasField("spec") else None)  # fmt: skip
            for d in message.draining
        ],
        ejections=[EjectionOrder(e.replica_id, e.remaining_s, e.reason, e.id) for e in message.ejections],
        known=[(k.name, k.version) for k in message.known],
        policy=policy_from_pb(message.policy),
    )


def report_to_pb(report: RoutingReport) -> pb.RoutingReport:
    return pb.RoutingReport(
        gateway_id=report.gateway_id,
        replicas=[_replica_to_pb(r) for r in report.replicas],
        retry_budget=_budget_to_pb(report.retry_budget),
        shadows=[pb.ShadowStatus(**vars(s)) for s in report.shadows],
        retries=[pb.QueueStatus(model=m, version=v, retries=n) for (m, v), n in report.retries.items()],
        requests=report.requests,
    )


def report_from_pb(message: pb.RoutingReport) -> RoutingReport:
    return RoutingReport(
        gateway_id=message.gateway_id,
        replicas=[_replica_from_pb(r) for r in message.replicas],
        retry_budget=_budget_from_pb(message.retry_budget),
        shadows=[ShadowView(**_fields(s, ShadowView)) for s in message.shadows],
        retries={(q.model, q.version): q.retries for q in message.retries},
        requests=message.requests,
    )
