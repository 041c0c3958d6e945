"""aiworks.runtime.tensorrt.build_engine: checks that run anywhere, and a real build where TensorRT and a GPU are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from aiworks.runtime.tensorrt import TensorRTUnavailable, build_engine

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
HAS_GPU = Path("/dev/nvidiactl").exists()


def tiny_mlp(path: Path) -> Path:
    """A 16 -> 32 -> 4 MLP with a dynamic batch dim, in plain ONNX ops TensorRT parses."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(32, np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Relu", ["hb"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["output"]),
        ],
        "tiny_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_arguments_are_checked_before_tensorrt_is_needed(tmp_path):
    onnx_path = tiny_mlp(tmp_path / "model.onnx")
    with pytest.raises(ValueError, match="precision"):
        build_engine(onnx_path, tmp_path / "model.plan", precision="fp8")
    with pytest.raises(ValueError, match="min <= opt <= max"):
        build_engine(onnx_path, tmp_path / "model.plan", profiles=[{"input": ((8, 16), (1, 16), (64, 16))}])
    with pytest.raises(ValueError, match="does not exist"):
        build_engine(tmp_path / "missing.onnx", tmp_path / "model.plan")


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here; this checks the error without it")
def test_without_tensorrt_the_error_says_what_is_needed(tmp_path):
    with pytest.raises(TensorRTUnavailable, match="tensorrt.*GPU|GPU.*tensorrt"):
        build_engine(tiny_mlp(tmp_path / "model.onnx"), tmp_path / "model.plan")


@pytest.mark.skipif(not (HAS_TENSORRT and HAS_GPU), reason="needs the tensorrt package and an NVIDIA GPU (none here)")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_builds_an_engine_that_tensorrt_loads(tmp_path, precision):
    import tensorrt as trt

    plan = build_engine(
        tiny_mlp(tmp_path / "model.onnx"),
        tmp_path / "1" / "model.plan",
        precision,
        profiles=[{"input": ((1, 16), (8, 16), (64, 16))}],
    )
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    assert names == {"input", "output"}
