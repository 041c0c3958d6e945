"""What the triton backend hands Triton, and how it reads Triton back; no server needed."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from triton_support import IRIS_TRITON_CONFIG, TESTDATA
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from aiworks.core.errors import DeadlineExceeded, Internal, InvalidArgument, Unavailable
from aiworks.core.model_config import parse_config
from aiworks.runtime.triton_protocol import as_error, parse_device_metrics, triton_config
from aiworks.runtime.tritonserver import TritonDistribution, TritonServerError

GPU_ONNX = """\
backend: "triton"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { preferred_batch_size: [ 16, 32 ] max_queue_delay_microseconds: 1000 }
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
"""


def written(text: str, name: str, versions=(1,), kind=None) -> model_config_pb2.ModelConfig:
    config = parse_config(text, fmt="pbtxt", model_name=name)
    return text_format.Parse(triton_config(config, versions, kind), model_config_pb2.ModelConfig())


def test_an_onnx_gpu_model_keeps_its_platform_instances_and_parameters():
    msg = written(GPU_ONNX, "embedder", versions=[3, 1])
    assert msg.name == "embedder"
    assert msg.platform == "onnxruntime_onnx" and msg.backend == ""
    assert msg.max_batch_size == 32
    group = msg.instance_group[0]
    assert (group.count, group.kind, list(group.gpus)) == (2, model_config_pb2.ModelInstanceGroup.KIND_GPU, [0])
    assert list(msg.version_policy.specific.versions) == [1, 3]
    assert msg.parameters["intra_op_thread_count"].string_value == "2"
    # Triton holds the batch window as written (the replica advertises none to the scheduler).
    assert msg.dynamic_batching.max_queue_delay_microseconds == 1000
    assert list(msg.dynamic_batching.preferred_batch_size) == [16, 32]


def test_the_response_cache_stays_with_the_suite():
    msg = written(GPU_ONNX + "response_cache { enable: true }\n", "embedder")
    assert not msg.HasField("response_cache")


def test_a_tensorrt_plan_model():
    msg = written(GPU_ONNX.replace("onnxruntime_onnx", "tensorrt_plan"), "embedder_trt")
    assert msg.platform == "tensorrt_plan"


def test_the_python_stand_in_uses_tritons_python_backend_and_can_be_moved_to_the_cpu():
    msg = written(IRIS_TRITON_CONFIG, "iris_triton", versions=[1, 2], kind="KIND_CPU")
    assert msg.backend == "python" and msg.platform == ""
    assert "triton_backend" not in msg.parameters
    assert [g.kind for g in msg.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    # reshape stays: Triton shows the label as [1] per row, the model makes [].
    assert list(msg.output[0].reshape.shape) == []


def test_a_model_without_instance_groups_gets_one_of_the_forced_kind():
    text = GPU_ONNX.replace("instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]\n", "")
    msg = written(text, "m", kind="KIND_CPU")
    assert [(g.count, g.kind) for g in msg.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]


def test_device_metrics_are_parsed_per_gpu():
    metrics = parse_device_metrics((TESTDATA / "gpu_metrics.txt").read_text())
    assert metrics["nv_gpu_utilization"] == {"GPU-a1b2": 0.73, "GPU-c3d4": 0.0}
    assert metrics["nv_gpu_memory_used_bytes"]["GPU-a1b2"] == 2147483648
    assert metrics["nv_gpu_memory_total_bytes"]["GPU-c3d4"] == 150754820096
    assert metrics["nv_energy_consumption"]["GPU-a1b2"] == 8123.5  # a counter keeps Triton's name
    assert metrics["nv_cpu_utilization"] == {"": 0.12}
    assert "nv_inference_count" not in metrics  # per-model counters are not device metrics


@pytest.mark.parametrize(
    "status, kind",
    [
        ("StatusCode.UNAVAILABLE", Unavailable),
        ("StatusCode.NOT_FOUND", Unavailable),
        ("StatusCode.INVALID_ARGUMENT", InvalidArgument),
        ("StatusCode.DEADLINE_EXCEEDED", DeadlineExceeded),
        ("StatusCode.INTERNAL", Internal),
        (None, Internal),
    ],
)
def test_triton_errors_map_onto_the_suites(status, kind):
    error = as_error(InferenceServerException("boom", status=status), "model 'm'")
    assert type(error) is kind
    assert str(error) == "model 'm': Triton says: boom"


def test_a_missing_tritonserver_binary_is_reported(tmp_path):
    with pytest.raises(TritonServerError, match="does not exist"):
        TritonDistribution.find(tmp_path / "bin" / "tritonserver")


def test_a_triton_at_a_url_gets_its_metrics_url_from_the_metrics_port(tmp_path):
    from aiworks.runtime import triton_backend
    from aiworks.runtime.settings import RuntimeSettings
    from aiworks.supervisor.supervisor import free_port

    settings = RuntimeSettings(scheduler_address="", triton_url=f"127.0.0.1:{free_port()}",
                               triton_repository=tmp_path, triton_metrics_port=8002)  # fmt: skip
    conn = triton_backend.connect(settings)
    try:
        assert conn.metrics_url == "http://127.0.0.1:8002/metrics"
    finally:
        conn.close()
