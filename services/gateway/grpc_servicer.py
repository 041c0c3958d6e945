"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService``.

Messages and stubs come from tritonclient, so the wire format is exactly what
Triton clients speak. Each method translates and delegates to the gateway's
data plane; errors map through the one table via :func:`handle_errors`.
Credentials travel as metadata (``authorization: Bearer <key or JWT>`` or
``x-api-key``), which tritonclient sends with ``headers={...}``.
"""

from __future__ import annotations

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.rpc import handle_errors
from aiworks.core.settings import DEFAULT_MAX_MESSAGE_BYTES
from aiworks.core.tracing import carrier_from_metadata
from aiworks.gateway.converters import (
    from_infer_response,
    output_refs,
    to_infer_request_header,
    to_load_overrides,
)
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import check_body_size
from aiworks.gateway.grpc_stream import StreamInfer
from aiworks.gateway.shared_memory import store_outputs
from aiworks.gateway.telemetry import REQUEST_ID_HEADER
from aiworks.gateway.tenancy_layer import request_limit


def _request_id(metadata) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return value
    return ""


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The OIP gRPC front end of the gateway."""

    def __init__(self, dataplane: GatewayDataPlane, max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes
        self._stream = StreamInfer(dataplane, max_request_bytes)

    @handle_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=await self.dataplane.live())

    @handle_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self.dataplane.ready())

    @handle_errors
    async def ModelReady(self, request, context):
        ready = await self.dataplane.model_ready(request.name, request.version, context.invocation_metadata())
        return pb.ModelReadyResponse(ready=ready)

    @handle_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.dataplane.server_metadata())

    @handle_errors
    async def ModelMetadata(self, request, context):
        meta = await self.dataplane.model_metadata(request.name, request.version, context.invocation_metadata())
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
        config = await self.dataplane.model_config(request.name, request.version, context.invocation_metadata())
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    @handle_errors
    async def ModelInfer(self, request, context):
        metadata = context.invocation_metadata()
        carrier = carrier_from_metadata(metadata)
        with self.dataplane.telemetry.infer("grpc", request.model_name, request.model_version, carrier) as call:
            call.request_id = _request_id(metadata)
            principal = self.dataplane.authenticate(metadata)
            call.tenant = principal.tenant_id
            self.dataplane.authorize(principal, request.model_name, request.model_version)  # before any of the message is converted
            if principal.tenant.max_request_bytes:  # the server already bounds messages by the gateway's limit
                check_body_size(request.ByteSize(), request_limit(principal, self.max_request_bytes), call.tenant)
            registry, tenant = self.dataplane.shared_memory, principal.tenant_id
            call.request, pending = to_infer_request_header(
                request, self.dataplane.limits, shm=lambda ref, where: registry.view(tenant, ref, where)
            )
            refs = output_refs(request)
            placements = registry.placements(tenant, refs) if refs else None
            call.response = await self.dataplane.infer(
                call.request, principal, pending, request_id=call.request_id,
                transport_deadline_s=context.time_remaining(), api="ModelInfer RPC",
            )  # fmt: skip
            if placements:
                await store_outputs(call.response.outputs, placements)
            return from_infer_response(call.response, refs)

    async def ModelStreamInfer(self, request_iterator, context):
        """Bidirectional streaming inference, decoupled models included (grpc_stream.py)."""
        async for response in self._stream.serve(request_iterator, context):
            yield response

    # ---- system shared memory (docs/triton.md); CUDA shared memory is refused ----------------------

    @handle_errors
    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self.dataplane.shm_status(request.name, context.invocation_metadata())
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={r["name"]: status(**r) for r in regions})

    @handle_errors
    async def SystemSharedMemoryRegister(self, request, context):
        await self.dataplane.shm_register(
            request.name, request.key, request.offset, request.byte_size, context.invocation_metadata()
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @handle_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        await self.dataplane.shm_unregister(request.name, context.invocation_metadata())
        return pb.SystemSharedMemoryUnregisterResponse()

    @handle_errors
    async def CudaSharedMemoryStatus(self, request, context):
        self.dataplane.cuda_shm("status", request.name, context.invocation_metadata())
        return pb.CudaSharedMemoryStatusResponse()

    @handle_errors
    async def CudaSharedMemoryRegister(self, request, context):
        self.dataplane.cuda_shm("register", request.name, context.invocation_metadata())

    @handle_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        self.dataplane.cuda_shm("unregister", request.name, context.invocation_metadata())
        return pb.CudaSharedMemoryUnregisterResponse()

    @handle_errors
    async def ModelStatistics(self, request, context):
        stats = await self.dataplane.statistics(request.name, request.version, context.invocation_metadata())
        for s in stats:
            s.pop("replicas", None)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    @handle_errors
    async def RepositoryIndex(self, request, context):
        models = await self.dataplane.repository_index(request.ready, context.invocation_metadata())
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    @handle_errors
    async def RepositoryModelLoad(self, request, context):
        async def overrides() -> LoadOverrides:
            return to_load_overrides(request.parameters)

        await self.dataplane.load(request.model_name, context.invocation_metadata(), overrides)
        return pb.RepositoryModelLoadResponse()

    @handle_errors
    async def RepositoryModelUnload(self, request, context):
        await self.dataplane.unload(request.model_name, context.invocation_metadata())
        return pb.RepositoryModelUnloadResponse()

    @handle_errors
    async def TraceSetting(self, request, context):
        """Triton's trace settings: no settings reads them; a setting with no value clears it."""
        metadata = context.invocation_metadata()
        if request.settings:
            updates = {k: list(v.value) or None for k, v in request.settings.items()}
            settings = await self.dataplane.update_trace_settings(request.model_name, updates, metadata)
        else:
            settings = await self.dataplane.trace_settings(request.model_name, metadata)
        value = pb.TraceSettingResponse.SettingValue
        return pb.TraceSettingResponse(settings={k: value(value=v) for k, v in settings.items()})

    @handle_errors
    async def LogSettings(self, request, context):
        """Triton's log settings: no settings reads them; a setting with no value is left as it is."""
        metadata = context.invocation_metadata()
        if request.settings:
            updates = {}
            for key, setting in request.settings.items():
                which = setting.WhichOneof("parameter_choice")
                updates[key] = getattr(setting, which) if which else None
            settings = await self.dataplane.update_log_settings(updates, metadata)
        else:
            settings = await self.dataplane.log_settings(metadata)
        return pb.LogSettingsResponse(settings={k: _log_value(v) for k, v in settings.items()})


def _log_value(value) -> pb.LogSettingsResponse.SettingValue:
    setting = pb.LogSettingsResponse.SettingValue
    if isinstance(value, bool):
        return setting(bool_param=value)
    if isinstance(value, int):
        return setting(uint32_param=value)
    return setting(string_param=value)
