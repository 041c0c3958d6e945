"""A stopping runtime's servicer: it counts what it serves, waits for it, and refuses work once its drain ended.

A real data plane (ONNX Runtime, each batch held 300 ms by ``debug_delay_ms``) behind a
real gRPC server, called by the gateway's own ``RuntimeClient``; a stateful model (Triton's
implicit-state accumulator, idle sequences released after 2 s) for the sequences a drain waits for. The whole stop, with the
schedulers and a decoupled stream, is tests/e2e/test_runtime_drain.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions, SequenceRef
from aiworks.core.rpc import add_port, create_server
from aiworks.demo.qa_streaming import write_accumulator
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.runtime.client import RuntimeClient
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.servicer import RuntimeServicer
from aiworks.supervisor.supervisor import free_port

DELAY_S = 0.3
IDLE_S = 2.0


def _double(root: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])],
    )
    (root / "double" / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "double" / "1" / "model.onnx")
    (root / "double" / "config.pbtxt").write_text("max_batch_size: 8\n")
    write_accumulator(root, idle_us=int(IDLE_S * 1e6))


@pytest.fixture
async def replica(tmp_path):
    _double(tmp_path)
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path), replica_id="stop-0", debug_delay_ms=int(DELAY_S * 1000),
                                 warmup=False)  # fmt: skip
    await dataplane.load("double")
    await dataplane.load("accumulator")
    servicer = RuntimeServicer(dataplane, "stop-0")
    server, _ = create_server(1 << 24)
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(servicer, server)
    port = add_port(server, f"127.0.0.1:{free_port()}", None)
    await server.start()
    client = RuntimeClient(f"127.0.0.1:{port}", 1 << 24, 10.0)
    yield servicer, client
    await client.close()
    await server.stop(0)
    await dataplane.close()


def infer(client: RuntimeClient):
    request = InferRequest("double", "1", [Tensor.from_numpy("x", np.ones((1, 3), np.float32))])
    return asyncio.ensure_future(client.infer(request, RequestOptions()))


async def test_the_drain_waits_for_the_requests_in_flight_and_ends_when_they_are_done(replica):
    servicer, client = replica
    assert await servicer.drain(5, asyncio.Event())  # nothing in flight: at once
    calls = [infer(client) for _ in range(3)]
    while servicer.inflight < 3:
        await asyncio.sleep(0.005)
    started = time.perf_counter()
    assert await servicer.drain(5, asyncio.Event())
    took = time.perf_counter() - started
    assert servicer.inflight == 0 and took < 2, took
    for call in calls:  # every one answered, none cut
        assert (await call).outputs[0].to_numpy().tolist() == [[2.0, 2.0, 2.0]]


async def test_the_drain_gives_up_at_its_limit_or_on_a_second_signal(replica):
    servicer, client = replica
    call = infer(client)
    while not servicer.inflight:
        await asyncio.sleep(0.005)
    assert not await servicer.drain(0.05, asyncio.Event())
    second = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, second.set)
    started = time.perf_counter()
    assert not await servicer.drain(30, second)
    assert time.perf_counter() - started < DELAY_S
    assert servicer.inflight == 1
    await call
    assert servicer.inflight == 0


async def test_once_the_drain_ended_new_requests_get_unavailable_which_the_gateway_retries(replica):
    servicer, client = replica
    servicer.stopping = True
    with pytest.raises(Unavailable, match="replica stop-0 is stopping"):
        await infer(client)
    assert servicer.inflight == 0


def add(client: RuntimeClient, sequence: int, value: int, start=False, end=False):
    request = InferRequest("accumulator", "1", [Tensor.from_numpy("INPUT", np.array([[value]], np.int32))])
    return client.infer(request, RequestOptions(sequence=SequenceRef(sequence, start, end)))


async def test_the_drain_waits_for_the_sequences_held_until_they_end_or_idle_out(replica):
    """The gateways still send a stopping replica the later requests of its sequences: its drain waits for
    them to end (an END request) or to be released idle, not only for the requests in flight."""
    servicer, client = replica
    await add(client, 1, 5, start=True)
    await add(client, 2, 1, start=True)
    assert servicer.held() == (0, 2)
    drain = asyncio.ensure_future(servicer.drain(10, asyncio.Event()))
    await asyncio.sleep(0.1)
    assert not drain.done()  # nothing in flight, but two sequences held
    total = await add(client, 1, 7)  # its later requests are served during the drain, with its state
    assert total.outputs[0].to_numpy().tolist() == [[12]]
    started = time.perf_counter()
    await add(client, 1, 1, end=True)
    await add(client, 2, 1)  # sequence 2 then goes quiet: released after IDLE_S
    assert servicer.held() == (0, 1)
    assert await drain
    took = time.perf_counter() - started
    assert servicer.held() == (0, 0) and IDLE_S * 0.8 < took < IDLE_S + 4, took


async def test_a_sequence_that_never_ends_holds_the_drain_only_to_its_limit(replica):
    servicer, client = replica
    await add(client, 3, 1, start=True)
    started = time.perf_counter()
    assert not await servicer.drain(0.2, asyncio.Event())  # held by a live sequence: the limit ends it
    assert 0.15 < time.perf_counter() - started < 1.5
