"""The runtime's public face: a client for one replica's RuntimeService; pb2 stays inside this module.

Gateways send requests with :meth:`RuntimeClient.infer` (multiplexed on one
long-lived ``InferStream`` per replica), and those whose answers are many (a
decoupled model's) with :meth:`RuntimeClient.infer_stream`; the scheduler
loads, unloads and lists models and reads statistics. Failures become :class:`AIWorksError`
with the replica's status.

What a request cost goes into its :class:`Work`: the replica's compute time
(its share of each batch, failures included), and, when the caller stops
waiting first (the request's deadline, a per-try timeout, or cancellation),
the answer still to come, so the gateway can hold the tenant's slot and
charge once the work has really ended (docs/tenancy.md, "Compute quota").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from aiworks.core.converters import from_infer_request, to_model_spec, to_parameters, to_statistics, to_tensor
from aiworks.core.errors import DeadlineExceeded, from_rpc_error
from aiworks.core.inference import Answer, InferRequest, ModelStatistics
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import RequestOptions
from aiworks.core.rpc import client_channel
from aiworks.core.stream import MultiplexedStream, reply_error
from aiworks.core.tracing import inject
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles


@dataclass(slots=True, eq=False)
class Work:
    """What one request cost on the replicas: compute seconds, and an answer still to come, if any."""

    compute_s: float = 0.0
    outstanding: asyncio.Future | None = None


def outstanding_compute_s(reply_future: asyncio.Future) -> float:
    """Compute seconds a reply waited for in the background reported (0 if it never came)."""
    if reply_future.cancelled() or reply_future.exception() is not None:
        return 0.0
    return reply_future.result().compute_us / 1e6


def _abandon(reply_future: asyncio.Future, work: Work | None) -> None:
    """The caller stops waiting: the reply still to come goes to ``work`` (or is dropped, with no one to settle)."""
    if work is None:
        reply_future.cancel()
    elif reply_future.done():  # it came in the same turn of the loop
        work.compute_s += outstanding_compute_s(reply_future)
    else:
        work.outstanding = reply_future


__all__ = ["Answer", "RuntimeClient", "Work", "outstanding_compute_s"]


def answer_of(reply) -> Answer:
    return Answer(
        [to_tensor(t) for t in reply.outputs],
        reply.compute_us * 1000,
        reply.queue_us * 1000,
        to_parameters(reply.parameters) if reply.parameters else {},
        not reply.more,
    )


class RuntimeClient:
    """Calls one replica's RuntimeService."""

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, tls: TLSFiles | None = None, *,
                 caller: ClientCaller | None = None):  # fmt: skip
        """``caller``: who this client calls as over plaintext (default: this process's own caller)."""
        self.address = address
        self._channel = client_channel(address, max_message_bytes, tls, server_name="runtime", caller=caller)
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

    async def infer(self, request: InferRequest, options: RequestOptions, work: Work | None = None) -> Answer:
        """One request, its version resolved; answered DEADLINE_EXCEEDED at the request's deadline.

        The replica answers every request in the end (a queued one at its
        deadline, a running one when its batch ends); the stream waits for that
        up to the client timeout. ``work`` gets the compute the replica
        reports, and the reply still to come when this call stops waiting first.
        """
        message = from_infer_request(request, options)
        inject(message.options.trace_context)  # the gateway's span (or the client's context) is the parent
        reply_future = self._requests.send(message, self._timeout_s)
        left = options.remaining_s()
        try:
            async with asyncio.timeout(max(0.0, left) if left is not None else None):
                reply = await asyncio.shield(reply_future)
        except TimeoutError:
            _abandon(reply_future, work)
            raise DeadlineExceeded("the request's deadline passed before its replica answered") from None
        except asyncio.CancelledError:  # the caller gave up: its own timeout, or its client went away
            _abandon(reply_future, work)
            raise
        if work is not None:
            work.compute_s += reply.compute_us / 1e6
        if reply.error_code:
            raise reply_error(reply)
        return answer_of(reply)

    async def infer_stream(
        self, request: InferRequest, options: RequestOptions, work: Work | None = None
    ) -> AsyncIterator[Answer]:
        """The answers to one request as they come (a decoupled model's 0..N, then a final one).

        Each answer must come within the client timeout of the one before, and
        the last by the request's deadline. Leaving the loop early (or being
        cancelled) cancels the request at the replica: a queued request leaves
        its queue, a generation stops at its next step. ``work`` gets the
        compute every answer reports.
        """
        message = from_infer_request(request, options)
        inject(message.options.trace_context)
        replies = self._requests.open(message, self._timeout_s)
        async with replies:
            while True:
                left = options.remaining_s()
                try:
                    # The timeout covers the wait for one reply only: never a yield (it would cancel the consumer).
                    async with asyncio.timeout(max(0.0, left) if left is not None else None):
                        reply = await anext(replies)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlineExceeded(
                        "the request's deadline passed before its replica finished answering"
                    ) from None
                if work is not None:
                    work.compute_s += reply.compute_us / 1e6
                yield answer_of(reply)

    async def load(self, name: str, overrides: LoadOverrides | None = None) -> list[ModelSpec]:
        request = pb.LoadModelRequest(name=name)
        if overrides:
            request.config_override = overrides.config
            request.files.update(overrides.files)
        reply = await self._call(self._stub.LoadModel, request, 120)
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

