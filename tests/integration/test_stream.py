"""MultiplexedStream and serve_stream over a real gRPC server on a free port."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from aiworks.core.errors import DeadlineExceeded, InvalidArgument, Unavailable
from aiworks.core.stream import MultiplexedStream, serve_stream
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.supervisor.supervisor import free_port


async def handle(request: pb.InferRequest) -> pb.InferResponse:
    """Echo the model name after a delay given in the version field; 'bad' fails (after its delay)."""
    await asyncio.sleep(float(request.version or 0))
    if request.model == "bad":
        raise InvalidArgument("bad input for 'bad'")
    return pb.InferResponse(outputs=[pb.Tensor(name=request.model)])


async def execute_stream(request_iterator, context):
    await serve_stream(
        request_iterator,
        context,
        handle,
        lambda code, msg: pb.InferResponse(error_code=code, error_message=msg),
        pb.InferResponseFrame,
    )


async def start_server(port: int, frames: list | None = None) -> grpc.aio.Server:
    """The echo server; ``frames`` collects (bytes, messages) of every request frame it reads."""

    def read_frame(data: bytes) -> pb.InferRequestFrame:
        frame = pb.InferRequestFrame.FromString(data)
        if frames is not None:
            frames.append((len(data), len(frame.items)))
        return frame

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.Echo",
                {
                    "Stream": grpc.stream_stream_rpc_method_handler(
                        execute_stream,
                        request_deserializer=read_frame,
                        response_serializer=pb.InferResponseFrame.SerializeToString,
                    )
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def client(port: int, max_message_bytes: int = 4 << 20) -> tuple[grpc.aio.Channel, MultiplexedStream]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    method = channel.stream_stream(
        "/t.Echo/Stream",
        request_serializer=pb.InferRequestFrame.SerializeToString,
        response_deserializer=pb.InferResponseFrame.FromString,
    )
    return channel, MultiplexedStream(method, "echo", pb.InferRequestFrame, max_message_bytes)


@contextlib.asynccontextmanager
async def echo(frames: list | None = None, max_message_bytes: int = 4 << 20):
    """A started echo server and a stream to it; ``frames`` collects the request frames the server reads."""
    port = free_port()
    server = await start_server(port, frames)
    channel, stream = client(port, max_message_bytes)
    try:
        yield stream
    finally:
        await stream.close()
        await channel.close()
        await server.stop(0)


async def test_answers_out_of_order_reach_their_callers():
    async with echo() as stream:
        slow = asyncio.create_task(stream.call(pb.InferRequest(model="slow", version="0.3"), 5))
        fast = [stream.call(pb.InferRequest(model=f"m{i}"), 5) for i in range(20)]
        replies = await asyncio.gather(*fast)
        assert [r.outputs[0].name for r in replies] == [f"m{i}" for i in range(20)]
        assert not slow.done()
        assert (await slow).outputs[0].name == "slow"
        with pytest.raises(InvalidArgument, match="bad input"):
            await stream.call(pb.InferRequest(model="bad"), 5)
        with pytest.raises(DeadlineExceeded):
            await stream.call(pb.InferRequest(model="late", version="2"), 0.2)
        # The stream survives errors and timeouts of single calls.
        assert (await stream.call(pb.InferRequest(model="after"), 5)).outputs[0].name == "after"


async def test_peer_death_fails_pending_calls_and_the_stream_reopens():
    port = free_port()
    server = await start_server(port)
    channel, stream = client(port)
    try:
        pending = asyncio.create_task(stream.call(pb.InferRequest(model="x", version="5"), 10))
        await asyncio.sleep(0.2)
        await server.stop(0)
        with pytest.raises(Unavailable):
            await pending
        server = await start_server(port)
        for _ in range(50):  # the channel reconnects with backoff
            try:
                reply = await stream.call(pb.InferRequest(model="back"), 2)
                break
            except Unavailable:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the stream never reopened")
        assert reply.outputs[0].name == "back"
    finally:
        await stream.close()
        await channel.close()
        await server.stop(0)


async def test_a_busy_stream_packs_messages_into_frames_both_ways():
    frames: list[tuple[int, int]] = []
    async with echo(frames) as stream:
        replies = await asyncio.gather(*(stream.call(pb.InferRequest(model=f"m{i}"), 5) for i in range(200)))
        assert [r.outputs[0].name for r in replies] == [f"m{i}" for i in range(200)]
        # 200 calls made at once leave in a handful of writes, and the answers come back the same way.
        assert stream.outbox.messages == 200 and stream.outbox.frames <= 5
        assert sum(n for _, n in frames) == 200 and len(frames) == stream.outbox.frames
        assert stream.frames_received <= 10
        # A lone call later is a frame of one: an idle stream adds no wait.
        assert (await stream.call(pb.InferRequest(model="alone"), 5)).outputs[0].name == "alone"
        assert frames[-1][1] == 1


async def test_frames_stay_under_their_byte_budget_and_a_big_message_travels_alone():
    frames: list[tuple[int, int]] = []
    async with echo(frames, max_message_bytes=64 << 10) as stream:  # frames of at most 32 KiB
        big = [pb.InferRequest(model=f"big{i}", inputs=[pb.Tensor(raw=b"b" * (40 << 10))]) for i in range(3)]
        small = [pb.InferRequest(model=f"s{i}", inputs=[pb.Tensor(raw=b"s" * 1000)]) for i in range(60)]
        calls = [stream.call(m, 5) for pair in zip(small[:3], big) for m in pair] + [
            stream.call(m, 5) for m in small[3:]
        ]
        replies = await asyncio.gather(*calls)
        assert sorted(r.outputs[0].name for r in replies) == sorted(
            [f"big{i}" for i in range(3)] + [f"s{i}" for i in range(60)]
        )
        assert sum(n for _, n in frames) == 63
        assert all(size <= 32 << 10 for size, n in frames if n > 1)
        assert sum(1 for size, n in frames if size > 40 << 10 and n == 1) == 3  # each big one by itself
        assert len(frames) < 63  # the small ones still share frames
