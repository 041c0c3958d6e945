"""The scheduler's client for one runtime replica; pb2 stays inside this module."""

from __future__ import annotations

import grpc

from aiworks.core.converters import from_tensor, to_model_spec, to_statistics, to_tensor
from aiworks.core.inference import ModelStatistics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import from_rpc_error
from aiworks.core.model_config import ModelSpec
from aiworks.core.rpc import client_channel
from aiworks.core.stream import MultiplexedStream
from aiworks.core.tracing import inject
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.security.tls import TLSFiles


_BACKSTOP_S = 1.0


class RuntimeClient:
    """Calls one replica's RuntimeService; failures become AIWorksError."""

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, tls: TLSFiles | None = None):
        self.address = address
        self._channel = client_channel(address, max_message_bytes, tls, server_name="runtime")
        self._stub = runtime_pb2_grpc.RuntimeServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._batches = MultiplexedStream(
            self._stub.ExecuteStream, f"runtime {address}", pb.ExecuteRequestFrame, max_message_bytes
        )

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"runtime {self.address}") from None

    async def execute(
        self, model: str, version: str, inputs: list[Tensor], outputs: list[str], timeout_s: float | None = None
    ) -> tuple[list[Tensor], int]:
        """Run one batch: its outputs and the runtime's compute time in ns.

        ``timeout_s`` (the time the batch is given) also travels to the runtime as ``timeout_us``.
        """
        request = pb.ExecuteRequest(
            model=model, version=version, inputs=[from_tensor(t) for t in inputs], outputs=outputs
        )
        if timeout_s is not None:
            request.timeout_us = max(1, int(timeout_s * 1e6))
        inject(request.trace_context)  # the batch's span is the parent of the runtime's
        # The caller bounds a try itself (by the per-try timeout, which may outlast timeout_s: a batch past
        # its deadline still runs to its end); the stream's own timeout is only a backstop.
        reply = await self._batches.call(request, max(timeout_s or 0.0, self._timeout_s) + _BACKSTOP_S)
        return [to_tensor(t) for t in reply.outputs], reply.compute_ns

    async def load(self, name: str) -> list[ModelSpec]:
        reply = await self._call(self._stub.LoadModel, pb.LoadModelRequest(name=name), 120)
        return [to_model_spec(s) for s in reply.versions]

    async def unload(self, name: str) -> None:
        await self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name))

    async def index(self, ready_only: bool) -> list[ModelSpec]:
        reply = await self._call(self._stub.ListModels, pb.ListModelsRequest(ready_only=ready_only))
        return [to_model_spec(s) for s in reply.models]

    async def statistics(self, name: str, version: str) -> list[ModelStatistics]:
        reply = await self._call(self._stub.Statistics, pb.StatisticsRequest(name=name, version=version))
        return [to_statistics(s) for s in reply.models]

    async def close(self) -> None:
        await self._batches.close()
        await self._channel.close()
