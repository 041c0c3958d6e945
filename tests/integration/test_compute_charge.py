"""What each request cost a replica, through a real RuntimeService and its client on loopback.

A runtime data plane serves a tiny ONNX model slowed on purpose (the
test-only ``debug_delay_ms``, which counts as compute, as a slow model's time
would), in this process, over gRPC. The gateway's side is the real
:class:`~aiworks.runtime.client.RuntimeClient` with a
:class:`~aiworks.runtime.client.Work` per request (docs/tenancy.md, "Compute
quota").
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
from aiworks.core.errors import DeadlineExceeded, Internal, InvalidArgument, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.options import Priority, RequestOptions
from aiworks.core.rpc import add_port, create_server
from aiworks.pb.runtime.v1 import runtime_pb2_grpc
from aiworks.runtime.client import RuntimeClient, Work, outstanding_compute_s
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.servicer import RuntimeServicer
from aiworks.supervisor.supervisor import free_port


def _model(root: Path, name: str, batching: str, *, fragile: bool = False) -> None:
    """y = x * 2 for x: float[N, 3]; ``fragile``: y = x reshaped to [2, -1], which fails for an odd N when it runs."""
    if fragile:
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
        init = [helper.make_tensor("shape", TensorProto.INT64, [2], [2, -1])]
    else:
        nodes = [helper.make_node("Mul", ["x", "k"], ["y"])]
        init = [helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=init,
    )
    (root / name / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / name / "1" / "model.onnx")
    (root / name / "config.pbtxt").write_text(f"max_batch_size: 8\n{batching}")


@pytest.fixture
async def replica(tmp_path):
    """A RuntimeService on a free port whose batches take 100 ms; yields a client to it."""
    _model(tmp_path, "slow", "dynamic_batching { max_queue_delay_microseconds: 30000 }\n")
    _model(tmp_path, "fragile", "", fragile=True)
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path), replica_id="charge-0", debug_delay_ms=100, warmup=False)
    await dataplane.load("slow")
    await dataplane.load("fragile")
    server, _ = create_server(1 << 24)
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(dataplane, "charge-0"), server)
    port = add_port(server, f"127.0.0.1:{free_port()}", None)
    await server.start()
    client = RuntimeClient(f"127.0.0.1:{port}", 1 << 24, 10.0)
    yield client
    await client.close()
    await server.stop(0)
    await dataplane.close()


def request(rows: int = 1) -> InferRequest:
    return InferRequest("slow", "1", [Tensor.from_numpy("x", np.ones((rows, 3), np.float32))])


def within(timeout_s: float) -> RequestOptions:
    return RequestOptions(Priority.STANDARD, time.monotonic() + timeout_s)


async def test_each_request_is_charged_its_share_of_the_batch_by_rows(replica):
    one, three = Work(), Work()
    await asyncio.gather(replica.infer(request(1), RequestOptions(), one), replica.infer(request(3), RequestOptions(), three))
    assert one.compute_s + three.compute_s == pytest.approx(0.1, abs=0.03)  # one batch of 4 rows, shared
    assert three.compute_s == pytest.approx(3 * one.compute_s, rel=0.01)


async def test_a_deadline_that_passes_while_the_batch_runs_answers_at_once_and_charges_when_the_work_ends(replica):
    work = Work()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await replica.infer(request(1), within(0.05), work)  # 50 ms, in a batch of 130 ms (30 delay + 100)
    assert time.monotonic() - started < 0.09  # the client is answered at its deadline...
    assert work.outstanding is not None and work.compute_s == 0
    await asyncio.wait_for(asyncio.shield(work.outstanding), 5)  # ...and the replica's answer comes when it ends
    assert outstanding_compute_s(work.outstanding) == pytest.approx(0.1, abs=0.03)


async def test_a_request_dropped_from_the_queue_costs_nothing(replica):
    blocker = asyncio.ensure_future(replica.infer(request(1), RequestOptions(), Work()))
    await asyncio.sleep(0.05)  # the blocker's batch runs for 100 ms
    work = Work()
    with pytest.raises(DeadlineExceeded):
        await replica.infer(InferRequest("slow", "1", request(1).inputs, ["y"]), within(0.02), work)
    await blocker
    if work.outstanding is not None:
        await asyncio.wait_for(asyncio.shield(work.outstanding), 5)
        assert outstanding_compute_s(work.outstanding) == 0  # the replica dropped it before it ran
    assert work.compute_s == 0


async def test_a_cancelled_call_still_learns_what_its_work_cost(replica):
    work = Work()
    call = asyncio.ensure_future(replica.infer(request(2), RequestOptions(), work))
    await asyncio.sleep(0.05)
    call.cancel()  # the client went away while its batch ran
    with pytest.raises(asyncio.CancelledError):
        await call
    assert work.outstanding is not None
    await asyncio.wait_for(asyncio.shield(work.outstanding), 5)
    assert outstanding_compute_s(work.outstanding) == pytest.approx(0.1, abs=0.03)


async def test_a_batch_the_model_fails_is_charged_its_time(replica):
    work = Work()
    one_row = InferRequest("fragile", "1", [Tensor.from_numpy("x", np.ones((1, 3), np.float32))])
    with pytest.raises(Internal):  # the reshape fails inside the model, after the (slow) part before it
        await replica.infer(one_row, RequestOptions(), work)
    assert work.compute_s == pytest.approx(0.1, abs=0.03)


async def test_a_request_the_replica_refuses_before_running_it_costs_nothing(replica):
    work = Work()
    wide = InferRequest("slow", "1", [Tensor.from_numpy("x", np.ones((1, 4), np.float32))])  # the model wants 3
    with pytest.raises(InvalidArgument):
        await replica.infer(wide, RequestOptions(), work)
    assert work.compute_s == 0


async def test_an_unreachable_replica_costs_nothing():
    client = RuntimeClient(f"127.0.0.1:{free_port()}", 1 << 20, 2.0)
    work = Work()
    try:
        with pytest.raises(Unavailable):
            await client.infer(request(1), RequestOptions(), work)
    finally:
        await client.close()
    assert work.compute_s == 0 and work.outstanding is None
