"""Many unary-like calls multiplexed on one long-lived bidirectional gRPC stream.

On these machines a unary gRPC call between two Python processes costs about
a millisecond of set-up, and twice that when the callee forwards it; a message
on an already open stream costs a fraction of it. The hot paths
(gateway → scheduler ``InferStream``, scheduler → runtime ``ExecuteStream``)
therefore keep one stream per peer and tag each message with a ``stream_id``;
answers come back in any order and carry either the result or an error as a
gRPC status code and message, which map through the one error table.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc

from aiworks.core.errors import AIWorksError, DeadlineExceeded, Status, Unavailable, from_grpc_code, from_rpc_error

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def error_fields(exc: BaseException) -> tuple[int, str]:
    """(gRPC status code number, message) for an error answered on a stream."""
    if isinstance(exc, AIWorksError):
        return exc.status.grpc_code.value[0], exc.message
    return Status.INTERNAL.grpc_code.value[0], f"internal error: {type(exc).__name__}: {exc}"


class MultiplexedStream:
    """Client side: ``await call(message, timeout_s)`` sends one message and waits for its answer.

    The stream opens on first use and again after it breaks; a broken stream
    fails every call waiting on it with UNAVAILABLE, which the scheduler
    treats as "try another replica".
    """

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], peer: str):
        self._open_call = open_call
        self.peer = peer
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()

    def _ensure_open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self._open_call()
            # Not in the context of the call that happened to open the stream (its trace, for one).
            self._reader = asyncio.get_running_loop().create_task(
                self._read(self._call), context=contextvars.Context()
            )
        return self._call

    async def call(self, message, timeout_s: float):
        stream_id = next(self._ids)
        message.stream_id = stream_id
        future = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        try:
            async with asyncio.timeout(timeout_s):
                call = self._ensure_open()
                async with self._write_lock:
                    await call.write(message)
                reply = await future
        except TimeoutError:
            raise DeadlineExceeded(f"{self.peer} did not answer within {timeout_s:g} s") from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._broken(self._call)
            if isinstance(exc, grpc.aio.AioRpcError):
                raise from_rpc_error(exc, self.peer) from None
            raise Unavailable(f"stream to {self.peer} is closed") from None
        finally:
            self._pending.pop(stream_id, None)
        if reply.error_code:
            error = from_grpc_code(_CODES.get(reply.error_code, grpc.StatusCode.UNKNOWN), reply.error_message)
            # A reply type with a retry_after_s field (the scheduler's) carries the Retry-After hint.
            error.retry_after_s = getattr(reply, "retry_after_s", 0.0) or None
            raise error
        return reply

    async def _read(self, call) -> None:
        error: AIWorksError = Unavailable(f"{self.peer} closed the stream")
        try:
            async for reply in call:
                future = self._pending.get(reply.stream_id)
                if future is not None and not future.done():
                    future.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, self.peer)
            if error.status is not Status.UNAVAILABLE:
                error = Unavailable(f"stream to {self.peer} failed: {error.message}")
        except asyncio.CancelledError:
            error = Unavailable(f"stream to {self.peer} was closed")
            raise
        finally:
            self._broken(call, error)

    def _broken(self, call, error: AIWorksError | None = None) -> None:
        if call is not None and self._call is call:
            self._call = None
            call.cancel()
        if error is not None:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(Unavailable(error.message))

    async def close(self) -> None:
        call, reader = self._call, self._reader
        self._broken(call, Unavailable(f"stream to {self.peer} was closed"))
        if reader is not None:
            reader.cancel()


async def serve_stream(
    request_iterator,
    context: grpc.aio.ServicerContext,
    handle: Callable[[object], Awaitable[object]],
    make_error: Callable[[int, str], object],
) -> None:
    """Server side: handle every message concurrently, write each answer as it is ready."""
    lock = asyncio.Lock()
    tasks: set[asyncio.Task] = set()

    async def one(request) -> None:
        stream_id = request.stream_id
        try:
            reply = await handle(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, AIWorksError):
                log.exception("unhandled error on a stream")
            reply = make_error(*error_fields(exc))
        reply.stream_id = stream_id
        try:
            async with lock:
                await context.write(reply)
        except Exception:  # the caller went away; nobody is left to answer
            pass

    try:
        async for request in request_iterator:
            task = asyncio.get_running_loop().create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    finally:
        for task in list(tasks):
            task.cancel()
