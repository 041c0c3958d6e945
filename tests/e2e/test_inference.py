"""tritonclient over HTTP (binary and JSON) and gRPC gets what onnxruntime gives in-process."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from aiworks.demo.models import digits_split, iris_data

CASES = [("iris", "1", 4), ("digits", "1", 64), ("digits", "2", 64)]


def reference(repo, model, version, x):
    session = ort.InferenceSession(str(repo / model / version / "model.onnx"), providers=["CPUExecutionProvider"])
    label, probabilities = session.run(["label", "probabilities"], {"input": x})
    # The config says dims [1] reshape [] for the label: the model makes one scalar a row, clients see [N, 1].
    return label.reshape(-1, 1), probabilities


def sample(model: str, rows: int) -> np.ndarray:
    x = iris_data()[0] if model == "iris" else digits_split()[1]
    return np.ascontiguousarray(x[:rows], dtype=np.float32)


@pytest.mark.parametrize("model,version,features", CASES)
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_matches_onnxruntime(suite, http_client, model, version, features, binary):
    x = sample(model, 5)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]
    result = http_client.infer(model, [inp], model_version=version, outputs=outputs)
    label, probabilities = reference(suite.model_repository, model, version, x)
    np.testing.assert_array_equal(result.as_numpy("label"), label)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-5, atol=1e-6)
    assert result.get_response()["model_version"] == version


@pytest.mark.parametrize("model,version,features", CASES)
def test_grpc_matches_onnxruntime(suite, grpc_client, model, version, features):
    x = sample(model, 7)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = grpc_client.infer(model, [inp], model_version=version)
    label, probabilities = reference(suite.model_repository, model, version, x)
    np.testing.assert_array_equal(result.as_numpy("label"), label)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-5, atol=1e-6)


def test_default_binary_outputs_without_requested_outputs(suite, http_client):
    """tritonclient asks for binary_data_output when no outputs are named."""
    x = sample("iris", 3)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = http_client.infer("iris", [inp])
    label, _ = reference(suite.model_repository, "iris", "1", x)
    np.testing.assert_array_equal(result.as_numpy("label"), label)
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])


def test_one_requested_output_only(suite, grpc_client):
    x = sample("digits", 2)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = grpc_client.infer("digits", [inp], outputs=[grpcclient.InferRequestedOutput("label")])
    assert result.as_numpy("label").shape == (2, 1)
    assert result.as_numpy("probabilities") is None


def test_latest_version_by_default(suite, http_client):
    meta = http_client.get_model_metadata("digits")
    assert meta["versions"] == ["1", "2"]
    x = sample("digits", 1)
    inp = httpclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    assert http_client.infer("digits", [inp]).get_response()["model_version"] == "2"
