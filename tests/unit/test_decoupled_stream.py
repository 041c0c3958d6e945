"""Many answers per request on the multiplexed InferStream, and cancellation travelling back (core/stream.py).

A real gRPC server and the runtime's real client; the servicer behind the
stream is a small one of this test's, so each case (0..N answers, an error
after some, a caller that leaves) is exact. The runtime's own servicer runs
the same ``serve_stream``; tests/e2e covers a decoupled model end to end.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, Status, StreamLost
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions
from aiworks.core.stream import serve_stream
from aiworks.pb.runtime.v1 import runtime_pb2 as pb
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.runtime.client import RuntimeClient


class Servicer(runtime_pb2_grpc.RuntimeServiceServicer):
    """``model`` picks the behaviour; ``count`` (a parameter) how many answers."""

    def __init__(self):
        self.cancelled: list[str] = []
        self.started = asyncio.Event()

    def handle(self, message):
        if message.model == "unary":
            return self._unary(message)
        return self._many(message)

    async def _unary(self, message):
        seen = ",".join(f"{k}:{v.WhichOneof('value')}" for k, v in sorted(message.parameters.items()))
        return pb.InferResponse(parameters={"seen": pb.Parameter(string_param=seen)})

    async def _many(self, message):
        count = message.parameters["count"].int64_param
        try:
            for i in range(count):
                if message.model == "slow":
                    self.started.set()
                    await asyncio.sleep(0.05)
                if message.model == "fails" and i == 2:
                    raise InvalidArgument("the third answer cannot be made")
                raw = i.to_bytes(4, "little")
                yield pb.InferResponse(
                    outputs=[pb.Tensor(name="OUT", datatype="INT32", shape=[1], raw=raw)],
                    more=message.model != "marks_last" or i < count - 1,
                )
        except asyncio.CancelledError:
            self.cancelled.append(message.id)
            raise

    async def InferStream(self, request_iterator, context):
        await serve_stream(
            request_iterator, context, self.handle,
            lambda code, text: pb.InferResponse(error_code=code, error_message=text), pb.InferResponseFrame,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def served():
    server = grpc.aio.server()
    servicer = Servicer()
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RuntimeClient(f"127.0.0.1:{port}", 4 << 20, 5.0)
    try:
        yield servicer, client, server
    finally:
        await client.close()
        await server.stop(None)


def request(model: str, count: int = 0, rid: str = "r") -> InferRequest:
    return InferRequest(model, "1", [Tensor("IN", "INT32", (1,), b"\0\0\0\0")], id=rid, parameters={"count": count})


async def collect(client, req, options=None):
    got = []
    async with contextlib.aclosing(client.infer_stream(req, options or RequestOptions())) as answers:
        async for answer in answers:
            got.append(answer)
    return got


def values(answers):
    return [int.from_bytes(a.outputs[0].raw, "little") for a in answers if a.outputs]


def test_every_answer_arrives_in_order_then_an_empty_final_one():
    async def main():
        async with served() as (_, client, _server):
            answers = await collect(client, request("many", 5))
            assert values(answers) == [0, 1, 2, 3, 4]
            # The servicer did not know its last answer was the last: an empty final one follows it.
            assert [a.final for a in answers] == [False] * 5 + [True] and answers[-1].outputs == []

    asyncio.run(main())


def test_a_last_answer_marked_by_the_backend_ends_the_stream_itself():
    async def main():
        async with served() as (_, client, _server):
            answers = await collect(client, request("marks_last", 3))
            assert values(answers) == [0, 1, 2] and [a.final for a in answers] == [False, False, True]

    asyncio.run(main())


def test_zero_answers_is_one_empty_final_answer():
    async def main():
        async with served() as (_, client, _server):
            answers = await collect(client, request("many", 0))
            assert len(answers) == 1 and answers[0].final and answers[0].outputs == []

    asyncio.run(main())


def test_an_error_after_some_answers_ends_that_request_only():
    async def main():
        async with served() as (_, client, _server):
            got = []
            with pytest.raises(AIWorksError) as failed:
                async for answer in client.infer_stream(request("fails", 5), RequestOptions()):
                    got.append(answer)
            assert values(got) == [0, 1]
            assert failed.value.status is Status.INVALID_ARGUMENT and "third answer" in failed.value.message
            # The stream itself carries on: the next request on it is answered.
            assert values(await collect(client, request("many", 2))) == [0, 1]

    asyncio.run(main())


def test_interleaved_requests_on_one_stream_each_get_their_own_answers():
    async def main():
        async with served() as (_, client, _server):
            results = await asyncio.gather(*(collect(client, request("many", n, f"r{n}")) for n in range(1, 9)))
            assert [values(r) for r in results] == [list(range(n)) for n in range(1, 9)]
            frames = client.stream.frames_received
            assert frames < sum(range(1, 9)) + 8  # answers ready together shared frames

    asyncio.run(main())


def test_a_caller_that_leaves_cancels_the_request_at_the_server():
    async def main():
        async with served() as (servicer, client, _server):
            got = []
            async with contextlib.aclosing(client.infer_stream(request("slow", 100, "leaver"), RequestOptions())) as s:
                async for answer in s:
                    got.append(answer)
                    if len(got) == 2:
                        break
            for _ in range(100):
                if servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert servicer.cancelled == ["leaver"]
            assert len(got) == 2

    asyncio.run(main())


def test_a_cancelled_task_waiting_on_the_stream_cancels_the_request():
    async def main():
        async with served() as (servicer, client, _server):
            task = asyncio.create_task(collect(client, request("slow", 100, "task")))
            await servicer.started.wait()
            await asyncio.sleep(0.08)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert servicer.cancelled == ["task"]

    asyncio.run(main())


def test_the_deadline_ends_a_stream_and_cancels_it():
    async def main():
        async with served() as (servicer, client, _server):
            options = RequestOptions(deadline_s=asyncio.get_running_loop().time() + 0.2)
            # RequestOptions deadlines are on time.monotonic, which asyncio's loop clock is on Linux.
            with pytest.raises(AIWorksError) as late:
                await collect(client, request("slow", 100, "late"), options)
            assert late.value.status is Status.DEADLINE_EXCEEDED
            for _ in range(100):
                if servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert servicer.cancelled == ["late"]

    asyncio.run(main())


def test_parameters_travel_both_ways_on_unary_calls():
    async def main():
        async with served() as (_, client, _server):
            parameters = {"text": "hello", "priority": 1, "sequence_id": 7, "seed": 2**63 + 5}
            req = InferRequest("unary", "1", [], parameters=parameters)
            answer = await client.infer(req, RequestOptions())
            # priority and sequence_id are the gateway's (they travel in the options); a uint64 beyond int64 keeps
            # its value's type.
            assert answer.parameters == {"seen": "seed:uint64_param,text:string_param"} and answer.final

    asyncio.run(main())


def test_a_server_that_goes_away_fails_the_open_streams_as_lost():
    async def main():
        async with served() as (servicer, client, server):
            task = asyncio.create_task(collect(client, request("slow", 100)))
            await servicer.started.wait()
            await server.stop(None)
            with pytest.raises(StreamLost):
                await task

    asyncio.run(main())
