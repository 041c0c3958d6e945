"""A split model served two ways: as a pipeline model the gateway runs stage by stage, and in edge mode.

Digits v2 is cut after its first layer (``aiworks split --pipeline``): the
stages are model folders of their own, and ``digits_pipe`` is the ensemble
that chains them. Both modes must answer what the unsplit model answers.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import internal_channel, start_suite

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, Status
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.runtime.client import RuntimeClient

CUT = "next_activations"  # after the first 4096-wide layer
WIDTH = 4096


@pytest.fixture(scope="module")
def pipeline_suite(model_repository, tmp_path_factory):
    from aiworks.lifecycle.pipeline import write_pipeline
    from aiworks.lifecycle.split import split_model

    root = tmp_path_factory.mktemp("pipeline")
    repo = root / "repo"
    (repo / "digits").mkdir(parents=True)
    shutil.copy(model_repository / "digits" / "config.pbtxt", repo / "digits")
    shutil.copytree(model_repository / "digits" / "2", repo / "digits" / "2")
    stages = split_model(repo / "digits" / "2" / "model.onnx", [[CUT]], repo, name="digits")
    write_pipeline(repo, "digits_pipe", stages, micro_batch_rows=8)
    suite = start_suite(repo, root / "logs", replicas=2, cache=False)
    yield suite, stages
    suite.supervisor.stop()


@pytest.fixture(scope="module")
def rows():
    from aiworks.demo.models import digits_split

    return digits_split()[1][:64].astype(np.float32)


def _http(suite, model: str, x: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        r = client.infer(model, [inp])
        return r.get_response(), r.as_numpy("label"), r.as_numpy("probabilities")
    finally:
        client.close()


def _stage_stats(suite, model: str) -> tuple[int, int]:
    """(rows, batches) the runtimes executed for a model, over every replica."""
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"]
    finally:
        client.close()
    return sum(int(s["inference_count"]) for s in stats), sum(int(s["execution_count"]) for s in stats)


def test_the_pipeline_answers_what_the_unsplit_model_answers_over_http_and_grpc(pipeline_suite, rows):
    suite, _ = pipeline_suite
    x = rows[:20]
    _, label, probabilities = _http(suite, "digits", x)  # the unsplit model, through the suite too

    meta, p_label, p_probabilities = _http(suite, "digits_pipe", x)
    assert (meta["model_name"], meta["model_version"]) == ("digits_pipe", "1")
    np.testing.assert_array_equal(p_label, label)
    np.testing.assert_allclose(p_probabilities, probabilities, rtol=1e-5, atol=1e-6)

    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        r = client.infer("digits_pipe", [inp], outputs=[grpcclient.InferRequestedOutput("probabilities")])
        assert [o.name for o in r.get_response().outputs] == ["probabilities"]
        np.testing.assert_allclose(r.as_numpy("probabilities"), probabilities, rtol=1e-5, atol=1e-6)
        assert client.is_model_ready("digits_pipe")
        assert client.get_model_config("digits_pipe").config.platform == "ensemble"
    finally:
        client.close()


def test_a_large_request_flows_through_the_stages_in_micro_batches(pipeline_suite, rows):
    suite, _ = pipeline_suite
    rows_before, batches_before = _stage_stats(suite, "digits_stage1")
    _, label, probabilities = _http(suite, "digits", rows)
    _, p_label, p_probabilities = _http(suite, "digits_pipe", rows)
    np.testing.assert_array_equal(p_label, label)
    np.testing.assert_allclose(p_probabilities, probabilities, rtol=1e-5, atol=1e-6)
    rows_after, batches_after = _stage_stats(suite, "digits_stage1")
    # 64 rows with micro_batch_rows 8: eight stage-1 batches, never joined back into one.
    assert (rows_after - rows_before, batches_after - batches_before) == (64, 8)


def test_concurrent_pipeline_requests_batch_at_each_stage_and_stay_correct(pipeline_suite, rows):
    suite, _ = pipeline_suite
    _, label, probabilities = _http(suite, "digits", rows)
    rows_before, batches_before = _stage_stats(suite, "digits_stage2")

    def one(i):
        n = 1 + i % 4
        start = (i * 5) % (len(rows) - n)
        _, p_label, p_probabilities = _http(suite, "digits_pipe", rows[start : start + n])
        np.testing.assert_array_equal(p_label, label[start : start + n])
        np.testing.assert_allclose(p_probabilities, probabilities[start : start + n], rtol=1e-5, atol=1e-6)
        return n

    with ThreadPoolExecutor(16) as pool:
        sent = sum(pool.map(one, range(96)))
    rows_after, batches_after = _stage_stats(suite, "digits_stage2")
    assert rows_after - rows_before == sent
    assert batches_after - batches_before < 96  # stage requests of different clients shared batches

    # The runtimes report their queues in their heartbeats (every second): wait for the next ones.
    deadline = time.monotonic() + 5
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            queues = {q.model for q in stub.Status(scheduler_pb2.StatusRequest(), timeout=5).queues}
            if {"digits_stage1", "digits_stage2"} <= queues or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert {"digits_stage1", "digits_stage2"} <= queues and "digits_pipe" not in queues


def test_the_runtime_does_not_load_the_pipeline_itself(pipeline_suite, rows):
    suite, _ = pipeline_suite
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as channel:
        status = scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(scheduler_pb2.StatusRequest(), timeout=5)

    async def ask_a_replica() -> AIWorksError:
        sup = suite.supervisor
        client = RuntimeClient(status.replicas[0].address, 1 << 26, 10.0, sup.client_tls_for("gateway"),
                               caller=sup.client_caller("gateway"))  # fmt: skip
        try:
            request = InferRequest("digits_pipe", "1", [Tensor("input", "FP32", (1, 64), rows[:1].tobytes())])
            with pytest.raises(AIWorksError) as refused:
                await client.infer(request, RequestOptions())
            return refused.value
        finally:
            await client.close()

    refused = asyncio.run(ask_a_replica())
    assert refused.status is Status.INVALID_ARGUMENT
    assert "pipeline" in refused.message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_edge_mode_runs_the_front_stage_here_and_the_back_stage_in_the_suite(pipeline_suite, rows, protocol):
    from aiworks.lifecycle.edge import EdgeClient

    suite, stages = pipeline_suite
    x = rows[:16]
    _, label, probabilities = _http(suite, "digits", x)
    url = suite.http_url if protocol == "http" else suite.grpc_url
    with EdgeClient(stages[0], url, "digits_stage2", protocol=protocol) as edge:
        result = edge.infer({"input": x})
    np.testing.assert_array_equal(result.outputs["label"], label)
    np.testing.assert_allclose(result.outputs["probabilities"], probabilities, rtol=1e-5, atol=1e-6)
    assert result.input_bytes == x.nbytes == 16 * 64 * 4
    assert result.sent_bytes == 16 * WIDTH * 4  # this cut sends 64x the raw input
    assert result.body_bytes >= result.sent_bytes
