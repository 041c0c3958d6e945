"""aiworks convert: each framework available here converts to a model folder that runs and matches."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import pytest

from aiworks.core.model_config import read_config
from aiworks.lifecycle.cli import EXIT_UNSUPPORTED_OPS, add_lifecycle_parsers
from aiworks.lifecycle.convert import InputSpec, convert, detect_framework, parse_input_spec
from aiworks.lifecycle.opcheck import check_ops
from aiworks.lifecycle.sessions import open_session


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="aiworks")
    add_lifecycle_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    try:
        args.func(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_pytorch_torchscript_converts_and_matches(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    torch.jit.save(torch.jit.trace(net, torch.randn(2, 8)), tmp_path / "net.pt")

    result = convert(tmp_path / "net.pt", tmp_path / "repo", inputs=[InputSpec("x", (2, 8))])

    assert result.framework == "pytorch" and result.report.ok
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-5
    config = read_config(result.folder)
    assert config.max_batch_size == 64 and config.batching.enabled
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("x", "FP32", (8,))]
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("output", "FP32", (3,))]
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)  # another batch size
    got = open_session(result.model_path).run(None, {"x": x})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_pytorch_pickled_module_via_cli(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3), torch.nn.Flatten()), tmp_path / "conv.pth")
    code = run_cli("convert", str(tmp_path / "conv.pth"), "--out", str(tmp_path / "repo"), "--input", "signal:1x2x10")
    assert code == 0
    config = read_config(tmp_path / "repo" / "conv")
    assert config.inputs[0].name == "signal" and config.inputs[0].dims == (2, 10)
    assert config.outputs[0].dims == (32,)


def test_sklearn_pipeline_converts_and_matches(tmp_path):
    import joblib
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from aiworks.demo.models import iris_data

    x, y = iris_data()
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(x, y)
    joblib.dump(model, tmp_path / "iris.joblib")

    result = convert(tmp_path / "iris.joblib", tmp_path / "repo")

    assert result.framework == "sklearn" and result.report.ok and result.max_abs_diff == 0
    labels, probabilities = open_session(result.model_path).run(["label", "probabilities"], {"input": x})
    np.testing.assert_array_equal(labels, model.predict(x))
    np.testing.assert_allclose(probabilities, model.predict_proba(x), atol=1e-5)
    config = read_config(result.folder)
    # Triton's meaning of reshape: clients see dims ([1] a row), the model makes reshape.shape ([] a row).
    assert {t.name: (t.dims, t.reshape) for t in config.outputs} == {"label": ((1,), ()), "probabilities": ((3,), None)}


def test_onnx_passthrough_checks_and_infers_shapes(digits_v1, tmp_path):
    result = convert(digits_v1, tmp_path / "repo", name="digits")
    assert result.framework == "onnx" and result.report.ok
    written = onnx.load(str(result.model_path))
    assert len(written.graph.value_info) > 0  # shape inference ran
    config = read_config(result.folder)
    assert [(t.name, t.dims) for t in config.inputs] == [("input", (64,))]
    assert {t.name: (t.datatype, t.dims, t.reshape) for t in config.outputs} == {
        "label": ("INT64", (1,), ()),
        "probabilities": ("FP32", (10,), None),
    }


def test_onnx_passthrough_rejects_a_broken_graph(tmp_path):
    from onnx import TensorProto, helper

    node = helper.make_node("Relu", ["missing"], ["y"])
    graph = helper.make_graph(
        [node],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "broken.onnx")
    with pytest.raises(onnx.checker.ValidationError):
        convert(tmp_path / "broken.onnx", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_tensorflow_keras_converts_and_matches(tmp_path):
    pytest.importorskip(
        "tensorflow",
        reason="TensorFlow is an optional extra (~1.4 GB: pip install tensorflow-cpu==2.21.0 tf2onnx==1.17.0)",
    )
    pytest.importorskip("tf2onnx")
    import tensorflow as tf

    model = tf.keras.Sequential(
        [tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(3)]
    )
    model.save(tmp_path / "k.keras")
    result = convert(tmp_path / "k.keras", tmp_path / "repo")
    assert result.framework == "tensorflow" and result.report.ok
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-4


def test_tensorrt_target_reports_unsupported_ops_and_exits_3(digits_v1, tmp_path, capsys):
    code = run_cli("convert", str(digits_v1), "--name", "d", "--out", str(tmp_path), "--target", "tensorrt")
    out = capsys.readouterr().out
    assert code == EXIT_UNSUPPORTED_OPS
    assert "LinearClassifier" in out and "UNSUPPORTED" in out and "ai.onnx.ml" in out
    assert "tensorrt" in (tmp_path / "d" / "config.pbtxt").read_text()  # the accelerator is configured


def test_convert_shows_its_steps_on_stderr_unless_told_not_to(digits_v1, tmp_path, capsys):
    assert run_cli("convert", str(digits_v1), "--name", "d", "--out", str(tmp_path)) == 0
    captured = capsys.readouterr()
    steps = [line for line in captured.err.splitlines() if line.startswith("convert [")]
    assert [s.split(" ")[1] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert "loading the onnx model" in steps[0] and "onnxruntime" in steps[4]
    assert "convert [" not in captured.out  # stdout keeps only the summary
    assert run_cli("convert", str(digits_v1), "--name", "e", "--out", str(tmp_path), "--no-progress") == 0
    assert "convert [" not in capsys.readouterr().err


def test_onnxruntime_check_flags_an_unknown_op_and_accepts_custom_ops():
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
    )
    report = check_ops(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not report.ok and [o.op for o in report.unsupported] == ["NoSuchOp"]
    assert "NoSuchOp" in report.format()


def test_framework_detection_and_input_specs(tmp_path):
    assert detect_framework(tmp_path / "m.onnx") == "onnx"
    assert detect_framework(tmp_path / "m.joblib") == "sklearn"
    assert detect_framework(tmp_path / "m.pt") == "pytorch"
    assert detect_framework(tmp_path / "m.keras") == "tensorflow"
    with pytest.raises(ValueError, match="--framework"):
        detect_framework(tmp_path / "m.bin")
    assert parse_input_spec("1x64") == InputSpec("input", (1, 64), "float32")
    assert parse_input_spec("ids:2x16:int64") == InputSpec("ids", (2, 16), "int64")
    assert parse_input_spec("1x3:float16") == InputSpec("input", (1, 3), "float16")
