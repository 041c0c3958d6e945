"""gRPC transport of the scheduler: translate messages and delegate to :class:`Scheduler`."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiworks.core.converters import from_model_spec, from_statistics, to_model_spec
from aiworks.core.errors import AIWorksError
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.rpc import handle_errors
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.scheduler.converters import (
    gpus_from_pb,
    kv_from_pb,
    report_from_pb,
    shadow_from_pb,
    status_to_pb,
    table_to_pb,
    traffic_to_pb,
)
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.traffic_state import TrafficPolicy
from aiworks.security.callers import ANY_CALLER, current_caller

# Who may call each method (docs/security.md), checked once per call or stream by CallerCheck.
_LIFECYCLE = {"gateway", "monitor", "admin"}  # admins (tenants with the admin role) act through the gateway too
_CONTROL = {"monitor", "admin"}
CALLERS_BY_METHOD = {
    "WatchRouting": {"gateway"},
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

log = logging.getLogger(__name__)


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

    async def WatchRouting(self, request_iterator, context):
        """The table now, then after every change (at most every 20 ms); the gateway's reports come back on it."""
        scheduler = self.scheduler
        gateway_ids: set[str] = set()

        async def read_reports() -> None:
            async for message in request_iterator:
                report = report_from_pb(message)
                gateway_ids.add(report.gateway_id)
                scheduler.report(report)

        reader = asyncio.get_running_loop().create_task(read_reports())
        try:
            await scheduler.warmed_up()  # just started: no empty table for a gateway failing over to us
            generation = -1
            while not context.done():
                table = scheduler.routing_table()
                generation = table.generation
                await context.write(table_to_pb(table))
                await asyncio.sleep(0.02)  # changes come in bursts (a load touches every replica): coalesce them
                waiter = asyncio.ensure_future(scheduler.changes(generation))
                done, _ = await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    waiter.cancel()
                    break
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            for gateway_id in gateway_ids:
                scheduler.forget_gateway(gateway_id)

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
        overrides = LoadOverrides(request.config_override, dict(request.files))
        specs = await self.scheduler.load(request.name, overrides)
        generation = self.scheduler.registry.generation
        return pb.LoadModelResponse(versions=[from_model_spec(s) for s in specs], generation=generation)

    @handle_errors
    async def UnloadModel(self, request, context):
        await self.scheduler.unload(request.name)
        return pb.UnloadModelResponse(generation=self.scheduler.registry.generation)

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
            gpus_from_pb(request.gpus),
        )
        return pb.RegisterReplicaResponse(heartbeat_interval_s=self.scheduler.settings.heartbeat_interval_s)

    @handle_errors
    async def Heartbeat(self, request, context):
        known = self.scheduler.registry.heartbeat(
            request.replica_id,
            [to_model_spec(s) for s in request.models],
            gpus_from_pb(request.gpus),
            inflight_batches=request.inflight_batches,
            queues=list(request.queues),
            kv=[kv_from_pb(k) for k in request.kv],
            kv_refresh_s=2 * self.scheduler.settings.heartbeat_interval_s,
            stopping=request.stopping,
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
            applied = await self.scheduler.store_traffic(policy, keep_shadow=not has_shadow)
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
