"""gRPC streaming (ModelStreamInfer, decoupled models) and stateful models, with tritonclient against real processes.

One suite of its own: a scheduler, two runtime replicas and a gateway over
the QA streaming models (aiworks.demo.qa_streaming), with no sequence
backlog so that "too many sequences" is reached at once. The last test kills
a runtime replica.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from e2e_support import repeat_inputs, start_suite
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from aiworks.demo.qa_streaming import accumulator_config, accumulator_onnx, build_qa_streaming_models
from aiworks.scheduler.sequence_routing import rendezvous_weight

TINY_IDLE_S = 0.4


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    repo = tmp_path_factory.mktemp("qa") / "repo"
    build_qa_streaming_models(repo)
    tiny = repo / "tiny" / "1"
    tiny.mkdir(parents=True)
    (tiny / "accumulator.onnx").write_bytes(accumulator_onnx())
    (repo / "tiny" / "config.pbtxt").write_text(accumulator_config("tiny", candidates=1, idle_us=int(TINY_IDLE_S * 1e6)))
    s = start_suite(repo, tmp_path_factory.mktemp("logs"), cache=False,
                    extra_env={"AIWORKS_RUNTIME_MAX_SEQUENCE_BACKLOG": "0"})  # fmt: skip
    yield s
    s.supervisor.stop()


@pytest.fixture
def grpc_client(suite):
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    yield client
    client.close()


@pytest.fixture
def http_client(suite):
    client = httpclient.InferenceServerClient(suite.http_url)
    yield client
    client.close()


def stateless_inputs(module, value, acc=0, datatype="INT32"):
    tensors = []
    for name, v in (("INPUT", value), ("START", 0), ("ACC", acc)):
        t = module.InferInput(name, [1, 1], datatype)
        t.set_data_from_numpy(np.array([[v]], dtype=np.int32 if datatype == "INT32" else np.float32))
        tensors.append(t)
    return tensors


def value_input(module, value):
    t = module.InferInput("INPUT", [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return t


class Collector:
    def __init__(self):
        self.items = queue.Queue()

    def __call__(self, result, error):
        self.items.put((result, error))

    def take(self, count, timeout_s=10.0):
        return [self.items.get(timeout=timeout_s) for _ in range(count)]


def final_flag(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


# ---- streaming -----------------------------------------------------------------------------------


def test_a_stream_of_interleaved_requests_answers_each_and_the_bad_one_with_an_error(grpc_client):
    got = Collector()
    grpc_client.start_stream(callback=got)
    for i in range(7):
        if i == 3:  # FP32 where INT32 is declared: this one fails, the stream goes on
            grpc_client.async_stream_infer("accumulator_stateless", stateless_inputs(grpcclient, i, datatype="FP32"),
                                           request_id="bad")  # fmt: skip
        elif i % 2:
            grpc_client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, [i, i], delay_ms=5),
                                           request_id=f"r{i}")  # fmt: skip
        else:
            grpc_client.async_stream_infer("accumulator_stateless", stateless_inputs(grpcclient, i, acc=100),
                                           request_id=f"s{i}")  # fmt: skip
    items = got.take(4 + 2 * 2 + 1)  # 4 one-answer requests, 2 repeats of 2 responses each, 1 error
    grpc_client.stop_stream()
    errors = [e for _, e in items if e is not None]
    assert len(errors) == 1 and "INT32" in errors[0].message()
    answers = [r for r, e in items if e is None]
    stateless = [(r.get_response().id, int(r.as_numpy("OUTPUT")[0][0])) for r in answers if r.get_response().id[0] == "s"]
    assert stateless == [("s0", 100), ("s2", 102), ("s4", 104), ("s6", 106)]  # in the order they were sent
    repeats = sorted((r.get_response().id, int(r.as_numpy("OUT")[0])) for r in answers if r.get_response().id[0] == "r")
    assert repeats == [("r1", 1), ("r1", 1), ("r5", 5), ("r5", 5)]
    assert all(final_flag(r) for r in answers if r.get_response().id[0] == "s")


def test_a_decoupled_model_sends_n_responses_and_the_final_flag(grpc_client):
    got = Collector()
    grpc_client.start_stream(callback=got)
    grpc_client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, [10, 20, 30, 40], delay_ms=5),
                                   request_id="with-final", enable_empty_final_response=True)  # fmt: skip
    items = got.take(5)
    assert all(e is None for _, e in items)
    results = [r for r, _ in items]
    assert [int(r.as_numpy("OUT")[0]) for r in results[:4]] == [10, 20, 30, 40]
    assert [int(r.as_numpy("IDX")[0]) for r in results[:4]] == [0, 1, 2, 3]
    assert [final_flag(r) for r in results] == [False, False, False, False, True]
    assert results[4].get_response().id == "with-final" and not results[4].get_response().outputs
    # Without asking for it, the bare final flag is not sent; IN of shape [0] then answers nothing at all.
    grpc_client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, [1, 2]), request_id="plain")
    grpc_client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, []), request_id="none",
                                   enable_empty_final_response=True)  # fmt: skip
    items = got.take(3)
    by_id = sorted((r.get_response().id, final_flag(r)) for r, _ in items)
    assert by_id == [("none", True), ("plain", False), ("plain", False)]
    grpc_client.stop_stream()
    assert got.items.empty()


def test_the_aio_client_streams_too(suite):
    async def requests_():
        yield {"model_name": "repeat_int32", "inputs": repeat_inputs(grpcaio, [7, 8, 9], delay_ms=5),
               "request_id": "aio-repeat"}  # fmt: skip
        yield {"model_name": "accumulator_stateless", "inputs": stateless_inputs(grpcaio, 1, acc=41),
               "request_id": "aio-one"}  # fmt: skip

    async def main():
        async with grpcaio.InferenceServerClient(suite.grpc_url) as client:
            seen = []
            async for result, error in client.stream_infer(requests_()):
                assert error is None
                name = "OUT" if result.get_response().id == "aio-repeat" else "OUTPUT"
                seen.append((result.get_response().id, int(result.as_numpy(name).flat[0]), final_flag(result)))
                if len(seen) == 4:
                    break
            return sorted(seen)

    assert asyncio.run(main()) == [
        ("aio-one", 42, True), ("aio-repeat", 7, False), ("aio-repeat", 8, False), ("aio-repeat", 9, False)
    ]


def test_one_answer_apis_refuse_a_decoupled_model_with_tritons_words(grpc_client, http_client):
    with pytest.raises(InferenceServerException) as over_grpc:
        grpc_client.infer("repeat_int32", repeat_inputs(grpcclient, [1]))
    assert over_grpc.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in over_grpc.value.message()
    with pytest.raises(InferenceServerException) as over_http:
        http_client.infer("repeat_int32", repeat_inputs(httpclient, [1]))
    assert over_http.value.status() == "501"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in over_http.value.message()
    # The model config tells clients so (perf_analyzer reads it to choose streaming), and which models keep state.
    assert grpc_client.get_model_config("repeat_int32").config.model_transaction_policy.decoupled
    assert grpc_client.get_model_config("accumulator").config.sequence_batching.HasField("oldest")


def runtime_requests(suite, status: str) -> float:
    total = 0.0
    for target in suite.supervisor.metrics_targets()["runtime"]:
        text = requests.get(f"http://{target}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if (s.name == "aiworks_scheduler_requests_total" and s.labels.get("model") == "repeat_int32"
                        and s.labels.get("status") == status):  # fmt: skip
                    total += s.value
    return total


def test_cancelling_the_stream_cancels_the_request_at_the_runtime(suite, grpc_client):
    before = runtime_requests(suite, "unavailable")
    got = Collector()
    grpc_client.start_stream(callback=got)
    grpc_client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, list(range(100)), delay_ms=50),
                                   request_id="long")  # fmt: skip
    got.take(2)  # it runs
    grpc_client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 5
    while runtime_requests(suite, "unavailable") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runtime_requests(suite, "unavailable") == before + 1  # ended there as cancelled, not after 100 answers


# ---- stateful models -----------------------------------------------------------------------------


def test_four_interleaved_sequences_each_keep_their_own_sum(grpc_client, http_client):
    ids = [2**64 - 2, 42, "twin-a", "twin-b"]  # uint64 (over HTTP: beyond int64) and string correlation ids
    steps = [[3, 5, 7, 11], [100, -1, -2, -3], [1, 1, 1, 1], [0, 10, 0, 10]]
    got = {sid: [] for sid in ids}
    for step in range(4):
        for sid, values in zip(ids, steps):
            client, module = (http_client, httpclient) if step % 2 or sid == ids[0] else (grpc_client, grpcclient)
            result = client.infer("accumulator", [value_input(module, values[step])], sequence_id=sid,
                                  sequence_start=step == 0, sequence_end=step == 3)  # fmt: skip
            got[sid].append(int(result.as_numpy("OUTPUT")[0][0]))
    assert [got[sid] for sid in ids] == [list(np.cumsum(v)) for v in steps]


def test_sequences_on_one_stream_run_in_order_and_keep_their_sums(grpc_client):
    got = Collector()
    grpc_client.start_stream(callback=got)
    steps = {"stream-a": [1, 2, 3, 4], 9001: [10, 20, 30, 40]}
    for i in range(4):  # sent without waiting: the stream keeps each sequence's requests in order
        for sid, values in steps.items():
            grpc_client.async_stream_infer("accumulator", [value_input(grpcclient, values[i])], request_id=f"{sid}/{i}",
                                           sequence_id=sid, sequence_start=i == 0, sequence_end=i == 3)  # fmt: skip
    items = got.take(8)
    grpc_client.stop_stream()
    assert all(e is None for _, e in items)
    sums = {r.get_response().id: int(r.as_numpy("OUTPUT")[0][0]) for r, _ in items}
    assert sums == {f"{sid}/{i}": int(np.cumsum(v)[i]) for sid, v in steps.items() for i in range(4)}


def test_a_request_for_a_sequence_never_started_is_400(grpc_client, http_client):
    with pytest.raises(InferenceServerException) as over_http:
        http_client.infer("accumulator", [value_input(httpclient, 1)], sequence_id=777_001)
    assert over_http.value.status() == "400"
    assert ("inference request for sequence 777001 to model 'accumulator' must specify the START flag on the first "
            "request of the sequence") in over_http.value.message()  # fmt: skip
    with pytest.raises(InferenceServerException) as over_grpc:
        grpc_client.infer("accumulator", [value_input(grpcclient, 1)], sequence_id="never-started")
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
        http_client.infer("accumulator", [value_input(httpclient, 1)])


def test_more_live_sequences_than_the_model_allows_is_429(http_client):
    # "tiny" has one slot per replica and no backlog: of three sequences on two replicas, one finds no room.
    statuses = []
    for sid in ("full-1", "full-2", "full-3"):
        try:
            http_client.infer("tiny", [value_input(httpclient, 1)], sequence_id=sid, sequence_start=True)
            statuses.append("200")
        except InferenceServerException as exc:
            statuses.append(exc.status())
            assert "as many sequences as it allows" in exc.message()
    assert "429" in statuses and statuses.count("200") >= 1
    time.sleep(TINY_IDLE_S * 3)  # they idle out and free the slots for the next test


def test_an_idle_sequence_is_released(http_client):
    http_client.infer("tiny", [value_input(httpclient, 5)], sequence_id="dozes", sequence_start=True)
    assert int(http_client.infer("tiny", [value_input(httpclient, 5)], sequence_id="dozes").as_numpy("OUTPUT")[0][0]) == 10
    time.sleep(TINY_IDLE_S * 3)
    with pytest.raises(InferenceServerException) as released:
        http_client.infer("tiny", [value_input(httpclient, 5)], sequence_id="dozes")
    assert released.value.status() == "400" and "START flag" in released.value.message()


def test_a_sequence_whose_replica_is_killed_is_lost_and_starts_again_on_the_survivor(suite, http_client):
    sid = "twin-of-pump-7"
    assert int(http_client.infer("accumulator", [value_input(httpclient, 4)], sequence_id=sid,
                                 sequence_start=True).as_numpy("OUTPUT")[0][0]) == 4  # fmt: skip
    runtimes = [c for c in suite.supervisor.children if c.kind == "runtime" and c.alive]
    assert len(runtimes) == 2
    holder = max(runtimes, key=lambda c: rendezvous_weight(c.replica_id, sid))  # every gateway agrees on it
    os.kill(holder.process.pid, signal.SIGKILL)
    holder.process.wait(10)
    with pytest.raises(InferenceServerException) as lost:
        http_client.infer("accumulator", [value_input(httpclient, 4)], sequence_id=sid)
    assert lost.value.status() == "412"
    assert f"sequence {sid} of model 'accumulator' was lost" in lost.value.message()
    assert "start the sequence again" in lost.value.message()
    total = 0
    for i, v in enumerate([1, 2, 3]):
        result = http_client.infer("accumulator", [value_input(httpclient, v)], sequence_id=sid,
                                   sequence_start=i == 0, sequence_end=i == 2)  # fmt: skip
        total += v
        assert int(result.as_numpy("OUTPUT")[0][0]) == total
