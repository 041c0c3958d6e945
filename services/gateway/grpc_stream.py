"""gRPC ``ModelStreamInfer``: many requests on one bidirectional stream, answered as Triton answers them.

What Triton's server does (src/grpc/stream_infer_handler.cc) and so this does:

- Requests on a stream are read one after another and run concurrently.
  Responses of models that are not decoupled leave **in the order their
  requests arrived**; a decoupled model's responses leave as they come.
  Each response carries the request's ``id``, model and version.
- A request that fails is answered with a ``ModelStreamInferResponse``
  whose ``error_message`` is set (and its ``infer_response`` names the
  request): the stream goes on.
- Every response carries the response parameter ``triton_final_response``:
  true on the last response of its request. A decoupled model's end may
  come without a response (the repeat model sends its final flag alone);
  that empty final response is sent only when the request asked for it
  with the ``triton_enable_empty_final_response`` parameter (tritonclient's
  ``enable_empty_final_response=True``), as in Triton.
- The client closing the stream, or cancelling it, cancels its requests
  still running, down to the runtime replica (a queued request leaves its
  queue, a decoupled model stops at its next step).

The credentials are read once, from the stream's metadata; each request is
authorized for its model. The requests of one sequence (a stateful model's
``sequence_id``) run one after another, in the order they came, so a
sequence's state sees them in that order; other requests do not wait for
them. At most :data:`MAX_INFLIGHT` requests of a stream run at once:
beyond that the stream is not read, which holds the client back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from tritonclient.grpc import service_pb2 as pb

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.core.inference import InferResponse
from aiworks.core.tracing import carrier_from_metadata
from aiworks.gateway.converters import from_infer_response, output_refs, to_infer_request_header
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import check_body_size
from aiworks.gateway.shared_memory import store_outputs
from aiworks.gateway.telemetry import REQUEST_ID_HEADER
from aiworks.gateway.tenancy_layer import request_limit
from aiworks.gateway.token_budget import TokenCount

log = logging.getLogger(__name__)

# Requests of one stream in progress at once; the stream is not read beyond.
MAX_INFLIGHT = 1024
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
_DONE = object()


def _request_id(metadata) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return value
    return ""


def _wants_empty_final(msg: pb.ModelInferRequest) -> bool:
    if EMPTY_FINAL not in msg.parameters:
        return False
    param = msg.parameters[EMPTY_FINAL]
    if param.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgument(f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param.")
    return param.bool_param


def _sequence_of(msg: pb.ModelInferRequest):
    if "sequence_id" not in msg.parameters:
        return None
    param = msg.parameters["sequence_id"]
    value = getattr(param, param.WhichOneof("parameter_choice") or "string_param")
    return (msg.model_name, value) if value not in (0, "") else None


def _answer(response: InferResponse, shm=None) -> pb.ModelStreamInferResponse:
    message = from_infer_response(response, shm)
    message.parameters[FINAL].bool_param = response.final
    return pb.ModelStreamInferResponse(infer_response=message)


def _failure(msg: pb.ModelInferRequest, exc: BaseException) -> pb.ModelStreamInferResponse:
    if isinstance(exc, AIWorksError):
        text = exc.message
    else:
        log.error("a streamed request failed", exc_info=exc)
        text = f"internal error: {type(exc).__name__}"
    reply = pb.ModelStreamInferResponse(error_message=text)
    reply.infer_response.id = msg.id
    reply.infer_response.model_name = msg.model_name
    reply.infer_response.model_version = msg.model_version
    reply.infer_response.parameters[FINAL].bool_param = True
    return reply


class StreamInfer:
    """``ModelStreamInfer`` over the gateway's data plane; see the module docstring."""

    def __init__(self, dataplane: GatewayDataPlane, max_request_bytes: int):
        self.dataplane = dataplane
        self.max_request_bytes = max_request_bytes

    async def serve(self, request_iterator, context):
        """The stream's responses (an async generator for the servicer to yield from)."""
        metadata = context.invocation_metadata()
        try:
            principal = self.dataplane.authenticate(metadata)
        except AIWorksError as exc:
            await context.abort(exc.status.grpc_code, exc.message)
        stream = _Stream(self, principal, metadata, context)
        reader = asyncio.get_running_loop().create_task(stream.read(request_iterator))
        try:
            while True:
                item = await stream.out.get()
                if item is _DONE:
                    break
                yield item
            await reader  # its errors (a broken stream) end the call
        finally:
            reader.cancel()
            stream.cancel()


