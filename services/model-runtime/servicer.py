"""gRPC transport of the runtime: translate messages and delegate to the data plane."""

from __future__ import annotations

from aiworks.runtime.dataplane import RuntimeDataPlane

from aiworks.core.converters import from_model_spec, from_statistics, from_tensor, to_tensor
from aiworks.core.rpc import handle_errors
from aiworks.core.stream import serve_stream
from aiworks.core.tracing import enabled as tracing_enabled
from aiworks.core.tracing import server_span
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.security.callers import ANY_CALLER


# Who may call each method (docs/security.md), checked once per call or stream by CallerCheck.
CALLERS_BY_METHOD = {
    "Execute": {"scheduler"},
    "ExecuteStream": {"scheduler"},
    "LoadModel": {"scheduler", "admin"},
    "UnloadModel": {"scheduler", "admin"},
    **dict.fromkeys(("ListModels", "ModelMetadata", "Statistics"), ANY_CALLER),
}


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    """``aiworks.runtime.v1.RuntimeService``."""

    def __init__(self, dataplane: RuntimeDataPlane, replica_id: str):
        self.dataplane = dataplane
        self.replica_id = replica_id

    async def _execute(self, request) -> pb.ExecuteResponse:
        # A child of the scheduler's batch span (its context rides in the message).
        with server_span("runtime execute", request.trace_context, self._span_attributes(request)) as span:
            outputs, compute_ns = await self.dataplane.execute(
                request.model, request.version, [to_tensor(t) for t in request.inputs], list(request.outputs)
            )
            span.set("aiworks.compute_ms", compute_ns / 1e6)
        return pb.ExecuteResponse(outputs=[from_tensor(t) for t in outputs], compute_ns=compute_ns)

    def _span_attributes(self, request) -> dict | None:
        if not tracing_enabled():
            return None
        return {"aiworks.model": request.model, "aiworks.version": request.version, "aiworks.replica": self.replica_id}

    @handle_errors
    async def Execute(self, request, context):
        return await self._execute(request)

    async def ExecuteStream(self, request_iterator, context):
        await serve_stream(
            request_iterator,
            context,
            self._execute,
            lambda code, message: pb.ExecuteResponse(error_code=code, error_message=message),
            pb.ExecuteResponseFrame,
        )

    @handle_errors
    async def LoadModel(self, request, context):
        specs = await self.dataplane.load(request.name)
        return pb.LoadModelResponse(versions=[from_model_spec(s) for s in specs])

    @handle_errors
    async def UnloadModel(self, request, context):
        await self.dataplane.unload(request.name)
        return pb.UnloadModelResponse()

    @handle_errors
    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[from_model_spec(s) for s in self.dataplane.index(request.ready_only)])

    @handle_errors
    async def ModelMetadata(self, request, context):
        return pb.ModelMetadataResponse(spec=from_model_spec(self.dataplane.metadata(request.name, request.version)))

    @handle_errors
    async def Statistics(self, request, context):
        models = [from_statistics(s) for s in self.dataplane.statistics(request.name, request.version)]
        return pb.StatisticsResponse(replica_id=self.replica_id, models=models)
