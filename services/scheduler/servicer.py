"""gRPC transport of the scheduler: translate messages and delegate to :class:`Scheduler`."""

from __future__ import annotations

from aiworks.core.converters import (
    from_infer_response,
    from_model_spec,
    from_statistics,
    to_infer_request,
    to_model_spec,
)
from aiworks.core.errors import AIWorksError
from aiworks.core.rpc import handle_errors
from aiworks.core.stream import error_fields, serve_stream
from aiworks.core.tracing import remote_scope
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.dispatch import Charge
from aiworks.scheduler.traffic_state import DEFAULT_TOLERANCE, ShadowPolicy, TrafficPolicy
from aiworks.scheduler.views import StatusView
from aiworks.security.callers import ANY_CALLER, current_caller


# Who may call each method (docs/security.md), checked once per call or stream by CallerCheck.
_DATA = {"gateway"}
_LIFECYCLE = {"gateway", "monitor", "admin"}  # admins (tenants with the admin role) act through the gateway too
_CONTROL = {"monitor", "admin"}
CALLERS_BY_METHOD = {
    "Infer": _DATA,
    "InferStream": _DATA,
    "LoadModel": _LIFECYCLE,
    "UnloadModel": _LIFECYCLE,
    "RegisterReplica": {"runtime"},
    "Heartbeat": {"runtime"},
    "SetTrafficPolicy": _CONTROL,
    "EjectReplica": _CONTROL,
    **dict.fromkeys(
        ("ServerReady", "ModelReady", "ModelMetadata", "RepositoryIndex", "ModelStatistics", "Status"), ANY_CALLER
    ),
    "GetTrafficPolicy": ANY_CALLER,
}


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """``aiworks.scheduler.v1.SchedulerService``."""

    def __init__(self, scheduler: Scheduler, audit=None, caller_auth: str = ""):
        self.scheduler = scheduler
        self.audit = audit  # aiworks.security.audit.AuditLog: admin actions, when configured
        self.caller_auth = caller_auth  # how callers are checked, for Status (aiworks status)

    def _audit(self, context, action: str, model: str | None, status: str, **details) -> None:
        """An admin line for ``action``; the actor is the checked caller's name, else its address."""
        if self.audit is None:
            return
        from aiworks.security.tls import peer_identity

        actor = current_caller() or peer_identity(context) or context.peer() or "unknown"
        self.audit.admin(actor=actor, action=action, status=status, model=model, details=details)

    async def _infer(self, request, timeout_s: float | None = None, charge: Charge | None = None) -> pb.InferResponse:
        if request.timeout_us:
            timeout_s = min(timeout_s or float("inf"), request.timeout_us / 1e6)
        # The gateway's span is the parent of this request's spans here (the queue wait, its batch).
        with remote_scope(request.trace_context):
            response = await self.scheduler.infer(
                to_infer_request(request), timeout_s=timeout_s, charge=charge if charge is not None else Charge()
            )
        return from_infer_response(response)

    @handle_errors
    async def Infer(self, request, context):
        return await self._infer(request, context.time_remaining())

    async def _infer_on_stream(self, request) -> pb.InferResponse:
        # Errors are answered here rather than by serve_stream so the Retry-After hint, and what the
        # runtime spent before the failure (compute_us), travel too.
        charge = Charge()
        try:
            return await self._infer(request, charge=charge)
        except AIWorksError as exc:
            code, message = error_fields(exc)
            return pb.InferResponse(
                error_code=code,
                error_message=message,
                retry_after_s=exc.retry_after_s or 0.0,
                compute_us=charge.compute_us,
            )

    async def InferStream(self, request_iterator, context):
        await serve_stream(
            request_iterator,
            context,
            self._infer_on_stream,
            lambda code, message: pb.InferResponse(error_code=code, error_message=message),
            pb.InferResponseFrame,
        )

    @handle_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.scheduler.ready())

    @handle_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.scheduler.model_ready(request.name, request.version))

    @handle_errors
    async def ModelMetadata(self, request, context):
        spec, versions = self.scheduler.metadata(request.name, request.version)
        return pb.ModelMetadataResponse(spec=from_model_spec(spec), versions=versions)

    @handle_errors
    async def RepositoryIndex(self, request, context):
        specs = await self.scheduler.index(request.ready_only)
        return pb.RepositoryIndexResponse(models=[from_model_spec(s) for s in specs])

    @handle_errors
    async def LoadModel(self, request, context):
        specs = await self.scheduler.load(request.name)
        return pb.LoadModelResponse(versions=[from_model_spec(s) for s in specs])

    @handle_errors
    async def UnloadModel(self, request, context):
        await self.scheduler.unload(request.name)
        return pb.UnloadModelResponse()

    @handle_errors
    async def ModelStatistics(self, request, context):
        per_replica = await self.scheduler.statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(
            replicas=[
                pb.ReplicaStatistics(replica_id=rid, models=[from_statistics(s) for s in stats])
                for rid, stats in per_replica
            ]
        )

    @handle_errors
    async def RegisterReplica(self, request, context):
        self.scheduler.registry.register(
            request.replica_id,
            request.address,
            request.device or "cpu",
            dict(request.labels),
            [to_model_spec(s) for s in request.models],
            _gpus(request.gpus),
        )
        return pb.RegisterReplicaResponse(heartbeat_interval_s=self.scheduler.settings.heartbeat_interval_s)

    @handle_errors
    async def Heartbeat(self, request, context):
        known = self.scheduler.registry.heartbeat(
            request.replica_id, [to_model_spec(s) for s in request.models], _gpus(request.gpus)
        )
        return pb.HeartbeatResponse(known=known)

    @handle_errors
    async def Status(self, request, context):
        reply = status_to_pb(self.scheduler.status())
        reply.caller_auth = self.caller_auth
        return reply

    @handle_errors
    async def SetTrafficPolicy(self, request, context):
        message = request.policy
        has_shadow = message.HasField("shadow")
        shadow = shadow_from_pb(message.shadow) if has_shadow else None
        policy = TrafficPolicy(message.model, dict(message.weights), shadow)
        try:
            applied = self.scheduler.set_traffic(policy, keep_shadow=not has_shadow)
        except AIWorksError as exc:
            self._audit(context, "traffic_policy", message.model, exc.status.name.lower(), error=exc.message)
            raise
        self._audit(
            context, "traffic_policy", message.model, "ok",
            weights=",".join(f"{v}={w:g}" for v, w in sorted(applied.weights.items())) or "latest",
            shadow=applied.shadow.version if applied.shadow else "",
        )  # fmt: skip
        return traffic_to_pb(applied)

    @handle_errors
    async def GetTrafficPolicy(self, request, context):
        return traffic_to_pb(self.scheduler.get_traffic(request.model))

    @handle_errors
    async def EjectReplica(self, request, context):
        result = self.scheduler.eject_replica(request.replica_id, request.duration_s, request.reason)
        self._audit(
            context, "eject_replica", None, "ok" if result.ejected else "refused",
            replica=request.replica_id, reason=request.reason[:200], ejected_for_s=round(result.ejected_for_s, 1),
        )  # fmt: skip
        return pb.EjectReplicaResponse(
            ejected=result.ejected, ejected_for_s=result.ejected_for_s, message=result.message
        )


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


def _gpus(messages) -> list[dict]:
    """GpuInfo messages as plain dicts (the registry keeps no pb objects)."""
    return [{f.name: getattr(g, f.name) for f in pb.GpuInfo.DESCRIPTOR.fields} for g in messages]


def status_to_pb(view: StatusView) -> pb.StatusResponse:
    budget = view.retry_budget
    return pb.StatusResponse(
        replicas=[pb.ReplicaStatus(**vars(r)) for r in view.replicas],
        queues=[pb.QueueStatus(**vars(q)) for q in view.queues],
        traffic=[traffic_to_pb(p) for p in view.traffic],
        retry_budget=pb.RetryBudgetStatus(
            active=budget.active, active_retries=budget.active_retries, allowed=budget.allowed, denied=budget.denied
        ),
        shadows=[pb.ShadowStatus(**vars(s)) for s in view.shadows],
    )
