"""The runtime's public face: a client for one replica's RuntimeService; pb2 stays inside this module.

Gateways send requests with :meth:`RuntimeClient.infer` (multiplexed on one
long-lived ``InferStream`` per replica); the scheduler loads, unloads and
lists models and reads statistics. Failures become :class:`AIWorksError`
with the replica's status; a failure that cost compute carries it as
``compute_ns``, so it can be charged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from aiworks.core.converters import from_infer_request, to_model_spec, to_statistics, to_tensor
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, from_rpc_error
from aiworks.core.inference import InferRequest, ModelStatistics
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import RequestOptions
from aiworks.core.rpc import client_channel
from aiworks.core.stream import MultiplexedStream
from aiworks.core.tracing import inject
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.security.tls import TLSFiles

# How much longer than a request's own deadline the stream waits: the replica answers a
# request whose deadline passed in its queue itself, and one that ran, when its batch ends.
_BACKSTOP_S = 1.0


@dataclass(slots=True)
class Answer:
    """A replica's answer: the outputs, this request's share of its batch's compute, and its queue wait."""

    outputs: list[Tensor]
    compute_ns: int = 0
    queue_ns: int = 0


def answer_of(reply) -> Answer:
    return Answer([to_tensor(t) for t in reply.outputs], reply.compute_us * 1000, reply.queue_us * 1000)


class RuntimeClient:
    """Calls one replica's RuntimeService."""

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, tls: TLSFiles | None = None):
        self.address = address
        self._channel = client_channel(address, max_message_bytes, tls, server_name="runtime")
        self._stub = runtime_pb2_grpc.RuntimeServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._requests = MultiplexedStream(
            self._stub.InferStream, f"runtime {address}", pb.InferRequestFrame, max_message_bytes
        )

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"runtime {self.address}") from None

    async def infer(
        self, request: InferRequest, options: RequestOptions, *,
        on_late: Callable[[Answer | AIWorksError], None] | None = None,
    ) -> Answer:  # fmt: skip
        """One request, its version resolved. ``on_late``: called with the answer if this call gives up first.

        The wait ends at the request's deadline (plus a backstop) or after the
        client's own timeout when it has none; a call abandoned that way, or
        cancelled, still learns how the work ended through ``on_late``, so its
        cost can be charged.
        """
        message = from_infer_request(request, options)
        inject(message.options.trace_context)  # the gateway's span (or the client's context) is the parent
        left = options.remaining_s()
        wait_s = self._timeout_s if left is None else max(0.0, left) + _BACKSTOP_S
        late = None if on_late is None else (lambda outcome: on_late(_outcome(outcome)))
        return answer_of(await self._requests.call(message, wait_s, on_late=late))

    async def load(self, name: str) -> list[ModelSpec]:
        reply = await self._call(self._stub.LoadModel, pb.LoadModelRequest(name=name), 120)
        return [to_model_spec(s) for s in reply.versions]

    async def unload(self, name: str, timeout_s: float | None = None) -> None:
        await self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name), timeout_s)

    async def index(self, ready_only: bool) -> list[ModelSpec]:
        reply = await self._call(self._stub.ListModels, pb.ListModelsRequest(ready_only=ready_only))
        return [to_model_spec(s) for s in reply.models]

    async def statistics(self, name: str, version: str) -> list[ModelStatistics]:
        reply = await self._call(self._stub.Statistics, pb.StatisticsRequest(name=name, version=version))
        return [to_statistics(s) for s in reply.models]

    @property
    def stream(self) -> MultiplexedStream:
        """The request stream (its frame counts, for tests and benchmarks)."""
        return self._requests

    async def close(self) -> None:
        await self._requests.close()
        await self._channel.close()


def _outcome(outcome) -> Answer | AIWorksError:
    return outcome if isinstance(outcome, AIWorksError) else answer_of(outcome)
