"""The gateway's client for the scheduler; pb2 stays inside this module."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from aiworks.core.converters import from_infer_request, to_infer_response, to_model_spec, to_statistics
from aiworks.core.errors import DeadlineExceeded, from_rpc_error
from aiworks.core.inference import InferRequest, InferResponse, ModelStatistics
from aiworks.core.model_config import ModelSpec
from aiworks.core.rpc import client_channel
from aiworks.core.stream import MultiplexedStream, reply_error
from aiworks.core.tracing import inject
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.security.tls import TLSFiles

_DEADLINE_GRACE_S = 0.5
_MAX_TIMEOUT_US = 2**64 - 1


@dataclass(slots=True, eq=False)
class Work:
    """What one request's scheduler call cost: runtime seconds, and the answer still to come, if any.

    ``outstanding`` is the scheduler's reply a call gave up waiting for
    (its client's deadline passed, or it was cancelled); the caller settles
    the request when it resolves (:func:`outstanding_compute_s`).
    """

    compute_s: float = 0.0
    outstanding: asyncio.Future | None = None


def outstanding_compute_s(reply_future: asyncio.Future) -> float:
    """Runtime seconds the scheduler reported in a reply waited for in the background (0 if it never came)."""
    if reply_future.cancelled() or reply_future.exception() is not None:
        return 0.0
    return reply_future.result().compute_us / 1e6


def _abandon(reply_future: asyncio.Future, work: Work | None) -> None:
    """The caller stops waiting: the reply still to come goes to ``work`` (or is dropped, with no one to settle)."""
    if work is None:
        reply_future.cancel()
    elif reply_future.done():  # it came in the same turn of the loop as the deadline
        work.compute_s += outstanding_compute_s(reply_future)
    else:
        work.outstanding = reply_future


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

    async def infer(self, request: InferRequest, work: Work | None = None) -> InferResponse:
        """One inference; an OIP ``timeout`` parameter (microseconds) bounds the wait and travels as ``timeout_us``.

        On the multiplexed stream there is no per-message gRPC deadline, so
        the time left rides in the message. This side answers DEADLINE_EXCEEDED
        at that time itself: a request whose batch is running when it passes
        is answered by the scheduler only once the batch has ended, with what
        it cost. What the runtime spent (``compute_us``, failures included) is
        added to ``work``; when this call gives up before the scheduler answered
        (its deadline, or its caller was cancelled), the answer still to come
        is left in ``work.outstanding`` for the caller to settle later
        (docs/tenancy.md, "Compute quota").
        """
        message = from_infer_request(request)
        inject(message.trace_context)  # the gateway's span (or the client's context) is the parent
        timeout_us = _timeout_us(request.parameters.get("timeout"))
        if timeout_us:
            message.timeout_us = timeout_us
        # The scheduler always answers in the end (queued requests at their deadline, running ones when their
        # batch ends, within its per-try timeouts): the stream waits up to request_timeout_s for that.
        reply_future = self._requests.send(message, self._timeout_s + _DEADLINE_GRACE_S)
        try:
            async with asyncio.timeout(timeout_us / 1e6 if timeout_us else None):
                reply = await asyncio.shield(reply_future)
        except TimeoutError:
            _abandon(reply_future, work)
            raise DeadlineExceeded(f"the request's deadline of {timeout_us} us passed") from None
        except asyncio.CancelledError:
            _abandon(reply_future, work)
            raise
        compute_s = reply.compute_us / 1e6
        if work is not None:
            work.compute_s += compute_s
        if reply.error_code:
            raise reply_error(reply)
        return to_infer_response(reply)

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
