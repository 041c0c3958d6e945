"""aiworks.lifecycle.tensorrt_build.build_engine: checks that run anywhere, and a real build where TensorRT and a GPU are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from aiworks.lifecycle.tensorrt_build import TensorRTUnavailable, build_engine

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


def test_optimize_tensorrt_says_clearly_when_tensorrt_or_a_gpu_is_missing(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "tiny" / "1"
    folder.mkdir(parents=True)
    tiny_mlp(folder / "model.onnx")
    done = subprocess.run([sys.executable, "-m", "aiworks", "optimize", str(tmp_path / "tiny"), "--tensorrt",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)  # fmt: skip
    if HAS_TENSORRT and HAS_GPU:
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "out" / "tiny_trt" / "1" / "model.plan").is_file()
        assert 'platform: "tensorrt_plan"' in (tmp_path / "out" / "tiny_trt" / "config.pbtxt").read_text()
    else:
        assert done.returncode == 4, done.stderr
        assert "tensorrt" in done.stderr and "GPU" in done.stderr
        assert not (tmp_path / "out" / "tiny_trt").exists()


def test_profiles_and_the_engines_config(tmp_path):
    import onnx

    from aiworks.core.model_config import parse_config
    from aiworks.lifecycle.tensorrt_plan import default_profile, parse_profile, plan_config

    assert parse_profile("input_ids:1x16/32x128/64x128") == ("input_ids", ((1, 16), (32, 128), (64, 128)))
    with pytest.raises(ValueError, match="NAME:MIN/OPT/MAX"):
        parse_profile("input_ids:1x16")
    model = onnx.load(str(tiny_mlp(tmp_path / "model.onnx")))
    assert default_profile(model, 32, {}) == {"input": ((1, 16), (16, 16), (32, 16))}
    config = parse_config(plan_config("tiny_trt", model, 32, "fp16"), fmt="pbtxt", model_name="tiny_trt")
    assert (config.platform, config.backend, config.max_batch_size) == ("tensorrt_plan", "triton", 32)
    assert [(t.name, t.dims) for t in config.inputs] == [("input", (16,))]
