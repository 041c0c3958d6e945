"""The gateway's client for the scheduler; pb2 stays inside this module."""

from __future__ import annotations

import grpc

from aiworks.core.converters import from_infer_request, to_infer_response, to_model_spec, to_statistics
from aiworks.core.errors import from_rpc_error
from aiworks.core.inference import InferRequest, InferResponse, ModelStatistics
from aiworks.core.model_config import ModelSpec
from aiworks.core.rpc import client_channel
from aiworks.core.stream import MultiplexedStream
from aiworks.core.tracing import inject
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.security.tls import TLSFiles


_DEADLINE_GRACE_S = 0.5


_MAX_TIMEOUT_US = 2**64 - 1


def _timeout_us(value) -> int:
    """The OIP ``timeout`` parameter as whole microseconds; 0 when absent or not one (the scheduler says why)."""
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= _MAX_TIMEOUT_US:
        return 0  # NaN, infinities and values past uint64 included: the scheduler refuses them
    return int(value)


class SchedulerClient:
    """Calls the SchedulerService; failures become AIWorksError with the peer's status."""

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, tls: TLSFiles | None = None):
        self.address = address
        self._channel = client_channel(address, max_message_bytes, tls, server_name="scheduler")
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._requests = MultiplexedStream(
            self._stub.InferStream, f"scheduler {address}", pb.InferRequestFrame, max_message_bytes
        )

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"scheduler {self.address}") from None

    async def infer(self, request: InferRequest) -> InferResponse:
        """One inference; an OIP ``timeout`` parameter (microseconds) bounds the wait and travels as ``timeout_us``.

        On the multiplexed stream there is no per-message gRPC deadline, so
        the time left rides in the message; this side waits a little longer
        than that, so the scheduler's DEADLINE_EXCEEDED arrives first.
        """
        message = from_infer_request(request)
        inject(message.trace_context)  # the gateway's span (or the client's context) is the parent
        wait_s = self._timeout_s
        timeout_us = _timeout_us(request.parameters.get("timeout"))
        if timeout_us:
            message.timeout_us = timeout_us
            wait_s = min(wait_s, timeout_us / 1e6 + _DEADLINE_GRACE_S)
        return to_infer_response(await self._requests.call(message, wait_s))

    async def ready(self) -> bool:
        return (await self._call(self._stub.ServerReady, pb.ServerReadyRequest(), 2)).ready

    async def model_ready(self, name: str, version: str) -> bool:
        return (await self._call(self._stub.ModelReady, pb.ModelRef(name=name, version=version), 2)).ready

    async def metadata(self, name: str, version: str) -> tuple[ModelSpec, list[str]]:
        reply = await self._call(self._stub.ModelMetadata, pb.ModelRef(name=name, version=version), 5)
        return to_model_spec(reply.spec), list(reply.versions)

    async def index(self, ready_only: bool) -> list[ModelSpec]:
        reply = await self._call(self._stub.RepositoryIndex, pb.RepositoryIndexRequest(ready_only=ready_only), 10)
        return [to_model_spec(s) for s in reply.models]

    async def load(self, name: str) -> list[ModelSpec]:
        reply = await self._call(self._stub.LoadModel, pb.ModelRef(name=name), 180)
        return [to_model_spec(s) for s in reply.versions]

    async def unload(self, name: str) -> None:
        await self._call(self._stub.UnloadModel, pb.ModelRef(name=name), 60)

    async def statistics(self, name: str, version: str) -> list[tuple[str, list[ModelStatistics]]]:
        reply = await self._call(self._stub.ModelStatistics, pb.ModelRef(name=name, version=version), 10)
        return [(r.replica_id, [to_statistics(m) for m in r.models]) for r in reply.replicas]

    async def close(self) -> None:
        await self._requests.close()
        await self._channel.close()
