"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService``.

Messages and stubs come from tritonclient, so the wire format is exactly what
Triton clients speak. Each method translates and delegates to the gateway's
data plane; errors map through the one table via :func:`handle_errors`.
"""

from __future__ import annotations

from aiworks.gateway.converters import from_infer_response, to_infer_request
from aiworks.gateway.dataplane import GatewayDataPlane
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from aiworks.core.rpc import handle_errors
from aiworks.core.tracing import carrier_from_metadata


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The OIP gRPC front end of the gateway."""

    def __init__(self, dataplane: GatewayDataPlane):
        self.dataplane = dataplane

    @handle_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=await self.dataplane.live())

    @handle_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self.dataplane.ready())

    @handle_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=await self.dataplane.model_ready(request.name, request.version))

    @handle_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.dataplane.server_metadata())

    @handle_errors
    async def ModelMetadata(self, request, context):
        meta = await self.dataplane.model_metadata(request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    @handle_errors
    async def ModelConfig(self, request, context):
        config = await self.dataplane.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    @handle_errors
    async def ModelInfer(self, request, context):
        carrier = carrier_from_metadata(context.invocation_metadata())
        with self.dataplane.telemetry.infer("grpc", request.model_name, request.model_version, carrier) as call:
            call.request = to_infer_request(request)
            call.response = await self.dataplane.infer(call.request)
            return from_infer_response(call.response)

    @handle_errors
    async def ModelStatistics(self, request, context):
        stats = await self.dataplane.statistics(request.name, request.version)
        for s in stats:
            s.pop("replicas", None)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    @handle_errors
    async def RepositoryIndex(self, request, context):
        models = await self.dataplane.repository_index(request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    @handle_errors
    async def RepositoryModelLoad(self, request, context):
        await self.dataplane.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @handle_errors
    async def RepositoryModelUnload(self, request, context):
        await self.dataplane.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()