class _Stream:
    """One ``ModelStreamInfer`` call: its requests in progress and the responses waiting to leave."""

    def __init__(self, owner: StreamInfer, principal, metadata, context):
        self.owner = owner
        self.dataplane = owner.dataplane
        self.principal = principal
        self.metadata = metadata
        self.carrier = carrier_from_metadata(metadata)
        self.request_id = _request_id(metadata)
        self.context = context
        self.out: asyncio.Queue = asyncio.Queue()
        self.order: deque[asyncio.Future] = deque()  # non-decoupled responses, in request order
        self.tasks: set[asyncio.Task] = set()
        self.last_of: dict[tuple, asyncio.Task] = {}  # the latest request of each sequence on this stream
        self.slots = asyncio.Semaphore(MAX_INFLIGHT)

    async def read(self, request_iterator) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for msg in request_iterator:
                await self.slots.acquire()
                decoupled = self._decoupled(msg)
                slot = None
                if not decoupled:
                    slot = loop.create_future()
                    self.order.append(slot)
                sequence = _sequence_of(msg)
                before = self.last_of.get(sequence) if sequence else None
                task = loop.create_task(self.one(msg, decoupled, slot, before))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                if sequence:
                    self.last_of[sequence] = task
                    task.add_done_callback(lambda t, k=sequence: self.last_of.get(k) is t and self.last_of.pop(k))
            while self.tasks:
                await asyncio.wait(list(self.tasks))
        finally:
            self.out.put_nowait(_DONE)

    def _decoupled(self, msg) -> bool:
        try:
            return self.dataplane.routing.spec(msg.model_name, msg.model_version).decoupled
        except AIWorksError:
            return False  # unknown: its error is answered in order

    def _flush(self) -> None:
        while self.order and self.order[0].done():
            self.out.put_nowait(self.order.popleft().result())

    async def one(self, msg, decoupled: bool, slot: asyncio.Future | None, before: asyncio.Task | None) -> None:
        reply = None
        try:
            if before is not None:  # the sequence's previous request first
                await asyncio.wait([before])
            reply = await self._run(msg, decoupled)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply = _failure(msg, exc)
        finally:
            self.slots.release()
            if slot is not None and not slot.done():
                slot.set_result(reply if reply is not None else _failure(msg, AIWorksError("the request was cancelled")))
                self._flush()
        if slot is None and reply is not None:
            self.out.put_nowait(reply)

    async def _run(self, msg, decoupled: bool) -> pb.ModelStreamInferResponse | None:
        """Run one request; a decoupled one's responses leave here, the one response of another is returned."""
        dataplane, principal = self.dataplane, self.principal
        with dataplane.telemetry.infer("grpc", msg.model_name, msg.model_version, self.carrier) as call:
            call.request_id = self.request_id
            call.tenant = principal.tenant_id
            tokens = TokenCount()
            if decoupled:
                call.generation(tokens)  # its audit line: tokens, finish reason, time to first token
            dataplane.authorize(principal, msg.model_name, msg.model_version)
            if principal.tenant.max_request_bytes:
                check_body_size(msg.ByteSize(), request_limit(principal, self.owner.max_request_bytes), call.tenant)
            empty_final = _wants_empty_final(msg)
            registry, tenant = dataplane.shared_memory, principal.tenant_id
            call.request, pending = to_infer_request_header(
                msg, dataplane.limits, shm=lambda ref, where: registry.view(tenant, ref, where)
            )
            refs = output_refs(msg)
            if refs and decoupled:
                raise InvalidArgument("outputs of a decoupled model cannot be placed in shared memory")
            placements = registry.placements(tenant, refs) if refs else None
            deadline_s = self.context.time_remaining()
            if not decoupled:
                call.response = await dataplane.infer(
                    call.request, principal, pending, request_id=call.request_id, transport_deadline_s=deadline_s
                )
                call.streamed(call.response)
                if placements:
                    await store_outputs(call.response.outputs, placements)
                return _answer(call.response, refs)
            responses = dataplane.infer_stream(
                call.request, principal, pending, request_id=call.request_id, transport_deadline_s=deadline_s,
                tokens=tokens,
            )  # fmt: skip
            async with contextlib.aclosing(responses) as answers:
                async for response in answers:
                    if response.final and not response.outputs and not empty_final:
                        call.response = response
                        continue  # the model's bare final flag: sent only when asked for
                    call.streamed(response)
                    self.out.put_nowait(_answer(response))
        return None

    def cancel(self) -> None:
        """The call ended (the client left, cancelled, or the server stops): stop what still runs."""
        for task in list(self.tasks):
            task.cancel()
        for slot in self.order:
            slot.cancel()
        self.order.clear()
