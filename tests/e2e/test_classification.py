"""Triton's classification extension served by the whole suite, checked with tritonclient (HTTP and gRPC).

A requested output with ``class_count=N`` comes back as a BYTES tensor of the top N classes per row,
``"value:index:label"`` where the output has a ``label_filename`` and ``"value:index"`` where it has none.
Each answer is checked against a top N computed here from the raw output of the same input.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import start_suite
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from aiworks.demo.triton_qa import build_triton_qa_models

# An ensemble of one step over ``simple``: the gateway runs it, so its outputs cannot be classified.
ENSEMBLE = """
name: "simple_ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [ {
  model_name: "simple" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "SUM" }
} ] }
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    repo = tmp_path_factory.mktemp("classify") / "repo"
    build_triton_qa_models(repo, ["densenet_onnx", "simple", "simple_string"])
    (repo / "simple_ensemble" / "1").mkdir(parents=True)
    (repo / "simple_ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    s = start_suite(repo, tmp_path_factory.mktemp("logs"), cache=False)
    yield s
    s.supervisor.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, suite):
    module = httpclient if request.param == "http" else grpcclient
    c = module.InferenceServerClient(suite.http_url if request.param == "http" else suite.grpc_url)
    c.module = module
    yield c
    c.close()


def _infer(client, model: str, arrays: dict[str, np.ndarray], output: str, class_count: int = 0):
    inputs = []
    for name, array in arrays.items():
        t = client.module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    wanted = [client.module.InferRequestedOutput(output, class_count=class_count)]
    return client.infer(model, inputs, outputs=wanted).as_numpy(output)


def _expected(row: np.ndarray, n: int, labels: list[str] | None) -> list[str]:
    """The top ``n`` of ``row`` as Triton writes them: C's %f for floats, the value as is for integers."""
    order = sorted(range(row.size), key=lambda i: (-row[i], i))[:n]
    text = [f"{float(row[i]):f}:{i}" if row.dtype.kind == "f" else f"{int(row[i])}:{i}" for i in order]
    return [f"{t}:{labels[i]}" for t, i in zip(text, order)] if labels is not None else text


def test_densenet_top3_carries_values_indices_and_labels(suite, client):
    labels = (suite.model_repository / "densenet_onnx" / "densenet_labels.txt").read_text().splitlines()
    image = np.random.default_rng(7).random((3, 224, 224), dtype=np.float32)
    raw = _infer(client, "densenet_onnx", {"data_0": image}, "fc6_1")
    assert raw.shape == (1000,) and raw.dtype == np.float32
    top = _infer(client, "densenet_onnx", {"data_0": image}, "fc6_1", class_count=3)
    assert top.shape == (3,)  # max_batch_size 0: [N]
    got = [s.decode() for s in top.tolist()]
    assert got == _expected(raw, 3, labels)
    value, index, label = got[0].split(":", 2)
    assert int(index) == int(np.argmax(raw)) and label == labels[int(np.argmax(raw))] and label
    assert abs(float(value) - float(raw.max())) < 1e-6


def test_model_without_labels_gives_value_index_per_batch_row(client):
    rng = np.random.default_rng(3)
    a = rng.integers(-50, 50, size=(2, 16), dtype=np.int32)
    b = rng.integers(-50, 50, size=(2, 16), dtype=np.int32)
    raw = _infer(client, "simple", {"INPUT0": a, "INPUT1": b}, "OUTPUT0")
    np.testing.assert_array_equal(raw, a + b)
    top = _infer(client, "simple", {"INPUT0": a, "INPUT1": b}, "OUTPUT0", class_count=4)
    assert top.shape == (2, 4)  # a batching model: [batch, N]
    assert [[s.decode() for s in row] for row in top.tolist()] == [_expected(r, 4, None) for r in raw]
    # N beyond the class count is capped at it, as in Triton.
    assert _infer(client, "simple", {"INPUT0": a, "INPUT1": b}, "OUTPUT0", class_count=50).shape == (2, 16)


def test_config_shows_label_filename(suite):
    config = httpclient.InferenceServerClient(suite.http_url).get_model_config("densenet_onnx")
    assert config["output"][0]["label_filename"] == "densenet_labels.txt"
    grpc_config = grpcclient.InferenceServerClient(suite.grpc_url).get_model_config("densenet_onnx").config
    assert grpc_config.output[0].label_filename == "densenet_labels.txt"


def test_classifying_a_string_output_is_refused_naming_it(client):
    words = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "simple_string", {"INPUT0": words, "INPUT1": words}, "OUTPUT0", class_count=2)
    assert "OUTPUT0" in err.value.message() and "numeric" in err.value.message()
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_a_negative_class_count_is_refused_naming_the_output(client):
    x = np.ones((1, 16), dtype=np.int32)
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "simple", {"INPUT0": x, "INPUT1": x}, "OUTPUT0", class_count=-2)
    assert "classification" in err.value.message() and "OUTPUT0" in err.value.message()


@pytest.mark.parametrize("count", [0, -1, 2.5, "3", True])
def test_http_classification_must_be_a_positive_integer(suite, count):
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))} for n in ("INPUT0", "INPUT1")
        ],
        "outputs": [{"name": "OUTPUT1", "parameters": {"classification": count}}],
    }
    r = requests.post(f"http://{suite.http_url}/v2/models/simple/infer", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "OUTPUT1" in r.json()["error"] and "classification" in r.json()["error"]


def test_classifying_an_ensemble_output_is_refused(client):
    x = np.arange(16, dtype=np.int32)[None]
    np.testing.assert_array_equal(_infer(client, "simple_ensemble", {"A": x, "B": x}, "SUM"), x + x)
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "simple_ensemble", {"A": x, "B": x}, "SUM", class_count=2)
    assert "ensemble" in err.value.message() and "SUM" in err.value.message()
