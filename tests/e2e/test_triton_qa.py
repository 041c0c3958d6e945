"""Triton's example models (aiworks.demo.triton_qa) served by the whole suite, checked with tritonclient.

One suite of its own over ``simple``, ``simple_int8``, ``simple_string``, ``simple_identity``,
``densenet_onnx`` and ``simple_sequence``, plus three variants of ``simple`` that exercise ``model_warmup``:
one whose configured warm-up runs (zero and random data), one whose configured warm-up cannot run (its
load fails, as in Triton), and one whose *default* warm-up cannot run (it still loads).
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import start_suite
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from aiworks.demo.qa_streaming import build_qa_streaming_models
from aiworks.demo.triton_qa import build_triton_qa_models, simple_onnx

WARMUP = """
model_warmup [
  {{
    name: "zeros" batch_size: 2 count: 2
    inputs {{ key: "INPUT0" value: {{ data_type: TYPE_INT32 dims: [ {dims} ] zero_data: true }} }}
    inputs {{ key: "INPUT1" value: {{ data_type: TYPE_INT32 dims: [ {dims} ] zero_data: true }} }}
  }},
  {{
    name: "random" batch_size: 8
    inputs {{ key: "INPUT0" value: {{ data_type: TYPE_INT32 dims: [ {dims} ] random_data: true }} }}
    inputs {{ key: "INPUT1" value: {{ data_type: TYPE_INT32 dims: [ {dims} ] random_data: true }} }}
  }}
]
"""


def _simple_variant(repo, name: str, config_tail: str, dims: int = 16) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.onnx").write_bytes(simple_onnx("INT32"))
    config = (repo / "simple" / "config.pbtxt").read_text().replace('"simple"', f'"{name}"')
    (repo / name / "config.pbtxt").write_text(config.replace("dims: [ 16 ]", f"dims: [ {dims} ]") + config_tail)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton-qa") / "repo"
    build_triton_qa_models(repo)
    build_qa_streaming_models(repo, ["simple_sequence"])
    _simple_variant(repo, "simple_warm", WARMUP.format(dims=16))
    _simple_variant(repo, "simple_bad_warm", WARMUP.format(dims=15))  # the model cannot take [N, 15]
    # The config says [15] where the model takes [16]: the suite's own row of zeros fails, the load must not.
    _simple_variant(repo, "simple_bad_default", "", dims=15)
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


def _inputs(module, arrays: dict[str, np.ndarray]):
    tensors = []
    for name, array in arrays.items():
        t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    return tensors


def _shape(meta, which: str, client) -> list[int]:
    tensor = (meta[which] if isinstance(meta, dict) else getattr(meta, which))[0]
    return [int(d) for d in (tensor["shape"] if isinstance(tensor, dict) else tensor.shape)]


@pytest.mark.parametrize("model,dtype", [("simple", np.int32), ("simple_int8", np.int8)])
def test_simple_and_simple_int8_add_and_subtract(client, model, dtype):
    a = np.arange(32, dtype=dtype).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=dtype)
    result = client.infer(model, _inputs(client.module, {"INPUT0": a, "INPUT1": b}))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    meta = client.get_model_metadata(model)
    assert _shape(meta, "inputs", client) == [-1, 16] and _shape(meta, "outputs", client) == [-1, 16]


def test_simple_string_adds_decimal_strings(client):
    a = np.array([[str(i) for i in range(16)]], dtype=np.object_)
    b = np.array([["1"] * 16], dtype=np.object_)
    result = client.infer("simple_string", _inputs(client.module, {"INPUT0": a, "INPUT1": b}))
    assert [int(x) for x in result.as_numpy("OUTPUT0")[0]] == [i + 1 for i in range(16)]
    assert [int(x) for x in result.as_numpy("OUTPUT1")[0]] == [i - 1 for i in range(16)]


def test_simple_identity_echoes_strings(client):
    words = np.array([[b"hello", b"triton", b"\x00bytes"]], dtype=np.object_)
    result = client.infer("simple_identity", _inputs(client.module, {"INPUT0": words}))
    assert result.as_numpy("OUTPUT0").tolist() == words.tolist()


def test_densenet_shows_and_takes_its_dims_not_its_reshape(client):
    meta = client.get_model_metadata("densenet_onnx")
    assert _shape(meta, "inputs", client) == [3, 224, 224]
    assert _shape(meta, "outputs", client) == [1000]
    image = np.random.default_rng(1).random((3, 224, 224), dtype=np.float32)
    scores = client.infer("densenet_onnx", _inputs(client.module, {"data_0": image})).as_numpy("fc6_1")
    assert scores.shape == (1000,) and abs(float(scores.sum()) - 1.0) < 1e-3  # a softmax over 1000 classes
    with pytest.raises(InferenceServerException) as err:  # a batch the model does not take, as Triton refuses it
        client.infer("densenet_onnx", _inputs(client.module, {"data_0": image[None]}))
    assert "expects [3, 224, 224]" in err.value.message()


def test_densenet_config_keeps_reshape_and_labels(suite):
    config = httpclient.InferenceServerClient(suite.http_url).get_model_config("densenet_onnx")
    assert [int(d) for d in config["input"][0]["dims"]] == [3, 224, 224]
    assert [int(d) for d in config["input"][0]["reshape"]["shape"]] == [1, 3, 224, 224]
    assert [int(d) for d in config["output"][0]["reshape"]["shape"]] == [1, 1000, 1, 1]
    assert config["input"][0]["format"] == "FORMAT_NCHW"  # the image clients read it
    grpc_config = grpcclient.InferenceServerClient(suite.grpc_url).get_model_config("densenet_onnx").config
    assert list(grpc_config.output[0].reshape.shape) == [1, 1000, 1, 1] and list(grpc_config.output[0].dims) == [1000]
    assert grpc_config.input[0].format == grpcclient.model_config_pb2.ModelInput.FORMAT_NCHW
    assert (suite.model_repository / "densenet_onnx" / "densenet_labels.txt").read_text().count("\n") == 1000


def test_unknown_model_and_version_answer_in_tritons_words(suite, client):
    grpc_side = client.module is grpcclient
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.message().startswith("Request for unknown model: 'nope' is not found")
    assert err.value.status() == ("StatusCode.INVALID_ARGUMENT" if grpc_side else "400")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("simple", model_version="99")
    assert err.value.message().startswith("Request for unknown model: 'simple' version 99 is not found")
    assert err.value.status() == ("StatusCode.NOT_FOUND" if grpc_side else "404")
    a = np.zeros((1, 16), np.int32)
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", _inputs(client.module, {"INPUT0": a, "INPUT1": a}))
    assert err.value.message().startswith("Request for unknown model: 'nope' is not found")
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", _inputs(client.module, {"INPUT0": a, "INPUT1": a}), model_version="99")
    assert err.value.message().startswith("Request for unknown model: 'simple' version 99 is not found")


def test_plain_http_carries_the_same_words(suite):
    resp = requests.get(f"{suite.base}/v2/models/nope", timeout=10)
    assert resp.status_code == 400 and resp.json() == {"error": "Request for unknown model: 'nope' is not found"}
    resp = requests.get(f"{suite.base}/v2/models/simple/versions/99", timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"].startswith("Request for unknown model: 'simple' version 99 is not found")


def test_models_whose_default_warm_up_fails_still_load(client):
    # simple_string: the suite's own warm-up sends empty strings, which Cast to INT32 refuses.
    # simple_bad_default: its config's dims do not fit the model; the suite's warm-up fails, the load does not.
    # simple_sequence: its control inputs are the sequence batcher's; no invented batch could run.
    for model in ("simple_string", "simple_bad_default", "simple_sequence"):
        assert client.is_model_ready(model), model


def test_configured_model_warmup_runs_and_a_failing_one_fails_the_load(suite, client):
    assert client.is_model_ready("simple_warm")
    a = np.ones((1, 16), np.int32)
    result = client.infer("simple_warm", _inputs(client.module, {"INPUT0": a, "INPUT1": a}))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
    stats = requests.get(f"{suite.base}/v2/models/simple_warm/stats", timeout=10).json()["model_stats"]
    assert sum(int(s.get("inference_count", 0)) for s in stats) <= 2  # warm-up rows (12) are not inferences

    with pytest.raises(InferenceServerException) as err:  # as Triton: in the repository, nothing loaded
        client.get_model_metadata("simple_bad_warm")
    assert err.value.message().startswith("Request for unknown model: 'simple_bad_warm' has no available versions")
    assert "failed to run warmup sample 'zeros'" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.load_model("simple_bad_warm")
    message = err.value.message()
    assert "failed to load 'simple_bad_warm' version 1: failed to run warmup sample 'zeros'" in message, message
    assert str(suite.model_repository) not in message  # never the server's paths
    if client.module is httpclient:
        assert not client.is_model_ready("simple_bad_warm")
    else:  # Triton's gRPC ModelReady answers a model with no available version with NOT_FOUND
        with pytest.raises(InferenceServerException, match="has no available versions"):
            client.is_model_ready("simple_bad_warm")
