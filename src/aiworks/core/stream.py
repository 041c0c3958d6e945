"""Many unary-like calls multiplexed on one long-lived bidirectional gRPC stream.

On these machines a unary gRPC call between two Python processes costs about
a millisecond of set-up, and twice that when the callee forwards it; a message
on an already open stream costs a fraction of it. The hot paths
(gateway → runtime ``InferStream``, gateway → cache ``GetStream``/``PutStream``)
therefore keep one stream per peer and tag each message with a ``stream_id``; answers come back in any
order and carry either the result or an error as a gRPC status code and
message, which map through the one error table.

**Frames.** gRPC allows one write in flight per stream, and every write and
read is a round trip between gRPC's poller thread and the asyncio loop. With
one message per write, a busy stream became a queue of its own: under 1,000
concurrent clients requests took a median 237 ms to reach the scheduler's
queue while every process had idle CPU (bench/qos_breakdown.py). So a stream carries *frames* (a message
with ``repeated … items``): whatever was queued while the last write was in
flight leaves in the next frame (:class:`Outbox`), up to :data:`FRAME_BYTES`
of messages; a lone message is a frame of one, and one bigger than that
travels alone. An idle stream adds no delay; a busy one makes one write for
many messages. The price is one copy of each message into its frame, made by
protobuf's C runtime (a memcpy of tensor bytes), and ``ByteSize`` of each
message packed with others.

**Many replies, and cancellation.** A request may have several replies (a
decoupled model's tokens): each but the last has ``more`` set, and
:meth:`MultiplexedStream.open` iterates them. A caller that stops waiting
sends the request's ``stream_id`` in the ``cancel`` list of a frame, and the
server cancels the task serving it, so a queued request leaves its queue and a
generation stops at its next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from aiworks.core.errors import (
    AIWorksError,
    DeadlineExceeded,
    Status,
    StreamLost,
    Unavailable,
    from_grpc_code,
    from_rpc_error,
)

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}

# Messages packed into one frame, at most (a message bigger than this goes alone).
FRAME_BYTES = 1 << 20
# Per packed message: the field tag and length prefix, with room to spare.
_ITEM_OVERHEAD = 8


class Outbox:
    """Messages waiting to be written on one stream, sent as frames by one writer task.

    ``put`` queues a message and starts the writer if none runs; the writer
    packs everything queued (in order, up to ``max_frame_bytes``) into one
    frame per write until the queue is empty. ``discard`` takes back a
    message not written yet (its caller gave up). A failed write empties the
    queue and calls ``on_error``.
    """

    def __init__(
        self,
        frame_type,
        write: Callable[[object], Awaitable[None]],
        on_error: Callable[[BaseException], None],
        max_frame_bytes: int = FRAME_BYTES,
    ):
        self._frame_type = frame_type
        self._write = write
        self._on_error = on_error
        self._max_frame_bytes = max_frame_bytes
        self._queued: dict[int, object] = {}
        # Only frames with a ``cancel`` list can carry cancellations (the runtime's; not the cache's).
        self._can_cancel = "cancel" in frame_type.DESCRIPTOR.fields_by_name
        self._cancels: list[int] = []
        self._writer: asyncio.Task | None = None
        self.frames = 0  # frames written (tests and benchmarks read it)
        self.messages = 0

    def put(self, key: int, message) -> None:
        self._queued[key] = message
        self._wake()

    def _wake(self) -> None:
        if self._writer is None:
            # Not in the context of whichever call happened to start it (its trace, for one).
            self._writer = asyncio.get_running_loop().create_task(self._drain(), context=contextvars.Context())

    def discard(self, key: int) -> bool:
        """Take back a message not written yet; False when it has left already."""
        return self._queued.pop(key, None) is not None

    def cancel(self, key: int) -> None:
        """The caller of message ``key`` went away: take it back, or tell the peer in the next frame."""
        if not self.discard(key) and self._can_cancel:
            self._cancels.append(key)
            self._wake()

    def clear(self) -> None:
        """Drop every message not written yet (the stream broke)."""
        self._queued.clear()
        self._cancels.clear()

    async def drained(self) -> None:
        """Wait until everything queued has been written (or the writer failed)."""
        while self._writer is not None:
            await asyncio.shield(self._writer)

    def _take(self) -> list:
        """The next frame's messages: the oldest first, as many as fit."""
        taken: list = []
        size = 0
        for message in self._queued.values():
            if taken:
                # Sizes matter only when there is more than one; ByteSize is cheap for small messages.
                if size == 0:
                    size = taken[0].ByteSize() + _ITEM_OVERHEAD
                size += message.ByteSize() + _ITEM_OVERHEAD
                if size > self._max_frame_bytes:
                    break
            taken.append(message)
        for key in list(itertools.islice(self._queued, len(taken))):
            del self._queued[key]
        return taken

    async def _drain(self) -> None:
        try:
            while self._queued or self._cancels:
                items = self._take()
                frame = self._frame_type()
                for item in items:
                    # CopyFrom into an added item: upb's constructor (``items=[...]``) copies each message by
                    # serializing and parsing it, 8 ms for a 4 MiB tensor here, against 0.3 ms for this.
                    frame.items.add().CopyFrom(item)
                if self._cancels:
                    cancels, self._cancels = self._cancels, []
                    frame.cancel.extend(cancels)
                await self._write(frame)
                self.frames += 1
                self.messages += len(items)
        except BaseException as exc:  # noqa: BLE001 - the queue's callers learn of it through on_error
            self._queued.clear()
            self._on_error(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._writer = None


def reply_error(reply) -> AIWorksError:
    """The error an answer with a non-zero ``error_code`` carries, with its Retry-After hint and what it cost.

    A reply type with a ``retry_after_s`` field (a full queue's) carries the
    Retry-After hint; one with ``compute_us`` the compute the failed work took.
    """
    error = from_grpc_code(_CODES.get(reply.error_code, grpc.StatusCode.UNKNOWN), reply.error_message)
    error.retry_after_s = getattr(reply, "retry_after_s", 0.0) or None
    error.compute_ns = getattr(reply, "compute_us", 0) * 1000
    return error


def _expire(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded(message))


def error_fields(exc: BaseException) -> tuple[int, str]:
    """(gRPC status code number, message) for an error answered on a stream."""
    if isinstance(exc, AIWorksError):
        return exc.status.grpc_code.value[0], exc.message
    return Status.INTERNAL.grpc_code.value[0], f"internal error: {type(exc).__name__}: {exc}"


class ReplyStream:
    """The replies to one request that may have many: ``async for reply in stream``.

    Every reply is yielded, the last one (``more`` unset) included; an error
    reply raises its error and ends the stream. Leaving early (``aclose``, a
    ``break`` inside ``async with``, cancellation) cancels the request at the
    peer. Each reply must come within ``idle_timeout_s`` of the one before.
    """

    def __init__(self, owner: MultiplexedStream, stream_id: int, idle_timeout_s: float):
        self._owner = owner
        self.stream_id = stream_id
        self._idle_timeout_s = idle_timeout_s
        self._replies: asyncio.Queue = asyncio.Queue()
        self.done = False

    def push(self, reply) -> None:
        self._replies.put_nowait(reply)

    def fail(self, error: BaseException) -> None:
        self._replies.put_nowait(error)

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                reply = await self._replies.get()
        except TimeoutError:
            await self.aclose()
            raise DeadlineExceeded(
                f"{self._owner.peer} sent nothing for {self._idle_timeout_s:g} s in a streamed answer"
            ) from None
        if isinstance(reply, BaseException):
            self._finish()
            raise reply
        if reply.error_code:
            self._finish()
            raise reply_error(reply)
        if not reply.more:
            self._finish()
        return reply

    def _finish(self) -> None:
        self.done = True
        self._owner._pending.pop(self.stream_id, None)

    async def aclose(self) -> None:
        """Stop: the peer is told to cancel the request unless its last reply came already."""
        if not self.done:
            self._finish()
            self._owner._cancel(self.stream_id)

    async def __aenter__(self) -> ReplyStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class MultiplexedStream:
    """Client side: ``await call(message, timeout_s)`` sends one message and waits for its answer.

    ``frame_type`` is the stream's request frame (``items`` holds the
    messages). The stream opens on first use and again after it breaks; a
    broken stream fails every call waiting on it with UNAVAILABLE, which the
    scheduler treats as "try another replica".
    """

    def __init__(
        self,
        open_call: Callable[[], grpc.aio.StreamStreamCall],
        peer: str,
        frame_type,
        max_message_bytes: int = FRAME_BYTES * 2,
    ):
        self._open_call = open_call
        self.peer = peer
        self._frame_type = frame_type
        self._max_frame_bytes = min(FRAME_BYTES, max_message_bytes // 2)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._outbox: Outbox | None = None
        self._pending: dict[int, asyncio.Future | ReplyStream] = {}
        self._ids = itertools.count(1)
        self.frames_received = 0

    @property
    def outbox(self) -> Outbox | None:
        """The open stream's outbox (its ``frames`` and ``messages`` counts), None before the first call."""
        return self._outbox

    def _ensure_open(self) -> Outbox:
        if self._call is None:
            call = self._call = self._open_call()
            # Not in the context of the call that happened to open the stream (its trace, for one).
            self._reader = asyncio.get_running_loop().create_task(self._read(call), context=contextvars.Context())
            self._outbox = Outbox(
                self._frame_type, call.write, lambda exc: self._write_failed(call, exc), self._max_frame_bytes
            )
        return self._outbox

    async def call(self, message, timeout_s: float):
        stream_id = next(self._ids)
        message.stream_id = stream_id
        future = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        outbox = None
        try:
            async with asyncio.timeout(timeout_s):
                outbox = self._ensure_open()
                outbox.put(stream_id, message)
                reply = await future
        except TimeoutError:
            raise DeadlineExceeded(f"{self.peer} did not answer within {timeout_s:g} s") from None
        except grpc.aio.UsageError:  # the channel was closed under us
            raise Unavailable(f"stream to {self.peer} is closed") from None
        finally:
            self._pending.pop(stream_id, None)
            if outbox is not None:
                outbox.discard(stream_id)  # not written yet: nobody waits for it now
        if reply.error_code:
            raise reply_error(reply)
        return reply

    def send(self, message, timeout_s: float) -> asyncio.Future:
        """Send one message; the future resolves with its reply as the peer sent it, errors included.

        Unlike :meth:`call`, the answer outlives its caller: cancelling the
        caller (or the caller giving up waiting) leaves the future to resolve,
        so the caller can learn later what the peer did. It fails on its own
        with DEADLINE_EXCEEDED after ``timeout_s``, or UNAVAILABLE if the
        stream breaks. Cancel the future to stop waiting for it.
        """
        stream_id = next(self._ids)
        message.stream_id = stream_id
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[stream_id] = future
        try:
            outbox = self._ensure_open()
        except grpc.aio.UsageError:  # the channel was closed under us
            self._pending.pop(stream_id, None)
            future.set_exception(Unavailable(f"stream to {self.peer} is closed"))
            return future
        outbox.put(stream_id, message)
        timer = loop.call_later(timeout_s, _expire, future, f"{self.peer} did not answer within {timeout_s:g} s")

        def done(_) -> None:
            timer.cancel()
            self._pending.pop(stream_id, None)
            if future.cancelled() or isinstance(future.exception(), DeadlineExceeded):
                outbox.cancel(stream_id)  # nobody waits for it now: the peer drops it (or it is never sent)

        future.add_done_callback(done)
        return future

    def open(self, message, idle_timeout_s: float) -> ReplyStream:
        """Send one message whose replies may be many; iterate the returned stream (see :class:`ReplyStream`)."""
        stream_id = next(self._ids)
        message.stream_id = stream_id
        replies = ReplyStream(self, stream_id, idle_timeout_s)
        self._pending[stream_id] = replies
        try:
            outbox = self._ensure_open()
        except grpc.aio.UsageError:  # the channel was closed under us
            replies.fail(Unavailable(f"stream to {self.peer} is closed"))
            return replies
        outbox.put(stream_id, message)
        return replies

    def _cancel(self, stream_id: int) -> None:
        if self._outbox is not None and self._call is not None:
            self._outbox.cancel(stream_id)

    async def _read(self, call) -> None:
        error: AIWorksError = Unavailable(f"{self.peer} closed the stream")
        try:
            async for frame in call:
                self.frames_received += 1
                for reply in frame.items:
                    waiter = self._pending.get(reply.stream_id)
                    if waiter is None:
                        continue
                    if isinstance(waiter, ReplyStream):
                        waiter.push(reply)
                        if not reply.more or reply.error_code:
                            self._pending.pop(reply.stream_id, None)
                    elif not waiter.done():
                        waiter.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, self.peer)
            if error.status is not Status.UNAVAILABLE:
                error = Unavailable(f"stream to {self.peer} failed: {error.message}")
        except asyncio.CancelledError:
            error = Unavailable(f"stream to {self.peer} was closed")
            raise
        finally:
            self._broken(call, error)

    def _write_failed(self, call, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            message = f"stream to {self.peer} failed: {from_rpc_error(exc, self.peer).message}"
        else:
            message = f"stream to {self.peer} is closed"
        self._broken(call, Unavailable(message))

    def _broken(self, call, error: AIWorksError) -> None:
        """The stream ``call`` is gone: fail every call waiting on it; the next call opens a new one."""
        if call is None or self._call is not call:
            return  # an earlier stream's late news; its callers were failed when it broke
        self._call = None
        call.cancel()
        if self._outbox is not None:
            self._outbox.clear()
        for waiter in list(self._pending.values()):
            if isinstance(waiter, ReplyStream):
                waiter.fail(StreamLost(error.message))
            elif not waiter.done():
                waiter.set_exception(StreamLost(error.message))

    async def close(self) -> None:
        reader = self._reader
        self._broken(self._call, Unavailable(f"stream to {self.peer} was closed"))
        if reader is not None:
            reader.cancel()


async def serve_stream(
    request_iterator,
    context: grpc.aio.ServicerContext,
    handle: Callable[[object], Awaitable[object] | AsyncIterator[object]],
    make_error: Callable[[int, str], object],
    reply_frame_type,
) -> None:
    """Server side: handle every message of every frame concurrently; answers leave in frames as they are ready.

    ``handle`` returns an awaitable of one reply, or an async iterator of
    several (each but the last with ``more`` set; if the last one yielded
    still has it, an empty final reply, ``make_error(0, "")``, follows). A
    frame's ``cancel`` list cancels the tasks serving those requests; a
    cancelled request gets no reply.
    """
    running: dict[int, asyncio.Task] = {}
    keys = itertools.count()
    # A failed write means the caller went away; nobody is left to answer.
    outbox = Outbox(reply_frame_type, context.write, lambda exc: None)

    def put(stream_id: int, reply) -> None:
        reply.stream_id = stream_id
        outbox.put(next(keys), reply)

    async def one(request) -> None:
        stream_id = request.stream_id
        try:
            result = handle(request)
            if inspect.isawaitable(result):
                put(stream_id, await result)
                return
            more = True
            try:
                async for reply in result:
                    more = reply.more
                    put(stream_id, reply)
                    if not more:
                        break
            finally:
                await result.aclose()
            if more:
                put(stream_id, make_error(0, ""))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, AIWorksError):
                log.exception("unhandled error on a stream")
            put(stream_id, make_error(*error_fields(exc)))

    loop = asyncio.get_running_loop()
    try:
        async for frame in request_iterator:
            for request in frame.items:
                task = loop.create_task(one(request))
                running[request.stream_id] = task
                task.add_done_callback(lambda _, sid=request.stream_id: running.pop(sid, None))
            for stream_id in getattr(frame, "cancel", ()):
                task = running.get(stream_id)
                if task is not None:
                    task.cancel()
        if running:
            await asyncio.gather(*list(running.values()), return_exceptions=True)
        await outbox.drained()
    finally:
        for task in list(running.values()):
            task.cancel()
