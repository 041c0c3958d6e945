"""gRPC transport of the runtime: translate messages and delegate to the data plane."""

from __future__ import annotations

import asyncio
import time

from aiworks.core.converters import (
    add_tensors,
    fill_parameters,
    from_model_spec,
    from_statistics,
    to_infer_request,
    to_options,
)
from aiworks.core.errors import AIWorksError, Unavailable
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.rpc import handle_errors
from aiworks.core.stream import error_fields, serve_stream
from aiworks.core.tracing import remote_scope
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.security.callers import ANY_CALLER

# Who may call each method (docs/security.md), checked once per call or stream by CallerCheck.
CALLERS_BY_METHOD = {
    "InferStream": {"gateway"},
    "LoadModel": {"scheduler", "admin"},
    "UnloadModel": {"scheduler", "admin"},
    **dict.fromkeys(("ListModels", "ModelMetadata", "Statistics"), ANY_CALLER),
}


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    """``aiworks.runtime.v1.RuntimeService``."""

    def __init__(self, dataplane: RuntimeDataPlane, replica_id: str):
        self.dataplane = dataplane
        self.replica_id = replica_id
        self.stopping = False  # set when the stop's drain ends: new requests are refused with UNAVAILABLE
        self.inflight = 0  # requests and generations being served now
        self._idle = asyncio.Event()
        self._idle.set()

    def _handle(self, message):
        """One request on the stream: one answer, or (a decoupled model's) an async iterator of answers."""
        if self.stopping:  # the gateway retries UNAVAILABLE on another replica
            raise Unavailable(f"replica {self.replica_id} is stopping")
        if self.dataplane.queues.decoupled(message.model, message.version):
            return self._stream(message)
        return self._infer(message)

    def _begin(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def held(self) -> tuple[int, int]:
        """What a stop's drain waits for: requests in flight, and the stateful sequences held here (the
        gateways still send a stopping replica the later requests of its sequences)."""
        return self.inflight, self.dataplane.queues.live_sequences()

    async def drain(self, timeout_s: float, cut_short: asyncio.Event, poll_s: float = 0.05) -> bool:
        """Wait until nothing is held (:meth:`held`), ``timeout_s`` passes, or ``cut_short`` is set; True when
        nothing is held. Requests are waited for by event; sequences, which end by a request or by idling
        out in their batcher, by a look every ``poll_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            inflight, sequences = self.held()
            if not inflight and not sequences:
                return True
            left = deadline - loop.time()
            if left <= 0 or cut_short.is_set():
                return False
            waits = [asyncio.ensure_future(cut_short.wait())]
            if not sequences:
                waits.append(asyncio.ensure_future(self._idle.wait()))
            try:
                await asyncio.wait(waits, timeout=min(left, poll_s) if sequences else left,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                for wait in waits:
                    wait.cancel()

    async def _stream(self, message):
        options = to_options(message.options, time.monotonic())
        self._begin()  # counted from its first step (serve_stream starts it at once) until it is closed
        try:
            with remote_scope(message.options.trace_context):
                async for answer in self.dataplane.queues.infer_stream(to_infer_request(message), options):
                    reply = pb.InferResponse(
                        compute_us=answer.compute_ns // 1000,
                        queue_us=answer.queue_ns // 1000,
                        more=not answer.final,
                    )
                    add_tensors(reply.outputs, answer.outputs)
                    if answer.parameters:
                        fill_parameters(reply.parameters, answer.parameters)
                    yield reply
        finally:
            self._end()

    async def _infer(self, message) -> pb.InferResponse:
        options = to_options(message.options, time.monotonic())
        self._begin()
        try:
            # The gateway's span is the parent of this request's spans here (its queue wait, its batch).
            with remote_scope(message.options.trace_context):
                try:
                    answer = await self.dataplane.queues.infer(to_infer_request(message), options)
                except AIWorksError as exc:
                    code, text = error_fields(exc)
                    return pb.InferResponse(
                        error_code=code, error_message=text, retry_after_s=exc.retry_after_s or 0.0,
                        compute_us=getattr(exc, "compute_ns", 0) // 1000,
                        queue_us=getattr(exc, "queue_ns", 0) // 1000,
                    )  # fmt: skip
            reply = pb.InferResponse(compute_us=answer.compute_ns // 1000, queue_us=answer.queue_ns // 1000)
            add_tensors(reply.outputs, answer.outputs)  # each output's bytes copied once
            if answer.parameters:
                fill_parameters(reply.parameters, answer.parameters)
            return reply
        finally:
            self._end()

    async def InferStream(self, request_iterator, context):
        await serve_stream(
            request_iterator,
            context,
            self._handle,
            lambda code, message: pb.InferResponse(error_code=code, error_message=message),
            pb.InferResponseFrame,
        )

    @handle_errors
    async def LoadModel(self, request, context):
        overrides = LoadOverrides(request.config_override, dict(request.files))
        specs = await self.dataplane.load(request.name, overrides=overrides)
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
